//! How a tensor is compressed: [`CompressionConfig`] and its options ([`ClipScope`], [`AdamSafe`],
//! [`AdamSend`]), their defaults, the environment's overrides and the checks (the text form is in
//! config.rs).

use braid_compress::{CodecSpec, DensityWarmup, DEFAULT_DENSITY};
use braid_core::{parse_bool, Error};
use braid_sched::sparse::SparsePath;

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
    /// traffic model pick ([`sparse_model::choose`](braid_sched::sparse::choose)).
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
    pub(super) fn local_clip(&self) -> Option<f32> {
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
///   with [`Output::Momentum`](super::Output::Momentum) in its report; the caller **freezes its second
///   moment `v` at its value after the warm-up** and steps `x ← x − lr·m / (√max(v̂, m²) + ε)` (`v̂`
///   with the bias correction of the last warm-up step; `m` needs none past the warm-up). The floor `m²`
///   keeps a parameter whose gradient was zero through the warm-up (`v̂ ≈ 0`) from being thrown
///   arbitrarily far: no step then exceeds `lr`, as no Adam step does.
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

/// The text of an error without its kind prefix.
pub(super) fn message(e: Error) -> String {
    match e {
        Error::InvalidArgument(m) => m,
        other => other.to_string(),
    }
}
