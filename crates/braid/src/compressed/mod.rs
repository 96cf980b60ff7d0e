//! Compressed all-reduce: the codecs of `braid-compress` wired into the collectives.
//!
//! Each codec family needs its own way through the network, because what can be summed on the wire
//! differs ([`braid_compress::Transport`]):
//!
//! * fp16/bf16 casts and random-k with a shared seed are closed under addition, so their compressed form
//!   rides the ordinary all-reduce ([`CompressedPath::SumClosed`]);
//! * PowerSGD sums its two factors one at a time, orthogonalising in between, and warm-starts from the
//!   last summed `Q` ([`CompressedPath::PowerIteration`]); each rank's error buffer keeps what its own share
//!   of the approximation, `P·(Mᵀ·P)ᵀ`, missed, so the ranks' errors add up to what the summed
//!   approximation missed. Given the bucket's [layer shapes](CompressionConfig::layers), each weight is
//!   factorised as its own matrix and 1-D tensors are summed exactly, with every layer's P (and the
//!   exact parts) in one all-reduce and every Q in another;
//! * top-k carries per-rank indices: ranks all-gather their `(index, value)` pairs and every rank sums them
//!   in rank order ([`CompressedPath::SparseAllGather`]); or, so that a rank's traffic does not grow with
//!   the rank count, each rank sends every range of the index space only to that range's owner, which
//!   sums its range in rank order, keeps about `k/n` of it (what it drops stays in a second error buffer
//!   for the range) and all-gathers what it kept ([`CompressedPath::SparseReduceScatter`], Ok-Topk);
//!   [`CompressionConfig::sparse_path`] picks (gathering by default; `auto` asks the traffic model,
//!   [`sparse_model`]). When the sparse data would be dense enough, a dense all-reduce of the sparse
//!   updates is cheaper ([`CompressedPath::SparseDenseSwitch`], SparCML);
//! * int8 and sign carry per-rank scales: DeepSpeed's two-phase scheme exchanges compressed shards
//!   all-to-all, reduces each shard in f32 on its owner, re-compresses it with a second error buffer and
//!   all-gathers the compressed shards ([`CompressedPath::TwoPhase`]).
//!
//! Every rank decodes the same bytes and sums in the same order, so results are bit-identical across
//! ranks. Error feedback remembers what compression dropped and adds it to the next gradient; the
//! statistics of each local compression step (gradient norm, compression error, density, staleness) come
//! back in a [`CompressedReport`] and are logged at debug level under the target `braid::compress`.

use std::fmt;

pub(crate) use carry::Carried;

use braid_compress::power_sgd::Plan;
use braid_compress::{build_codec, ErrorFeedback, Layout, Staleness, Stats, DEFAULT_DENSITY};
pub use braid_compress::{BoxedCodec, CodecSpec, DensityWarmup};
use braid_core::{parse_bool, Error};
/// The sparse all-reduce's partition, routing and traffic model.
pub use braid_sched::sparse::{self as sparse_model, SparsePath};

/// Bytes of a compressed tensor's header (`braid_compress::wire`).
const HEADER: usize = braid_compress::wire::HEADER_BYTES;

/// What braid does with a codec: the path its tensors take, and whether it sends indices.
trait PathOf {
    fn nominal_path(&self) -> CompressedPath;
    fn sends_indices(&self) -> bool;
}

impl PathOf for CodecSpec {
    /// The path a tensor compressed with this codec takes (before any dense switch).
    fn nominal_path(&self) -> CompressedPath {
        match self {
            CodecSpec::Dense => CompressedPath::Dense,
            CodecSpec::TopK { .. } | CodecSpec::ThresholdTopK { .. } => {
                CompressedPath::SparseAllGather
            }
            CodecSpec::RandomK { .. } | CodecSpec::Fp16 | CodecSpec::Bf16 => {
                CompressedPath::SumClosed
            }
            CodecSpec::Int8 { .. } | CodecSpec::Sign { .. } => CompressedPath::TwoPhase,
            CodecSpec::PowerSgd { .. } => CompressedPath::PowerIteration,
        }
    }

