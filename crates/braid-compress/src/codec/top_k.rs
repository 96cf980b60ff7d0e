//! Top-k: exact, and by a sampled threshold as in Deep Gradient Compression.

use super::{check_density, k_for_density, Codec, Transport};
use crate::rng::{Stream, TAG_SAMPLE};
use crate::select::assert_indexable;
use crate::select::{abs_key, top_k_u32};
use crate::wire::Payload;
use crate::{Compressed, Error, Result};

/// The density braid uses by default (the seed's advice: start at 10%, not 0.1%).
pub const DEFAULT_DENSITY: f32 = 0.10;

/// Exact top-k: keeps the `k = `[`k_for_density`]`(len, density)` elements of largest magnitude.
///
/// Magnitudes are compared as `|x|.total_cmp` (so NaN ranks above +∞ and is sent, not hidden in the error
/// buffer; −0 equals +0), and equal magnitudes go to the lower index, so the selected set is unique. The
/// output is a [`Payload::Sparse`] with ascending indices and the original values. The default keeps 10%.
#[derive(Clone, Debug, PartialEq)]
pub struct TopK {
    density: f32,
}

impl TopK {
    /// Top-k at `density` in `(0, 1]`.
    pub fn new(density: f32) -> Result<Self> {
        check_density("top-k", density)?;
        Ok(TopK { density })
    }

    /// The configured density.
    pub fn density(&self) -> f32 {
        self.density
    }
}

impl Default for TopK {
    fn default() -> Self {
        TopK {
            density: DEFAULT_DENSITY,
        }
    }
}

/// The exact top-k of `grad` as a sparse payload.
pub(crate) fn exact_top_k(grad: &[f32], k: usize) -> Compressed {
    let indices = top_k_u32(grad.len(), k, |i| abs_key(grad[i]));
    let values = indices.iter().map(|&i| grad[i as usize]).collect();
    Compressed::new_unchecked(grad.len(), Payload::Sparse { indices, values })
}

/// The exact top-`k` of `grad` by the rule of [`TopK`] (largest magnitudes, ties to the lower index,
/// ascending indices, original values), for a count rather than a density; `k` is clamped to
/// `grad.len()`. The re-selection of a range in braid's sparse reduce-scatter.
///
/// ```
/// use braid_compress::{top_k, Payload};
/// let c = top_k(&[1.0, -3.0, 2.0, 3.0, -2.0], 3);
/// let want = Payload::Sparse { indices: vec![1, 2, 3], values: vec![-3.0, 2.0, 3.0] };
/// assert_eq!(c.payload(), &want);
/// assert_eq!(top_k(&[1.0, 2.0], 5).to_dense(), [1.0, 2.0]);
/// ```
///
/// # Panics
///
/// If `grad.len()` exceeds `u32::MAX`, as [`TopK`] does.
pub fn top_k(grad: &[f32], k: usize) -> Compressed {
    assert_indexable("top-k", grad.len());
    exact_top_k(grad, k)
}

impl Codec for TopK {
    fn name(&self) -> String {
        format!("top-k(density={})", self.density)
    }

    fn transport(&self) -> Transport {
        Transport::Gather
    }

    fn compress(&mut self, grad: &[f32], _step: u64) -> Compressed {
        assert_indexable("top-k", grad.len());
        exact_top_k(grad, k_for_density(grad.len(), self.density))
    }
}

/// Top-k by a threshold estimated from a random sample, as Deep Gradient Compression does: cheaper than an
/// exact selection on a GPU, at the price of a density that only approximates the target.
///
/// For a tensor of `len` elements and target `k = `[`k_for_density`]`(len, density)`:
///
/// 1. `s = max(⌈sample_fraction · len⌉, min_sample)`. If `s ≥ len` the sample is the whole tensor; otherwise
///    it is `s` indices drawn with replacement, draw `j` being
///    `Stream::new(seed, TAG_SAMPLE, step).index_at(j, len)`.
/// 2. The threshold `t` is the `k_for_density(s, density)`-th largest sampled magnitude.
/// 3. Every element with `|x| ≥ t` is sent (magnitudes compared as in [`TopK`]), in ascending index order.
/// 4. If that is more than `⌈max_overshoot · k⌉` elements, the exact top-k is sent instead (the largest `k`
///    are all above the threshold, so this is DGC's second, exact selection among the candidates).
///
/// The density actually achieved is reported in [`Stats::density`](crate::Stats::density).
#[derive(Clone, Debug, PartialEq)]
pub struct ThresholdTopK {
    density: f32,
    seed: u64,
    sample_fraction: f32,
    min_sample: usize,
    max_overshoot: f32,
}

