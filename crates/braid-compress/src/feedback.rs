//! Error feedback, per-element staleness, the statistics of each step, and the seed's warnings.

use crate::{Codec, Compressed, Error, Result};

/// Number of staleness histogram buckets: 0, 1, 2–3, 4–7, …, 2³¹–(2³²−1).
pub const STALENESS_BUCKETS: usize = 33;

/// How many steps each element has gone without a non-zero update: the seed's lagging parameters.
///
/// After each step an element's counter is 0 if its decompressed update is non-zero (NaN counts as
/// non-zero), and one more than before otherwise (saturating).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Staleness {
    counts: Vec<u32>,
}

/// Distribution of staleness counters: `buckets[0]` counts elements updated this step, `buckets[b]` for
/// `b ≥ 1` those with a counter in `2^(b−1) ..= 2^b − 1`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StalenessHistogram {
    /// Element counts per bucket.
    pub buckets: [u64; STALENESS_BUCKETS],
    /// The largest counter.
    pub max: u32,
}

impl Default for StalenessHistogram {
    fn default() -> Self {
        StalenessHistogram {
            buckets: [0; STALENESS_BUCKETS],
            max: 0,
        }
    }
}

impl StalenessHistogram {
    /// The bucket of a counter: 0 for 0, else `⌊log₂ c⌋ + 1`.
    pub fn bucket_of(count: u32) -> usize {
        (u32::BITS - count.leading_zeros()) as usize
    }

    /// The counters bucket `b` covers, inclusive.
    pub fn bucket_range(b: usize) -> (u32, u32) {
        match b {
            0 => (0, 0),
            _ => (1 << (b - 1), ((1u64 << b) - 1) as u32),
        }
    }

    /// Elements that have gone at least `steps` steps without an update (exact when `steps` is 0 or a power
    /// of two, otherwise counted from the bucket containing `steps`).
    pub fn at_least(&self, steps: u32) -> u64 {
        self.buckets[Self::bucket_of(steps)..].iter().sum()
    }

    fn add(&mut self, count: u32) {
        self.buckets[Self::bucket_of(count)] += 1;
        self.max = self.max.max(count);
    }
}

impl Staleness {
    /// Counters for `len` elements, all 0.
    pub fn new(len: usize) -> Self {
        Staleness {
            counts: vec![0; len],
        }
    }

    /// [`Staleness::new`] for a length the caller chose: [`Error::OutOfMemory`] instead of an abort
    /// when the counters cannot be allocated.
    pub fn try_new(len: usize) -> Result<Self> {
        Ok(Staleness {
            counts: crate::error::zeros(len, "staleness counters")?,
        })
    }

    /// Updates the counters from one step's decompressed update and returns their histogram.
    pub fn observe(&mut self, update: &[f32]) -> Result<StalenessHistogram> {
        if update.len() != self.counts.len() {
            return Err(Error::LengthMismatch {
                what: "update",
                expected: self.counts.len(),
                got: update.len(),
            });
        }
        let mut h = StalenessHistogram::default();
        for (c, &u) in self.counts.iter_mut().zip(update) {
            *c = if u != 0.0 { 0 } else { c.saturating_add(1) };
            h.add(*c);
        }
        Ok(h)
    }

    /// The counters.
    pub fn counts(&self) -> &[u32] {
        &self.counts
    }

    /// The histogram of the current counters.
    pub fn histogram(&self) -> StalenessHistogram {
        let mut h = StalenessHistogram::default();
        self.counts.iter().for_each(|&c| h.add(c));
        h
    }

    /// Sets every counter to 0.
    pub fn reset(&mut self) {
        self.counts.fill(0);
    }
}

/// What one compression step did, for the user to see (DESIGN, section Compression).
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// Elements in the tensor.
    pub len: usize,
    /// L2 norm of the local gradient as given, before clipping and before the error is added (f64 sum).
    pub grad_norm: f64,
    /// The factor clipping applied to the gradient (1 when not clipped).
    pub clip_scale: f32,
    /// L2 norm of the residual that was compressed (clipped gradient plus decayed error).
    pub residual_norm: f64,
    /// `‖residual − decompressed‖ / ‖residual‖` (0 when the residual is 0): the compression error, which is
    /// also the new error buffer's norm relative to the residual.
    pub compression_error: f64,
    /// Achieved density: the fraction of elements whose decompressed update is non-zero (NaN counts as
    /// non-zero; 1 for an empty tensor, so it never triggers [`warnings`]).
    pub density: f64,
    /// Bytes of the encoding ([`Compressed::wire_bytes`]).
    pub wire_bytes: usize,
    /// Bytes of the same tensor sent dense in f32 (`4 · len`).
    pub dense_bytes: usize,
    /// Staleness after this step.
    pub staleness: StalenessHistogram,
}