    /// Whether the codec sends element indices as u32 (which bounds the tensor length).
    fn sends_indices(&self) -> bool {
        matches!(
            self,
            CodecSpec::TopK { .. } | CodecSpec::ThresholdTopK { .. } | CodecSpec::RandomK { .. }
        )
    }
}
/// How a tensor is compressed. Every rank must use the same configuration for the same tensor.
#[derive(Clone, Debug)]
pub struct CompressionConfig {
    /// The codec.
    pub codec: CodecSpec,
    /// Remember what compression dropped and add it to the next gradient.
    pub error_feedback: bool,
    /// Weight of the remembered error in `[0, 1]` (`None`: 1). Ignored without error feedback.
    pub decay: Option<f32>,
    /// L2 bound the gradient is clipped to before compression, on every path including the dense one
    /// (`None`: no clipping). [`clip_scope`](Self::clip_scope) says whose norm it bounds.
    pub clip_norm: Option<f32>,
    /// Whether `clip_norm` bounds each rank's local gradient or the all-reduced one.
    pub clip_scope: ClipScope,
    /// Momentum correction (Deep Gradient Compression) with this momentum factor in `[0, 1)`: the
    /// compressor keeps the velocity and accumulates it, not the gradient, into the error buffer, and
    /// clears the momentum of what it sent. The caller's optimizer must then be **plain SGD, its own
    /// momentum off**, or the momentum counts twice. Needs a codec that compresses locally (not dense,
    /// not PowerSGD). `None`: off.
    pub momentum: Option<f32>,
    /// Momentum correction with DGC's momentum factor masking (default off): see
    /// [`ErrorFeedback::with_masking`](braid_compress::ErrorFeedback::with_masking).
    pub momentum_masking: bool,
    /// Density warm-up (top-k, threshold top-k, random-k): the density falls exponentially from the
    /// warm-up's start to the codec's density over its first steps. `None`: the codec's density throughout.
    pub warmup: Option<DensityWarmup>,
    /// Periodic flush (top-k, threshold top-k, random-k): every `flush`-th step is sent whole (density
    /// 1, so the dense switch all-reduces it densely), which applies and clears the residual that error
    /// feedback has held back, the parameters that lag included. `None`: never.
    pub flush: Option<u64>,
    /// Adam-safe compression (after 1-bit Adam): dense steps first, then the compressor keeps Adam's first
    /// moment and all-reduces it compressed with error feedback instead of the gradient; the caller
    /// freezes its second moment. See [`AdamSafe`]. `None`: off.
    pub adam: Option<AdamSafe>,
    /// Top-k only: when the ranks' non-zeros add up to more than `dense_switch · len`, the sparse updates
    /// are all-reduced densely instead of all-gathered (≥ 0; infinity never switches).
    pub dense_switch: f64,
    /// Top-k only: all-gather the pairs (the default: the exact sum of the sparse updates),
    /// reduce-scatter them by range (traffic flat in the rank count, about `k` pairs kept), or let the
    /// traffic model pick ([`sparse_model::choose`]).
    pub sparse_path: SparsePath,
    /// The optimizer is adaptive (Adam and its kin): warn below 1% density.
    pub adaptive_optimizer: bool,
    /// Seed of random-k's indices, threshold sampling, stochastic rounding and PowerSGD's first `Q`.
    pub seed: u64,
    /// The shapes of the tensors the bucket holds, in order (e.g. every parameter's `shape`), which
    /// must add up to its length. PowerSGD then factorises each tensor of two or more dimensions as a
    /// `d0 × (d1·…)` matrix of its own and sums 1-D tensors and matrices too small to gain
    /// (`r·(rows + cols) ≥ rows·cols`) exactly ([`braid_compress::power_sgd::Plan`]); `None`: the whole
    /// bucket is one near-square matrix. Checked against the length for every codec; used by PowerSGD.
    pub layers: Option<Vec<Vec<usize>>>,
}

