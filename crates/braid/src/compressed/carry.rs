//! Compressor state carried from one layout of a gradient to another: when [`crate::GradientBuckets`]
//! rebuilds its buckets, every parameter's part of every error buffer moves with the parameter, so a
//! rebuild loses nothing error feedback remembers.
//!
//! The local error buffer, momentum correction's velocity and Adam-safe compression's first moment are
//! per element and move as they are. The second error buffers (the two-phase path's shard, the sparse
//! reduce-scatter's range) belong to a part of the old layout this rank owned; they are added to this
//! rank's local buffer over that part first, as the sparse path does when its ranges move. What they held
//! is then sent again by this rank, and the sum over ranks of results plus error buffers is unchanged.
//! PowerSGD's warm start (a starting point, not an error) and the staleness counters start afresh.

use std::ops::Range;

use braid_core::Error;

use super::options::CompressionConfig;
use super::paths::{internal, shards};
use super::sparse::add_into;
use super::state::GradientCompressor;

/// What a compressor carries per element to the next layout.
pub(crate) struct Carried {
    /// The local error buffer, the second buffers folded in.
    error: Vec<f32>,
    /// Momentum correction's velocity (empty when it is off).
    velocity: Vec<f32>,
    /// Adam-safe compression's first moment (empty when it is off or before the first call).
    adam_m: Vec<f32>,
    step: u64,
    learning_rate: Option<f32>,
}

impl Carried {
    /// Number of elements.
    pub(crate) fn len(&self) -> usize {
        self.error.len()
    }
}

impl GradientCompressor {
    /// Gives the two-phase path's shard error buffer back to the local one, over the shard this rank owned.
    fn fold_shard_state(&mut self) {
        let Some(block) = self.config.codec.block() else {
            return;
        };
        if let Some((n, me, _, ef)) = self.server.take() {
            if let Some(r) = shards(self.len, block, n).get(me) {
                add_into(&mut self.ef.error, r.clone(), &ef.error);
            }
        }
    }

    /// Takes this compressor apart into what the next layout needs.
    pub(crate) fn carry_out(mut self) -> Carried {
        self.fold_shard_state();
        self.fold_range_state();
        Carried {
            velocity: self.ef.velocity().to_vec(),
            error: std::mem::take(&mut self.ef.error),
            adam_m: self.adam_m,
            step: self.step,
            learning_rate: self.learning_rate,
        }
    }

    /// A compressor of `len` elements made of parts of carried states: `(state, its range, offset here)`.
    /// Elements no part covers start with empty buffers.
    pub(crate) fn carry_in(
        config: CompressionConfig,
        len: usize,
        parts: &[(&Carried, Range<usize>, usize)],
    ) -> Result<GradientCompressor, Error> {
        let mut c = GradientCompressor::new(config, len)?;
        let adam = parts.iter().any(|(s, _, _)| !s.adam_m.is_empty());
        if adam {
            c.adam_m =
                braid_core::alloc::filled(0f32, len, "Adam-safe compression's first moment")?;
        }
        for (s, from, at) in parts {
            let to = *at..at + from.len();
            let (Some(dst), Some(src)) =
                (c.ef.error.get_mut(to.clone()), s.error.get(from.clone()))
            else {
                return Err(internal(format!(
                    "carrying {from:?} of {} elements to {to:?} of {len}",
                    s.len()
                )));
            };
            dst.copy_from_slice(src);
            if let (Some(dst), Some(src)) = (
                c.ef.velocity_mut().get_mut(to.clone()),
                s.velocity.get(from.clone()),
            ) {
                dst.copy_from_slice(src);
            }
            if let (Some(dst), Some(src)) = (c.adam_m.get_mut(to), s.adam_m.get(from.clone())) {
                dst.copy_from_slice(src);
            }
            c.step = c.step.max(s.step);
            c.learning_rate = c.learning_rate.or(s.learning_rate);
        }
        Ok(c)
    }
}
