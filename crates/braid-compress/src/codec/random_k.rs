//! Random-k with a seed shared by all ranks.

use std::cmp::Reverse;

use super::{assert_indexable, check_density, k_for_density, Codec, Transport};
use crate::rng::{Stream, TAG_RANDOM_K};
use crate::select::top_k_by;
use crate::wire::Payload;
use crate::{Compressed, Result};

/// The `k` indices random-k keeps for a tensor of `len` elements at `step`, ascending.
///
/// They are the `k` indices `i` with the smallest `Stream::new(seed, TAG_RANDOM_K, step).u64_at(i)`, ties
/// going to the lower index: a uniformly random `k`-subset that depends only on `(seed, step, len, k)`, and
/// that a GPU computes with the same selection it uses for top-k. `k` is clamped to `len`.
///
/// # Panics
///
/// If `len` exceeds `u32::MAX`.
pub fn random_k_indices(seed: u64, step: u64, len: usize, k: usize) -> Vec<u32> {
    assert_indexable("random-k", len);
    let k = k.min(len);
    if k == 0 || k == len {
        return (0..k as u32).collect();
    }
    let stream = Stream::new(seed, TAG_RANDOM_K, step);
    let key = |i: usize| stream.u64_at(i as u64);
    // The keys are uniform, so the k smallest are almost surely below a bound a few standard deviations
    // above k/len of the range: select among those candidates, and fall back to the full selection in the
    // rare case there are fewer than k of them. Both paths return the same set.
    let expect = k as f64 + 6.0 * (k as f64).sqrt() + 16.0;
    if expect < 0.5 * len as f64 {
        let bound = (expect / len as f64 * 18_446_744_073_709_551_616.0) as u64;
        let cand: Vec<(u64, u32)> = (0..len)
            .map(|i| (key(i), i as u32))
            .filter(|c| c.0 < bound)
            .collect();
        if cand.len() >= k {
            // Candidates are in index order, so the positions come out ascending, as the indices must.
            return top_k_by(cand.len(), k, |j| Reverse(cand[j].0))
                .into_iter()
                .map(|j| cand[j as usize].1)
                .collect();
        }
    }
    top_k_by(len, k, |i| Reverse(key(i)))
}

/// Random-k: sends the values at [`random_k_indices`]`(seed, step, len, `[`k_for_density`]`(len, density))`.
///
/// Every rank with the same seed selects the same indices, so the format is sum-closed: the sum of the
/// ranks' compressed tensors ([`Compressed::try_add`]) is the compressed sum, and it rides the normal ring or
/// tree. Plain random-k sends `x[i]`, a biased (shrunk) estimate meant to be used with error feedback;
/// [`unbiased`](Self::unbiased) sends `x[i] · s` with `s = (len / k)` computed in f64 and rounded to f32,
/// whose expectation over the random subset is `x`.
#[derive(Clone, Debug, PartialEq)]
pub struct RandomK {
    density: f32,
    seed: u64,
    unbiased: bool,
}

impl RandomK {
    /// Random-k at `density` in `(0, 1]`, with the `seed` all ranks share.
    pub fn new(density: f32, seed: u64) -> Result<Self> {
        check_density("random-k", density)?;
        Ok(RandomK {
            density,
            seed,
            unbiased: false,
        })
    }

    /// Scales the kept values by `len / k` so that the decompressed tensor is an unbiased estimate.
    pub fn unbiased(mut self) -> Self {
        self.unbiased = true;
        self
    }

    /// The configured density.
    pub fn density(&self) -> f32 {
        self.density
    }
}

impl Codec for RandomK {
    fn name(&self) -> String {
        format!(
            "random-k(density={}, seed={}{})",
            self.density,
            self.seed,
            if self.unbiased { ", unbiased" } else { "" }
        )
    }

    fn transport(&self) -> Transport {
        Transport::SumClosed
    }

    fn compress(&mut self, grad: &[f32], step: u64) -> Compressed {
        let len = grad.len();
        let k = k_for_density(len, self.density);
        let indices = random_k_indices(self.seed, step, len, k);
        let values = if self.unbiased {
            let s = (len as f64 / k as f64) as f32;
            indices.iter().map(|&i| grad[i as usize] * s).collect()
        } else {
            indices.iter().map(|&i| grad[i as usize]).collect()
        };
        Compressed::new_unchecked(
            len,
            Payload::RandomK {
                seed: self.seed,
                step,
                values,
            },
        )
    }
}