impl Stats {
    /// The statistics of a step on a tensor of `len` elements: `norms` are (gradient, clip scale,
    /// residual, new error), `staleness` is observed after the step's update (its first bucket counts the
    /// elements updated), `wire_bytes` what the encoding took.
    pub fn from_step(
        len: usize,
        norms: (f64, f32, f64, f64),
        wire_bytes: usize,
        staleness: StalenessHistogram,
    ) -> Stats {
        let (grad_norm, clip_scale, residual_norm, error_norm) = norms;
        Stats {
            len,
            grad_norm,
            clip_scale,
            residual_norm,
            compression_error: if residual_norm > 0.0 {
                error_norm / residual_norm
            } else {
                0.0
            },
            density: if len == 0 {
                1.0
            } else {
                staleness.buckets[0] as f64 / len as f64
            },
            wire_bytes,
            dense_bytes: 4 * len,
            staleness,
        }
    }

    /// `dense_bytes / wire_bytes`.
    pub fn compression_ratio(&self) -> f64 {
        self.dense_bytes as f64 / self.wire_bytes as f64
    }

    /// [`warnings`] for this step's density.
    pub fn warnings(&self, optimizer_is_adaptive: bool) -> Vec<String> {
        warnings(self.density, optimizer_is_adaptive)
    }
}

/// Density below which an adaptive optimizer is warned about (1%).
pub const ADAPTIVE_MIN_DENSITY: f64 = 0.01;
/// Density below which every optimizer is warned about lagging parameters (0.1%).
pub const LAGGING_MIN_DENSITY: f64 = 0.001;

/// The seed's advice as warnings, empty when there is nothing to say:
///
/// * density below 1% with an adaptive optimizer (Adam and its kin): the second-moment estimate sees the
///   compressed gradient and can be miscalibrated;
/// * density below 0.1% with any optimizer: parameters are updated rarely and lag the trajectory, which
///   shows in downstream evaluation rather than in the training loss.
pub fn warnings(density: f64, optimizer_is_adaptive: bool) -> Vec<String> {
    let mut w = Vec::new();
    let pct = density * 100.0;
    if optimizer_is_adaptive && density < ADAPTIVE_MIN_DENSITY {
        w.push(format!(
            "gradient density {pct:.3}% is below 1% with an adaptive optimizer: compressed gradients can \
             miscalibrate its second-moment estimate; start at 10% density and monitor loss and gradient norms"
        ));
    }
    if density < LAGGING_MIN_DENSITY {
        w.push(format!(
            "gradient density {pct:.4}% is below 0.1%: each parameter is updated rarely and can lag the \
             optimization trajectory; watch the staleness histogram and evaluate on downstream tasks, not only \
             training loss"
        ));
    }
    w
}

/// L2 norm with an f64 sum in index order.
pub fn l2_norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt()
}

