//! What a rank keeps between the sparse reduce-scatter's steps: the partition of the next step and its
//! range's second error buffer, with that buffer's error-feedback step.

use braid_compress::{top_k, Compressed, Payload};
use braid_core::Error;
use braid_sched::sparse::Partition;

/// What a rank keeps between sparse reduce-scatter steps.
pub(super) struct RangeState {
    /// The communicator shape it was made for.
    pub(super) world: usize,
    pub(super) rank: usize,
    /// The partition of the next step (identical on every rank).
    pub(super) partition: Partition,
    /// The second error buffer of this rank's range, `partition.range(rank)`.
    pub(super) error: Vec<f32>,
    /// Where the range's pairs are summed (zero between steps), as long as the range.
    pub(super) sum: Vec<f32>,
    /// Weight of the remembered error, as the local error buffer's (0 without error feedback).
    pub(super) decay: f32,
}

impl RangeState {
    /// The second error buffer of this rank's range.
    pub(super) fn error(&self) -> &[f32] {
        &self.error
    }

    /// The second error buffer of this rank's range, to scale it.
    pub(super) fn error_mut(&mut self) -> &mut [f32] {
        &mut self.error
    }

    /// Buffers for a range of `len` elements.
    pub(super) fn buffers(len: usize) -> Result<(Vec<f32>, Vec<f32>), Error> {
        Ok((
            braid_core::alloc::filled(0f32, len, "the second error buffer of this rank's range")?,
            braid_core::alloc::filled(0f32, len, "the sum of this rank's range")?,
        ))
    }

    /// One step of the range's error feedback on the pairs summed into `sum`, the way
    /// [`ErrorFeedback::step`](braid_compress::ErrorFeedback::step) runs it for the two-phase path's
    /// shards (residual `sum + decay·error` in separate roundings, then `error = residual − kept`), with
    /// the exact top-`keep` ([`top_k`]) as the codec: the kept pairs, relative to the range. Only what
    /// the result needs is computed (no statistics or staleness of the range), in place, and `sum` is
    /// zero again afterwards.
    pub(super) fn keep(&mut self, keep: usize) -> Compressed {
        let decay = self.decay;
        for (e, s) in self.error.iter_mut().zip(self.sum.iter_mut()) {
            *e = if decay == 0.0 { *s } else { *s + decay * *e };
            *s = 0.0;
        }
        let kept = top_k(&self.error, keep);
        if let Payload::Sparse { indices, values } = kept.payload() {
            for (&i, &v) in indices.iter().zip(values) {
                self.error[i as usize] -= v;
            }
        }
        kept
    }
}