impl Default for CompressionConfig {
    /// The seed's advice: top-k at 10% density, error feedback on, no clipping, dense switch at 0.5.
    fn default() -> Self {
        CompressionConfig {
            codec: CodecSpec::TopK {
                density: DEFAULT_DENSITY,
            },
            error_feedback: true,
            decay: None,
            clip_norm: None,
            clip_scope: ClipScope::Local,
            momentum: None,
            momentum_masking: false,
            warmup: None,
            flush: None,
            adam: None,
            dense_switch: 0.5,
            sparse_path: SparsePath::AllGather,
            adaptive_optimizer: false,
            seed: 0,
            layers: None,
        }
    }
}

impl CompressionConfig {
    /// The defaults overridden by `BRAID_COMPRESS` (the text form, codec and options, see
    /// [`FromStr`](#impl-FromStr-for-CompressionConfig)), then by `BRAID_COMPRESS_EF` (0/1),
    /// `BRAID_COMPRESS_CLIP` (max norm, or `none`), `BRAID_COMPRESS_DECAY`,
    /// `BRAID_COMPRESS_DENSE_SWITCH` and `BRAID_COMPRESS_SPARSE` (`auto`, `allgather`,
    /// `reducescatter`). A bad value is an [`Error::InvalidArgument`] naming the variable.
    pub fn from_env() -> Result<Self, Error> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`from_env`](Self::from_env) with `lookup` standing in for the environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let mut c = CompressionConfig::default();
        let named = |var: &str, v: &str, why: String| {
            Error::invalid(format!("{var}={}: {why}", braid_compress::echo_input(v)))
        };
        if let Some(v) = lookup("BRAID_COMPRESS") {
            c = v
                .parse()
                .map_err(|e| named("BRAID_COMPRESS", &v, message(e)))?;
        }
        if let Some(v) = lookup("BRAID_COMPRESS_EF") {
            c.error_feedback = parse_bool("BRAID_COMPRESS_EF", &v)?;
        }
        if let Some(v) = lookup("BRAID_COMPRESS_CLIP") {
            c.clip_norm = match v.trim().to_ascii_lowercase().as_str() {
                "" | "none" | "off" => None,
                t => match t.parse::<f32>() {
                    Ok(x) if x > 0.0 && x.is_finite() => Some(x),
                    _ => {
                        return Err(named(
                            "BRAID_COMPRESS_CLIP",
                            &v,
                            "not a finite number > 0 (or none)".into(),
                        ))
                    }
                },
            };
        }
        if let Some(v) = lookup("BRAID_COMPRESS_DECAY") {
            match v.trim().parse::<f32>() {
                Ok(x) if (0.0..=1.0).contains(&x) => c.decay = Some(x),
                _ => {
                    return Err(named(
                        "BRAID_COMPRESS_DECAY",
                        &v,
                        "not a number in [0, 1]".into(),
                    ))
                }
            }
        }
        if let Some(v) = lookup("BRAID_COMPRESS_DENSE_SWITCH") {
            match v.trim().parse::<f64>() {
                Ok(x) if x >= 0.0 => c.dense_switch = x,
                _ => {
                    return Err(named(
                        "BRAID_COMPRESS_DENSE_SWITCH",
                        &v,
                        "not a number ≥ 0".into(),
                    ))
                }
            }
        }
        if let Some(v) = lookup("BRAID_COMPRESS_SPARSE") {
            c.sparse_path = v
                .parse()
                .map_err(|e| named("BRAID_COMPRESS_SPARSE", &v, message(e)))?;
        }
        Ok(c)
    }

    /// The bound each rank clips its own gradient to before compressing (none under global clipping).
    fn local_clip(&self) -> Option<f32> {
        match self.clip_scope {
            ClipScope::Local => self.clip_norm,
            ClipScope::Global => None,
        }
    }

    /// Checks every field; an error names what is wrong.
    pub fn validate(&self) -> Result<(), Error> {
        self.codec.validate()?;
        if let Some(d) = self.decay {
            if !(0.0..=1.0).contains(&d) {
                return Err(Error::invalid(format!(
                    "compression decay {d} is not in [0, 1]"
                )));
            }
        }
        if let Some(c) = self.clip_norm {
            if !(c > 0.0 && c.is_finite()) {
                return Err(Error::invalid(format!(
                    "compression clip norm {c} is not a finite number > 0"
                )));
            }
        }
        if self.dense_switch.is_nan() || self.dense_switch < 0.0 {
            return Err(Error::invalid(format!(
                "compression dense switch {} is not a number ≥ 0",
                self.dense_switch
            )));
        }
        let codec = self.codec;
        if let Some(m) = self.momentum {
            if !(0.0..1.0).contains(&m) {
                return Err(Error::invalid(format!(
                    "momentum correction: the momentum factor {m} is not in [0, 1)"
                )));
            }
            if matches!(codec, CodecSpec::Dense | CodecSpec::PowerSgd { .. }) {
                return Err(Error::invalid(format!(
                    "momentum correction needs a codec that compresses each rank's residual (top-k, \
                     random-k, int8, sign, fp16, bf16), not {codec}"
                )));
            }
            if self.adam.is_some() {
                return Err(Error::invalid(
                    "momentum correction and Adam-safe compression both keep the momentum: choose one"
                        .to_string(),
                ));
            }
        }
        if self.momentum_masking && self.momentum.is_none() {
            return Err(Error::invalid(
                "mask turns on momentum correction's masking, but momentum correction is off \
                 (add momentum=M)"
                    .to_string(),
            ));
        }
        if let Some(w) = self.warmup {
            DensityWarmup::new(w.start, w.steps).map_err(|e| Error::invalid(e.to_string()))?;
            if codec.density().is_none() {
                return Err(Error::invalid(format!(
                    "density warm-up needs a codec with a density (top-k, threshold top-k, random-k), not \
                     {codec}"
                )));
            }
        }
        if let Some(n) = self.flush {
            if n < 2 {
                return Err(Error::invalid(format!(
                    "flush={n}: a flush every {n} step(s) is no compression (use 2 or more)"
                )));
            }
            if codec.density().is_none() {
                return Err(Error::invalid(format!(
                    "a periodic flush needs a codec with a density (top-k, threshold top-k, random-k), \
                     not {codec}"
                )));
            }
        }
        if let Some(a) = self.adam {
            if !(0.0..1.0).contains(&a.beta1) {
                return Err(Error::invalid(format!(
                    "Adam-safe compression: beta1 {} is not in [0, 1)",
                    a.beta1
                )));
            }
        }
        Ok(())
    }
}