/// Error feedback for one tensor or bucket: what compression drops is remembered and added to the next
/// gradient, so every gradient is eventually sent (the sum of updates plus the final error equals the sum
/// of gradients when `decay` is 1).
///
/// One [`step`](Self::step):
///
/// 1. `c = min(1, clip / ‖g‖)` if a clip bound is set, else 1: the local gradient is clipped *before* the
///    error is added, the order production systems use (the bound then applies to the gradient, not to
///    gradient plus memory). For global-norm clipping, scale the gradient before calling `step` and leave
///    `clip` unset.
/// 2. `residual = g·c + decay·error` (separate IEEE roundings, no FMA; with `decay == 0` the residual is
///    exactly `g·c`, which turns error feedback off);
/// 3. `compressed = codec.compress(residual, step)`;
/// 4. `error = residual − decompress(compressed)`.
///
/// The error buffer acts as hidden momentum: the update at step `t` mixes gradients from earlier steps, which
/// compounds with the optimizer's own momentum; some users lower explicit momentum when compressing hard.
///
/// **Momentum correction** ([`with_momentum`](Self::with_momentum), after Deep Gradient Compression, Lin
/// et al. 2018) makes that momentum explicit instead: the step keeps a velocity `u ← m·u + g·c` and forms
/// the residual from the velocity, `residual = u + decay·error`. The caller then runs **plain SGD** (its
/// own momentum off) on the summed updates: the momentum lives here, once, and the coordinates that wait
/// between sends keep theirs. Every gradient is eventually applied with its full momentum weight
/// `1/(1−m)`, as dense momentum SGD applies it. DGC also clears the velocity wherever the update is
/// non-zero (momentum factor masking, [`with_masking`](Self::with_masking)), so a coordinate's momentum
/// restarts once applied; a coordinate sent every step then gets plain SGD's weight 1 (dense momentum
/// correction with masking is SGD without momentum).
///
/// The same type serves as the second error buffer of two-phase compressed all-reduce: give it the reduced
/// f32 chunk a rank owns, and re-compress that with its own `ErrorFeedback` of the chunk's length.
#[derive(Clone, Debug, PartialEq)]
pub struct ErrorFeedback {
    /// The remembered error, one element per tensor element. Save it with checkpoints, or
    /// [`reset`](Self::reset) it when loading one without it.
    pub error: Vec<f32>,
    /// Weight of the error added to the next gradient: 1 is classic error feedback, 0 turns it off.
    pub decay: f32,
    /// L2 bound the local gradient is clipped to before the error is added; `None` for no clipping.
    pub clip: Option<f32>,
    /// Momentum factor of momentum correction in `[0, 1)`; 0 turns it off.
    momentum: f32,
    /// Momentum factor masking: clear the velocity where the update is non-zero.
    masking: bool,
    /// Momentum correction's velocity (empty when it is off).
    velocity: Vec<f32>,
    update: Vec<f32>,
    staleness: Staleness,
}

impl ErrorFeedback {
    /// Error feedback for `len` elements: decay 1, no clipping (the default: error feedback on).
    pub fn new(len: usize) -> Self {
        ErrorFeedback {
            error: vec![0.0; len],
            decay: 1.0,
            clip: None,
            momentum: 0.0,
            masking: false,
            velocity: Vec::new(),
            update: vec![0.0; len],
            staleness: Staleness::new(len),
        }
    }

    /// [`ErrorFeedback::new`] for a length the caller chose: [`Error::OutOfMemory`] instead of an
    /// abort when the state cannot be allocated.
    pub fn try_new(len: usize) -> Result<Self> {
        Ok(ErrorFeedback {
            error: crate::error::zeros(len, "error-feedback residual")?,
            decay: 1.0,
            clip: None,
            momentum: 0.0,
            masking: false,
            velocity: Vec::new(),
            update: crate::error::zeros(len, "error-feedback update")?,
            staleness: Staleness::try_new(len)?,
        })
    }

    /// The same bookkeeping (statistics, staleness) with error feedback off (decay 0).
    pub fn disabled(len: usize) -> Self {
        ErrorFeedback {
            decay: 0.0,
            ..Self::new(len)
        }
    }

    /// Sets the decay, which must be finite and in `[0, 1]`.
    pub fn with_decay(mut self, decay: f32) -> Result<Self> {
        if !(0.0..=1.0).contains(&decay) {
            return Err(Error::InvalidParameter(format!(
                "error-feedback decay must be in [0, 1], got {decay}"
            )));
        }
        self.decay = decay;
        Ok(self)
    }

    /// Clips the local gradient to L2 norm `max_norm` (finite, > 0) before the error is added.
    pub fn with_clip(mut self, max_norm: f32) -> Result<Self> {
        if !(max_norm > 0.0 && max_norm.is_finite()) {
            return Err(Error::InvalidParameter(format!(
                "clip norm must be finite and > 0, got {max_norm}"
            )));
        }
        self.clip = Some(max_norm);
        Ok(self)
    }

    /// Turns on momentum correction with momentum factor `momentum` in `[0, 1)` (0.9 in DGC; 0 turns it
    /// off). See the type documentation: the caller's optimizer must then run without its own momentum.
    pub fn with_momentum(mut self, momentum: f32) -> Result<Self> {
        if !(0.0..1.0).contains(&momentum) {
            return Err(Error::InvalidParameter(format!(
                "momentum correction: the momentum factor must be in [0, 1), got {momentum}"
            )));
        }
        self.momentum = momentum;
        self.velocity = if momentum == 0.0 {
            Vec::new()
        } else {
            crate::error::zeros(self.error.len(), "momentum-correction velocity")?
        };
        Ok(self)
    }

