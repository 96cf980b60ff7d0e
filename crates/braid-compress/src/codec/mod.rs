//! The [`Codec`] trait and the reference codecs.

pub(crate) mod cast;
pub(crate) mod mx;
pub mod power_sgd;
pub(crate) mod quant;
pub(crate) mod random_k;
pub(crate) mod top_k;

use crate::{Compressed, Error, Result};

/// How compressed tensors travel in a collective (DESIGN, section Compression).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// The wire format is closed under addition ([`Compressed::try_add`]), so it rides the normal ring or
    /// tree all-reduce: fp16/bf16 casts and random-k with a seed shared by all ranks.
    SumClosed,
    /// PowerSGD: all-reduce P, orthogonalise, all-reduce Q (see [`power_sgd`](crate::power_sgd)).
    PowerIteration,
    /// Per-rank indices or scales: sparse all-gather and [`Compressed::accumulate`], or two-phase compressed
    /// all-reduce (all-to-all, reduce in f32, re-compress with a second [`ErrorFeedback`](crate::ErrorFeedback),
    /// all-gather). Top-k, threshold top-k, int8 and sign.
    Gather,
}

/// A gradient codec: a pure function of `(configuration, state, gradient, step)`.
///
/// Codecs are owned per tensor or bucket, and `compress` takes `&mut self` because one of them (PowerSGD
/// with warm start) keeps state between steps. Randomness is drawn from counter-based streams keyed by the
/// codec's seed and `step` ([`rng`](crate::rng)), so every rank that uses the same seed and step draws the
/// same numbers, and the same call always produces the same bytes.
pub trait Codec {
    /// A short description with the parameters, e.g. `top-k(density=0.1)`.
    fn name(&self) -> String;

    /// How the output travels in a collective.
    fn transport(&self) -> Transport;

    /// Compresses `grad`; `step` is the training step (it keys the random streams).
    ///
    /// # Panics
    ///
    /// Codecs that send element indices (top-k, threshold top-k, random-k) panic if `grad.len()` exceeds
    /// `u32::MAX`; split such tensors into buckets.
    fn compress(&mut self, grad: &[f32], step: u64) -> Compressed;

    /// Writes the dense tensor of `compressed` into `out` (which must have `compressed.len()` elements).
    /// The default, which every codec here uses, is [`Compressed::decompress`]: compressed values are
    /// self-describing.
    fn decompress(&self, compressed: &Compressed, out: &mut [f32]) -> Result<()> {
        compressed.decompress(out)
    }

    /// Forgets state carried between steps (PowerSGD's warm-started Q), as after loading a checkpoint.
    fn reset(&mut self) {}
}

/// Number of elements kept at `density` out of `len`: `density · len` computed in f64 and rounded to
/// nearest (ties away from zero), clamped to `1..=len`; 0 for an empty tensor. (Rounding rather than
/// ceiling keeps `0.1f32`, which is slightly above 0.1, from keeping one element too many.)
pub fn k_for_density(len: usize, density: f32) -> usize {
    if len == 0 {
        return 0;
    }
    ((density as f64 * len as f64).round() as usize).clamp(1, len)
}

/// Checks that `density` is in `(0, 1]`.
pub(crate) fn check_density(what: &str, density: f32) -> Result<()> {
    if density > 0.0 && density <= 1.0 {
        Ok(())
    } else {
        Err(Error::InvalidParameter(format!(
            "{what} density must be in (0, 1], got {density}"
        )))
    }
}

/// Checks a block size and converts it for the wire.
pub(crate) fn check_block(what: &str, block: usize) -> Result<u32> {
    match u32::try_from(block) {
        Ok(b) if b > 0 => Ok(b),
        _ => Err(Error::InvalidParameter(format!(
            "{what} block size must be in 1..={}, got {block}",
            u32::MAX
        ))),
    }
}