/// Whose gradient [`CompressionConfig::clip_norm`] bounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ClipScope {
    /// Each rank clips its own gradient to the bound before compressing it (the bound then applies to
    /// a rank's gradient, not to what the step applies).
    #[default]
    Local,
    /// The bound applies to the all-reduced gradient, as `clip_grad_norm_` after a dense all-reduce does.
    /// On the dense path the all-reduced gradient itself is clipped (exact). On a compressing path the
    /// ranks first all-reduce their local norms (one 8-byte all-reduce) and every rank scales its gradient
    /// by `min(1, clip / G)` before compressing, where `G` is the sum of the local norms (the mean for
    /// [`ReduceOp::Avg`](crate::ReduceOp::Avg)): by the triangle inequality `G` bounds the all-reduced
    /// gradient's norm, so the step never exceeds the bound, and it equals it when the ranks' gradients
    /// point the same way.
    Global,
}

/// Adam-safe compression, after 1-bit Adam (Tang et al. 2021): Adam's second moment is what compression
/// miscalibrates, and after a short warm-up it changes slowly, so it is frozen; with `v` frozen, Adam's
/// step is linear in the gradients, so error feedback compensates what compression drops exactly as it
/// does for SGD.
///
/// * Steps `0 .. warmup_steps`: the gradient is all-reduced **dense**; the caller runs ordinary Adam.
///   The compressor tracks the first moment `m ← β1·m + (1−β1)·ḡ` of the averaged gradient `ḡ`, exactly
///   as the caller's Adam does.
/// * From step `warmup_steps` on, what is compressed (with error feedback) depends on [`AdamSend`]:
///   each rank's first moment `β1·m + (1−β1)·g`, whose average becomes `m` (1-bit Adam; best for dense
///   codecs such as sign and int8), or each rank's gradient, whose compressed average `ĝ` updates
///   `m ← β1·m + (1−β1)·ĝ` (best for top-k, where a sparse moment would lose every unsent coordinate's
///   momentum). Either way `m` is the same on every rank, and the call returns it in the gradient buffer
///   with [`Output::Momentum`] in its report; the caller **freezes its second moment `v` at its value
///   after the warm-up** and steps `x ← x − lr·m / (√max(v̂, m²) + ε)` (`v̂` with the bias correction of
///   the last warm-up step; `m` needs none past the warm-up). The floor `m²` keeps a parameter whose
///   gradient was zero through the warm-up (`v̂ ≈ 0`) from being thrown arbitrarily far: no step then
///   exceeds `lr`, as no Adam step does.
///
/// The op must be [`ReduceOp::Avg`](crate::ReduceOp::Avg).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamSafe {
    /// Dense steps before compression starts (1-bit Adam uses 15–25% of training; a few hundred steps is
    /// typical).
    pub warmup_steps: u64,
    /// Adam's β1, the same as the caller's optimizer (0.9).
    pub beta1: f32,
    /// What travels compressed after the warm-up.
    pub send: AdamSend,
}