    /// Turns DGC's momentum factor masking on or off (the default). Without masking the velocity keeps
    /// running after a coordinate is sent, so every gradient is eventually applied with its full momentum
    /// weight `1/(1−m)`, as dense momentum SGD applies it; with masking, a coordinate sent every step gets
    /// plain SGD's weight 1, which suits only very sparse codecs, where coordinates wait long between sends.
    pub fn with_masking(mut self, masking: bool) -> Self {
        self.masking = masking;
        self
    }

    /// Whether momentum factor masking is on.
    pub fn masking(&self) -> bool {
        self.masking
    }

    /// The momentum factor of momentum correction (0 when it is off).
    pub fn momentum(&self) -> f32 {
        self.momentum
    }

    /// Momentum correction's velocity after the last step's masking (empty when it is off). Save it with
    /// checkpoints, as the error buffer.
    pub fn velocity(&self) -> &[f32] {
        &self.velocity
    }

    /// Momentum correction's velocity, to restore it from a checkpoint (empty when it is off).
    pub fn velocity_mut(&mut self) -> &mut [f32] {
        &mut self.velocity
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.error.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.error.is_empty()
    }

    /// Runs one step (see the type documentation) and returns what to send and what happened.
    ///
    /// Fails, changing nothing, if `grad` does not have [`len`](Self::len) elements; fails after updating
    /// the error buffer only if the codec returns a tensor of the wrong length.
    pub fn step<C: Codec + ?Sized>(
        &mut self,
        grad: &[f32],
        codec: &mut C,
        step: u64,
    ) -> Result<(Compressed, Stats)> {
        let len = self.error.len();
        if grad.len() != len {
            return Err(Error::LengthMismatch {
                what: "gradient",
                expected: len,
                got: grad.len(),
            });
        }
        self.update.resize(len, 0.0);
        if self.staleness.counts.len() != len {
            self.staleness = Staleness::new(len);
        }
        let grad_norm = l2_norm(grad);
        let clip_scale = match self.clip {
            Some(max) if grad_norm > max as f64 => (max as f64 / grad_norm) as f32,
            _ => 1.0,
        };
        let (decay, m) = (self.decay, self.momentum);
        if m == 0.0 {
            for (e, &g) in self.error.iter_mut().zip(grad) {
                let g = if clip_scale == 1.0 { g } else { g * clip_scale };
                *e = if decay == 0.0 { g } else { g + decay * *e };
            }
        } else {
            if self.velocity.len() != len {
                self.velocity = crate::error::zeros(len, "momentum-correction velocity")?;
            }
            for ((e, v), &g) in self.error.iter_mut().zip(&mut self.velocity).zip(grad) {
                let g = if clip_scale == 1.0 { g } else { g * clip_scale };
                *v = m * *v + g;
                *e = if decay == 0.0 { *v } else { *v + decay * *e };
            }
        }
        let residual_norm = l2_norm(&self.error);
        let compressed = codec.compress(&self.error, step);
        codec.decompress(&compressed, &mut self.update)?;
        for (e, &u) in self.error.iter_mut().zip(&self.update) {
            *e -= u;
        }
        if m != 0.0 && self.masking {
            // Momentum factor masking: what was applied restarts its momentum.
            for (v, &u) in self.velocity.iter_mut().zip(&self.update) {
                if u != 0.0 {
                    *v = 0.0;
                }
            }
        }
        let error_norm = l2_norm(&self.error);
        let staleness = self.staleness.observe(&self.update)?;
        let stats = Stats::from_step(
            len,
            (grad_norm, clip_scale, residual_norm, error_norm),
            compressed.wire_bytes(),
            staleness,
        );
        Ok((compressed, stats))
    }

    /// The decompressed update of the last step (what this rank contributed), zeros before the first.
    pub fn last_update(&self) -> &[f32] {
        &self.update
    }

    /// The per-element staleness counters.
    pub fn staleness(&self) -> &Staleness {
        &self.staleness
    }

    /// Zeroes the error buffer, the velocity and the staleness counters (after loading a checkpoint
    /// without them).
    pub fn reset(&mut self) {
        self.error.fill(0.0);
        self.velocity.fill(0.0);
        self.update.fill(0.0);
        self.staleness.reset();
    }
}
