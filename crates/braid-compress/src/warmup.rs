//! Density warm-up for sparse gradients (Deep Gradient Compression, Lin et al. 2018): start from a
//! dense-ish density and lower it exponentially to the target over the first steps, so that the residual
//! does not build up while the model moves fastest.

use crate::error::{Error, Result};

/// An exponential density warm-up: `start` at step 0, multiplied by the same factor every step until it
/// reaches the target at step `steps`, and the target from then on (DGC: 25%, 6.25%, 1.5625%, 0.4%, 0.1%
/// over four epochs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DensityWarmup {
    /// Density at step 0, in `(0, 1]`.
    pub start: f32,
    /// Steps until the target is reached (0: no warm-up).
    pub steps: u64,
}

impl DensityWarmup {
    /// A warm-up from `start` over `steps` steps; `start` must be in `(0, 1]`.
    pub fn new(start: f32, steps: u64) -> Result<Self> {
        if !(start > 0.0 && start <= 1.0) {
            return Err(Error::InvalidParameter(format!(
                "density warm-up: the start density must be in (0, 1], got {start}"
            )));
        }
        Ok(DensityWarmup { start, steps })
    }

    /// The density of step `step` towards `target`. With `steps == 0`, `start <= target` or `step >= steps`
    /// it is `target`.
    pub fn density(&self, target: f32, step: u64) -> f32 {
        if self.steps == 0 || self.start <= target || step >= self.steps {
            return target;
        }
        let ratio = (target as f64 / self.start as f64).powf(step as f64 / self.steps as f64);
        ((self.start as f64 * ratio) as f32).max(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_up_falls_exponentially_to_the_target() {
        let w = DensityWarmup::new(0.25, 4).unwrap();
        let d: Vec<f32> = (0..6).map(|s| w.density(0.001, s)).collect();
        assert!((d[0] - 0.25).abs() < 1e-6);
        assert!(d.windows(2).all(|p| p[1] <= p[0]), "{d:?}");
        assert!((d[1] / d[0] - d[2] / d[1]).abs() < 1e-3, "{d:?}");
        assert!((d[1] - 0.25 * (0.001f32 / 0.25).powf(0.25)).abs() < 1e-5);
        assert_eq!(d[4], 0.001);
        assert_eq!(d[5], 0.001);
        assert_eq!(DensityWarmup::new(0.01, 10).unwrap().density(0.1, 0), 0.1);
        assert_eq!(DensityWarmup::new(0.25, 0).unwrap().density(0.01, 0), 0.01);
    }

    #[test]
    fn a_bad_start_is_refused() {
        for bad in [0.0, -0.5, 1.5, f32::NAN] {
            assert!(DensityWarmup::new(bad, 10).is_err(), "{bad}");
        }
    }
}