impl Default for AdamSafe {
    fn default() -> Self {
        AdamSafe {
            warmup_steps: 100,
            beta1: 0.9,
            send: AdamSend::Auto,
        }
    }
}

/// What Adam-safe compression compresses after its warm-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AdamSend {
    /// [`Gradient`](Self::Gradient) for top-k and threshold top-k, [`Moment`](Self::Moment) otherwise.
    #[default]
    Auto,
    /// Each rank's first moment (1-bit Adam).
    Moment,
    /// Each rank's gradient; the first moment is formed from the compressed average.
    Gradient,
}

impl AdamSend {
    /// What `Auto` means for `codec`.
    pub fn resolve(self, codec: CodecSpec) -> AdamSend {
        match (self, codec) {
            (AdamSend::Auto, CodecSpec::TopK { .. } | CodecSpec::ThresholdTopK { .. }) => {
                AdamSend::Gradient
            }
            (AdamSend::Auto, _) => AdamSend::Moment,
            (explicit, _) => explicit,
        }
    }
}

/// What a compressed all-reduce left in the gradient buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// The (approximate) sum or average of the ranks' gradients.
    Gradient,
    /// Adam-safe compression past its warm-up: Adam's first moment, averaged over ranks.
    Momentum,
}

/// The text of an error without its kind prefix.
fn message(e: Error) -> String {
    match e {
        Error::InvalidArgument(m) => m,
        other => other.to_string(),
    }
}

/// Which way a compressed all-reduce went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressedPath {
    /// A plain all-reduce of the f32 gradient.
    Dense,
    /// The compressed form was all-reduced (fp16/bf16, random-k).
    SumClosed,
    /// PowerSGD: all-reduce P, orthogonalise, all-reduce Q.
    PowerIteration,
    /// Top-k pairs all-gathered and summed in rank order.
    SparseAllGather,
    /// Top-k whose ranks' non-zeros exceeded the dense switch: a dense all-reduce of the sparse updates.
    SparseDenseSwitch,
    /// Top-k pairs sent to the owner of their index range, summed there in rank order, re-selected with
    /// the range's second error buffer, and the kept pairs all-gathered.
    SparseReduceScatter,
    /// Int8/sign: all-to-all of compressed shards, reduce and re-compress per shard, all-gather.
    TwoPhase,
}