impl ThresholdTopK {
    /// Threshold top-k at `density`, sampling with `seed` (the same on every rank keeps ranks comparable,
    /// but nothing requires it). Samples 1% of the tensor, at least 1024 elements, and falls back to exact
    /// selection above twice the target.
    pub fn new(density: f32, seed: u64) -> Result<Self> {
        check_density("threshold top-k", density)?;
        Ok(ThresholdTopK {
            density,
            seed,
            sample_fraction: 0.01,
            min_sample: 1024,
            max_overshoot: 2.0,
        })
    }

    /// Samples `fraction` (in `(0, 1]`) of the tensor, and at least `min_sample ≥ 1` elements.
    pub fn with_sample(mut self, fraction: f32, min_sample: usize) -> Result<Self> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(Error::InvalidParameter(format!(
                "threshold top-k sample fraction must be in (0, 1], got {fraction}"
            )));
        }
        if min_sample == 0 {
            return Err(Error::InvalidParameter(
                "threshold top-k minimum sample must be at least 1".into(),
            ));
        }
        self.sample_fraction = fraction;
        self.min_sample = min_sample;
        Ok(self)
    }

    /// Falls back to exact top-k when more than `overshoot · k` elements pass the threshold (`overshoot ≥ 1`).
    pub fn with_max_overshoot(mut self, overshoot: f32) -> Result<Self> {
        if overshoot.is_nan() || overshoot < 1.0 {
            return Err(Error::InvalidParameter(format!(
                "threshold top-k max overshoot must be ≥ 1, got {overshoot}"
            )));
        }
        self.max_overshoot = overshoot;
        Ok(self)
    }

    /// The target density.
    pub fn density(&self) -> f32 {
        self.density
    }

    /// The threshold (as an [`abs`](f32::abs) bit pattern) for `grad` at `step`.
    fn threshold(&self, grad: &[f32], step: u64) -> u32 {
        let len = grad.len();
        let s = ((self.sample_fraction as f64 * len as f64).ceil() as usize).max(self.min_sample);
        let mut sample: Vec<u32> = if s >= len {
            grad.iter().map(|&x| abs_key(x)).collect()
        } else {
            let stream = Stream::new(self.seed, TAG_SAMPLE, step);
            (0..s as u64)
                .map(|j| abs_key(grad[stream.index_at(j, len as u64) as usize]))
                .collect()
        };
        let ks = k_for_density(sample.len(), self.density);
        *sample.select_nth_unstable_by(ks - 1, |a, b| b.cmp(a)).1
    }
}

impl Codec for ThresholdTopK {
    fn name(&self) -> String {
        format!(
            "threshold-top-k(density={}, sample={}, min_sample={}, max_overshoot={}, seed={})",
            self.density, self.sample_fraction, self.min_sample, self.max_overshoot, self.seed
        )
    }

    fn transport(&self) -> Transport {
        Transport::Gather
    }

    fn compress(&mut self, grad: &[f32], step: u64) -> Compressed {
        assert_indexable("threshold top-k", grad.len());
        let len = grad.len();
        if len == 0 {
            return Compressed::new_unchecked(
                0,
                Payload::Sparse {
                    indices: Vec::new(),
                    values: Vec::new(),
                },
            );
        }
        let k = k_for_density(len, self.density);
        let cap = ((self.max_overshoot as f64 * k as f64).ceil() as usize).min(len);
        let t = self.threshold(grad, step);
        let mut indices = Vec::with_capacity(cap.min(2 * k));
        for (i, &x) in grad.iter().enumerate() {
            if abs_key(x) >= t {
                if indices.len() == cap {
                    return exact_top_k(grad, k);
                }
                indices.push(i as u32);
            }
        }
        let values = indices.iter().map(|&i| grad[i as usize]).collect();
        Compressed::new_unchecked(len, Payload::Sparse { indices, values })
    }
}
