//! The compression state of one tensor or bucket: the fields of a [`GradientCompressor`] (its methods
//! are in mod.rs, paths.rs, sparse.rs and carry.rs).

use std::fmt;

use braid_compress::power_sgd::Plan;
use braid_compress::{BoxedCodec, ErrorFeedback, Staleness, Stats};

use super::options::CompressionConfig;
use super::range::RangeState;

/// The compression state of one tensor or bucket: codec, error buffers, step counter, last statistics.
/// Make one per tensor, with the same configuration and length on every rank.
pub struct GradientCompressor {
    pub(super) config: CompressionConfig,
    pub(super) len: usize,
    pub(super) step: u64,
    /// The local codec (none for dense and PowerSGD, which use the helpers directly).
    pub(super) codec: Option<BoxedCodec>,
    /// The local error buffer (and clipping, decay, staleness) of every compressing path.
    pub(super) ef: ErrorFeedback,
    /// Staleness of the paths that do not go through `ef.step` (dense, PowerSGD).
    pub(super) staleness: Staleness,
    /// Two-phase: `(world, rank)` it was made for, the shard's codec and its second error buffer.
    pub(super) server: Option<(usize, usize, BoxedCodec, ErrorFeedback)>,
    /// PowerSGD's plan: which runs are factorised, where their factors sit.
    pub(super) power: Option<Plan>,
    /// Sparse reduce-scatter: the partition and this rank's range's second error buffer.
    pub(super) sparse: Option<RangeState>,
    /// PowerSGD's warm-started Q.
    pub(super) warm_q: Option<Vec<f32>>,
    /// The density the codec was built for (warm-up rebuilds it when the schedule moves).
    pub(super) codec_density: Option<f32>,
    /// The last positive learning rate the caller gave ([`GradientCompressor::set_learning_rate`]).
    pub(super) learning_rate: Option<f32>,
    /// Adam-safe compression's first moment (empty before the first call).
    pub(super) adam_m: Vec<f32>,
    pub(super) last: Option<Stats>,
    pub(super) warned: bool,
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