/// What one [`Communicator::all_reduce_compressed`](crate::Communicator::all_reduce_compressed) call did.
#[derive(Clone, Debug)]
pub struct CompressedReport {
    /// The local compression step's statistics (norms, compression error, achieved density, wire bytes,
    /// staleness).
    pub stats: Stats,
    /// The way the call went.
    pub path: CompressedPath,
    /// Bytes this rank put on the wire in this call (from the schedules' traffic).
    pub sent_bytes: u64,
    /// What a dense ring all-reduce of the f32 gradient would have sent from this rank: `2(n−1)/n · 4 · len`.
    pub dense_sent_bytes: u64,
    /// The seed's warnings for this step's density (see [`braid_compress::warnings`]).
    pub warnings: Vec<String>,
    /// The density the codec was asked for at this step (the warm-up's, else the codec's); `None` for
    /// codecs without a density.
    pub scheduled_density: Option<f32>,
    /// What the gradient buffer holds now.
    pub output: Output,
}

/// The compression state of one tensor or bucket: codec, error buffers, step counter, last statistics.
/// Make one per tensor, with the same configuration and length on every rank.
pub struct GradientCompressor {
    config: CompressionConfig,
    len: usize,
    step: u64,
    /// The local codec (none for dense and PowerSGD, which use the helpers directly).
    codec: Option<BoxedCodec>,
    /// The local error buffer (and clipping, decay, staleness) of every compressing path.
    ef: ErrorFeedback,
    /// Staleness of the paths that do not go through `ef.step` (dense, PowerSGD).
    staleness: Staleness,
    /// Two-phase: `(world, rank)` it was made for, the shard's codec and its second error buffer.
    server: Option<(usize, usize, BoxedCodec, ErrorFeedback)>,
    /// PowerSGD's plan: which runs are factorised, where their factors sit.
    power: Option<Plan>,
    /// Sparse reduce-scatter: the partition and this rank's range's second error buffer.
    sparse: Option<sparse::RangeState>,
    /// PowerSGD's warm-started Q.
    warm_q: Option<Vec<f32>>,
    /// The density the codec was built for (warm-up rebuilds it when the schedule moves).
    codec_density: Option<f32>,
    /// The last positive learning rate the caller gave ([`GradientCompressor::set_learning_rate`]).
    learning_rate: Option<f32>,
    /// Adam-safe compression's first moment (empty before the first call).
    adam_m: Vec<f32>,
    last: Option<Stats>,
    warned: bool,
}

impl fmt::Debug for GradientCompressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GradientCompressor")
            .field("config", &self.config)
            .field("len", &self.len)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

fn codec_error(e: braid_compress::Error) -> Error {
    match e {
        braid_compress::Error::OutOfMemory(m) => Error::OutOfMemory(m),
        e => Error::invalid(e.to_string()),
    }
}

/// The text of a codec parameter error without its kind prefix.
fn parameter_message(e: braid_compress::Error) -> String {
    match e {
        braid_compress::Error::InvalidParameter(m) => m,
        other => other.to_string(),
    }
}

