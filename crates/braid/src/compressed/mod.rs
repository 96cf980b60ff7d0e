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
//!   approximation missed;
//! * top-k carries per-rank indices: ranks all-gather their `(index, value)` pairs and every rank sums them
//!   in rank order ([`CompressedPath::SparseAllGather`]); or, so that a rank's traffic does not grow with
//!   the rank count, each rank sends every range of the index space only to that range's owner, which
//!   sums its range in rank order, keeps about `k/n` of it (what it drops stays in a second error buffer
//!   for the range) and all-gathers what it kept ([`CompressedPath::SparseReduceScatter`], Ok-Topk);
//!   [`CompressionConfig::sparse_path`] picks, by default by the traffic model ([`sparse_model`]). When the
//!   sparse data would be dense enough, a dense all-reduce of the sparse updates is cheaper
//!   ([`CompressedPath::SparseDenseSwitch`], SparCML);
//! * int8 and sign carry per-rank scales: DeepSpeed's two-phase scheme exchanges compressed shards
//!   all-to-all, reduces each shard in f32 on its owner, re-compresses it with a second error buffer and
//!   all-gathers the compressed shards ([`CompressedPath::TwoPhase`]).
//!
//! Every rank decodes the same bytes and sums in the same order, so results are bit-identical across
//! ranks. Error feedback remembers what compression dropped and adds it to the next gradient; the
//! statistics of each local compression step (gradient norm, compression error, density, staleness) come
//! back in a [`CompressedReport`] and are logged at debug level under the target `braid::compress`.

use std::fmt;

use braid_compress::power_sgd::matrix_shape;
use braid_compress::{build_codec, ErrorFeedback, Staleness, Stats, DEFAULT_DENSITY};
pub use braid_compress::{BoxedCodec, CodecSpec};
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
    /// L2 bound the local gradient is clipped to before compression, on every path including the dense
    /// one (`None`: no clipping).
    pub clip_norm: Option<f32>,
    /// Top-k only: when the ranks' non-zeros add up to more than `dense_switch · len`, the sparse updates
    /// are all-reduced densely instead of all-gathered (≥ 0; infinity never switches).
    pub dense_switch: f64,
    /// Top-k only: all-gather the pairs, reduce-scatter them by range, or let the traffic model pick
    /// ([`sparse_model::choose`]).
    pub sparse_path: SparsePath,
    /// The optimizer is adaptive (Adam and its kin): warn below 1% density.
    pub adaptive_optimizer: bool,
    /// Seed of random-k's indices, threshold sampling, stochastic rounding and PowerSGD's first `Q`.
    pub seed: u64,
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
            dense_switch: 0.5,
            sparse_path: SparsePath::Auto,
            adaptive_optimizer: false,
            seed: 0,
        }
    }
}

impl CompressionConfig {
    /// The defaults overridden by `BRAID_COMPRESS` (codec text), `BRAID_COMPRESS_EF` (0/1),
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
            c.codec = v
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
        Ok(())
    }
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

/// What one [`Communicator::all_reduce_compressed`] call did.
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
    /// Sparse reduce-scatter: the partition and this rank's range's second error buffer.
    sparse: Option<sparse::RangeState>,
    /// PowerSGD's warm-started Q.
    warm_q: Option<Vec<f32>>,
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
        if let CodecSpec::PowerSgd { rank } = config.codec {
            let (rows, cols, _) = matrix_shape(len, None, rank);
            if rows > u32::MAX as usize || cols > u32::MAX as usize {
                return Err(Error::invalid(format!(
                    "compression codec {}: a {rows} × {cols} matrix view does not fit u32 dimensions",
                    config.codec
                )));
            }
        }
        let codec = build_codec(config.codec, config.seed)?;
        let ef = Self::error_feedback(&config, len, config.clip_norm)?;
        Ok(GradientCompressor {
            len,
            step: 0,
            codec,
            ef,
            staleness: Staleness::try_new(len).map_err(codec_error)?,
            server: None,
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

    /// Clears the error buffers, staleness and codec state (PowerSGD's warm start), as after loading a
    /// checkpoint. The step counter is kept, so the random streams do not repeat.
    pub fn reset(&mut self) {
        self.ef.reset();
        self.staleness.reset();
        self.server = None;
        self.sparse = None;
        self.warm_q = None;
        if let Some(c) = &mut self.codec {
            c.reset();
        }
        self.last = None;
    }
}

mod paths;
mod sparse;
