//! Random-k with a seed shared by all ranks.

use super::{check_density, k_for_density, Codec, Transport};
use crate::select::random_k_indices;
use crate::wire::Payload;
use crate::{Compressed, Result};

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