/// A well-mixed seed for the second (shard) codec of `rank`, so stochastic rounding of different shards
/// does not reuse the same draws.
fn shard_seed(seed: u64, rank: usize) -> u64 {
    let mut z = seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl GradientCompressor {
    /// Compression state for a tensor of `len` elements. Fails, naming the problem, if the configuration
    /// is invalid or the tensor too long for the codec (index codecs: at most `u32::MAX` elements).
    pub fn new(config: CompressionConfig, len: usize) -> Result<Self, Error> {
        config.validate()?;
        if config.codec.sends_indices() && len > u32::MAX as usize {
            return Err(Error::invalid(format!(
                "compression codec {}: a tensor of {len} elements cannot be indexed with u32; split it into \
                 buckets of at most {} elements",
                config.codec,
                u32::MAX
            )));
        }
        let layout = match &config.layers {
            Some(shapes) => Some(
                Layout::new(shapes, len)
                    .map_err(|e| Error::invalid(format!("compression {}", parameter_message(e))))?,
            ),
            None => None,
        };
        let power = match (config.codec, &layout) {
            (CodecSpec::PowerSgd { rank }, Some(l)) => Some(Plan::layered(l, rank)),
            (CodecSpec::PowerSgd { rank }, None) => {
                Some(Plan::single(len, None, rank).map_err(|e| {
                    Error::invalid(format!(
                        "compression codec {}: {}",
                        config.codec,
                        parameter_message(e)
                    ))
                })?)
            }
            _ => None,
        };
        let codec = build_codec(config.codec, config.seed)?;
        // Adam-safe compression clips the gradient before it enters the first moment, not the moment.
        let ef_clip = config.local_clip().filter(|_| config.adam.is_none());
        let mut ef = Self::error_feedback(&config, len, ef_clip)?;
        if let Some(m) = config.momentum {
            ef = ef
                .with_momentum(m)
                .map_err(codec_error)?
                .with_masking(config.momentum_masking);
        }
        Ok(GradientCompressor {
            len,
            step: 0,
            codec,
            codec_density: config.codec.density(),
            learning_rate: None,
            adam_m: Vec::new(),
            ef,
            staleness: Staleness::try_new(len).map_err(codec_error)?,
            server: None,
            power,
            sparse: None,
            warm_q: None,
            last: None,
            warned: false,
            config,
        })
    }

    fn error_feedback(
        config: &CompressionConfig,
        len: usize,
        clip: Option<f32>,
    ) -> Result<ErrorFeedback, Error> {
        let mut ef = ErrorFeedback::try_new(len).map_err(codec_error)?;
        if !config.error_feedback {
            ef = ef.with_decay(0.0).map_err(codec_error)?;
        }
        if let (true, Some(d)) = (config.error_feedback, config.decay) {
            ef = ef.with_decay(d).map_err(codec_error)?;
        }
        if let Some(c) = clip {
            ef = ef.with_clip(c).map_err(codec_error)?;
        }
        Ok(ef)
    }

    /// Number of elements of the tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The density the codec is asked for at this step under the warm-up (rebuilding the codec when the
    /// schedule moves); `None` for codecs without a density.
    fn schedule_density(&mut self) -> Result<Option<f32>, Error> {
        let Some(target) = self.config.codec.density() else {
            return Ok(None);
        };
        let flush = self.config.flush.is_some_and(|n| (self.step + 1) % n == 0);
        let want = if flush {
            1.0
        } else {
            self.config
                .warmup
                .map_or(target, |w| w.density(target, self.step))
        };
        if self.codec_density != Some(want) {
            self.codec = build_codec(self.config.codec.with_density(want), self.config.seed)?;
            self.codec_density = Some(want);
        }
        Ok(Some(want))
    }

    /// The configuration.
    pub fn config(&self) -> &CompressionConfig {
        &self.config
    }

    /// Number of completed compressed all-reduces (it keys the codecs' random streams).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The statistics of the last call, if any.
    pub fn last_stats(&self) -> Option<&Stats> {
        self.last.as_ref()
    }

    /// The local error buffer: what compression has dropped so far and will add to the next gradient
    /// (zeros without error feedback's memory, or before the first call).
    pub fn error(&self) -> &[f32] {
        &self.ef.error
    }

    /// Momentum correction's velocity (empty when it is off). Save it with checkpoints, as the error.
    pub fn velocity(&self) -> &[f32] {
        self.ef.velocity()
    }

    /// Adam-safe compression's first moment, the same on every rank (empty when it is off or before the
    /// first call).
    pub fn adam_momentum(&self) -> &[f32] {
        &self.adam_m
    }

    /// The second error buffer of the part of the tensor this rank owns: its shard on the two-phase path
    /// (int8, sign), its index range on the sparse reduce-scatter (top-k; ranges move with the load, and
    /// what leaves a rank's range moves to its local error buffer). The parts tile the tensor in rank
    /// order. Empty before the first call of such a path.
    pub fn shard_error(&self) -> &[f32] {
        match (&self.server, &self.sparse) {
            (Some(s), _) => &s.3.error[..],
            (None, Some(s)) => s.error(),
            (None, None) => &[],
        }
    }

    /// Tells the compressor the learning rate the caller's optimizer applies to the next result (call it
    /// before every compressed all-reduce, or whenever the rate changes); fails, changing nothing, unless
    /// `lr` is finite and ≥ 0.
    ///
    /// What error feedback holds back was computed under the rate of its own step, but is applied when it
    /// is finally sent, under the rate of that step. With a decaying schedule that is a smaller rate, and
    /// what is still held back when the schedule reaches zero is never applied. So when the rate moves
    /// from `a` to `b`, every error buffer (the local one, the two-phase shard's, the sparse range's) is
    /// scaled by `a / b`: the buffers then hold back updates rather than gradients, as in EF-SGD
    /// (Karimireddy et al. 2019), and a held-back gradient moves the parameters as far as it would have at
    /// its own step. Momentum correction's velocity is not scaled: dense momentum SGD also applies its
    /// velocity at the current rate, so with nothing held back (density 1) the result is dense momentum
    /// SGD's. A rate of 0 scales nothing (the next positive rate is compared with the last positive one).
    /// Without calls, or with a constant rate, nothing is ever scaled.
    ///
    /// ```
    /// use braid::{CompressionConfig, GradientCompressor};
    /// let mut c = GradientCompressor::new(CompressionConfig::default(), 10).unwrap();
    /// c.set_learning_rate(0.1).unwrap();
    /// assert_eq!(c.learning_rate(), Some(0.1));
    /// assert!(c.set_learning_rate(-1.0).is_err() && c.set_learning_rate(f32::NAN).is_err());
    /// c.set_learning_rate(0.0).unwrap();
    /// assert_eq!(c.learning_rate(), Some(0.1));
    /// ```
    pub fn set_learning_rate(&mut self, lr: f32) -> Result<(), Error> {
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(Error::invalid(format!(
                "compression: the learning rate {lr} is not a finite number ≥ 0"
            )));
        }
        if lr == 0.0 {
            return Ok(());
        }
        if let Some(prev) = self.learning_rate.replace(lr) {
            if prev != lr {
                let f = prev / lr;
                let scale = |b: &mut [f32]| b.iter_mut().for_each(|e| *e *= f);
                scale(&mut self.ef.error);
                if let Some(s) = &mut self.server {
                    scale(&mut s.3.error);
                }
                if let Some(s) = &mut self.sparse {
                    scale(s.error_mut());
                }
            }
        }
        Ok(())
    }

    /// The last positive learning rate given to [`set_learning_rate`](Self::set_learning_rate), if any.
    pub fn learning_rate(&self) -> Option<f32> {
        self.learning_rate
    }

    /// Clears the error buffers, staleness and codec state (PowerSGD's warm start), as after loading a
    /// checkpoint. The step counter is kept, so the random streams do not repeat.
    pub fn reset(&mut self) {
        self.ef.reset();
        self.staleness.reset();
        self.adam_m.clear();
        self.server = None;
        self.sparse = None;
        self.warm_q = None;
        if let Some(c) = &mut self.codec {
            c.reset();
        }
        self.last = None;
    }
}

mod carry;
mod config;
mod paths;
mod sparse;
