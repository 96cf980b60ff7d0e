//! Momentum correction and density warm-up for sparse gradients (Deep Gradient Compression, Lin et al.
//! 2018).
//!
//! Plain error feedback keeps the unsent part of the *gradient*; with an optimizer that also keeps
//! momentum, the unsent coordinates then miss their momentum and the sent ones get it twice (error
//! feedback already acts as a hidden momentum). Momentum correction moves the momentum into the
//! compressor instead: it keeps the velocity `u ← m·u + g` and accumulates velocity, not gradient,
//! into the residual `v ← v + u`; it sends the largest coordinates of `v` and clears both `u` and `v`
//! there (momentum factor masking), so a coordinate's momentum starts again after it is applied. The
//! caller then runs **plain SGD** (its own momentum off) on the summed result.
//!
//! A density warm-up starts from a dense-ish density and lowers it exponentially to the target over
//! the first steps, so that the residual does not build up while the model moves fastest.

use crate::error::{zeros, Error, Result};
use crate::select::{abs_key, top_k_u32};

/// The velocity and residual of one tensor under momentum correction.
#[derive(Clone, Debug)]
pub struct MomentumCorrection {
    /// Momentum factor `m` in `[0, 1)`.
    pub momentum: f32,
    velocity: Vec<f32>,
    residual: Vec<f32>,
}

/// What one step selected: ascending indices and the residual's values there (what is sent).
#[derive(Clone, Debug, PartialEq)]
pub struct Selected {
    /// Ascending element indices.
    pub indices: Vec<u32>,
    /// The residual at those indices.
    pub values: Vec<f32>,
}

impl MomentumCorrection {
    /// State for `len` elements with momentum factor `momentum` (`[0, 1)`; 0.9 in DGC).
    pub fn new(len: usize, momentum: f32) -> Result<Self> {
        if !(0.0..1.0).contains(&momentum) {
            return Err(Error::InvalidParameter(format!(
                "momentum correction: the momentum factor must be in [0, 1), got {momentum}"
            )));
        }
        if len > u32::MAX as usize {
            return Err(Error::InvalidParameter(format!(
                "momentum correction: {len} elements cannot be indexed with u32"
            )));
        }
        Ok(MomentumCorrection {
            momentum,
            velocity: zeros(len, "momentum-correction velocity")?,
            residual: zeros(len, "momentum-correction residual")?,
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.velocity.len()
    }

    /// Whether the tensor is empty.
    pub fn is_empty(&self) -> bool {
        self.velocity.is_empty()
    }

    /// The velocity `u` (after the last step's masking).
    pub fn velocity(&self) -> &[f32] {
        &self.velocity
    }

    /// The residual `v` not yet sent (after the last step's masking).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// One step on the local gradient `grad`: `u ← m·u + g`, `v ← v + u`, select the `k` largest `|v|`,
    /// return them, and clear `u` and `v` there.
    pub fn step(&mut self, grad: &[f32], k: usize) -> Result<Selected> {
        if grad.len() != self.len() {
            return Err(Error::LengthMismatch {
                what: "gradient",
                expected: self.len(),
                got: grad.len(),
            });
        }
        let m = self.momentum;
        for ((u, v), g) in self.velocity.iter_mut().zip(&mut self.residual).zip(grad) {
            *u = m * *u + g;
            *v += *u;
        }
        let residual = &self.residual;
        let indices = top_k_u32(residual.len(), k, |i| abs_key(residual[i]));
        let mut values = Vec::with_capacity(indices.len());
        for &i in &indices {
            let i = i as usize;
            values.push(self.residual[i]);
            self.residual[i] = 0.0;
            self.velocity[i] = 0.0;
        }
        Ok(Selected { indices, values })
    }
}

/// The density of step `step` under DGC's exponential warm-up: `start` at step 0, multiplied by the same
/// factor every step until it reaches `target` at step `steps` (and `target` from then on). With
/// `steps == 0` or `start <= target` it is `target` throughout.
pub fn warmup_density(start: f32, target: f32, steps: u64, step: u64) -> f32 {
    if steps == 0 || start <= target || step >= steps {
        return target;
    }
    let ratio = (target as f64 / start as f64).powf(step as f64 / steps as f64);
    ((start as f64 * ratio) as f32).max(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_every_coordinate_sent_masking_leaves_plain_sgd() {
        // Masking clears the velocity wherever it sends, so sending everything every step sends the
        // gradient itself: the momentum lives only in coordinates that wait between sends, which is
        // the sparse regime momentum correction is for.
        let mut mc = MomentumCorrection::new(3, 0.9).unwrap();
        for g in [[1.0, -2.0, 0.5], [0.5, 0.5, -1.0]] {
            let s = mc.step(&g, 3).unwrap();
            assert_eq!(s.values, g.to_vec());
            assert!(mc.velocity().iter().chain(mc.residual()).all(|x| *x == 0.0));
        }
    }

    #[test]
    fn nothing_is_lost_what_is_sent_plus_the_residual_is_all_accumulated_velocity() {
        let len = 50;
        let mut mc = MomentumCorrection::new(len, 0.9).unwrap();
        let mut sent = vec![0.0f64; len];
        let mut accumulated = vec![0.0f64; len];
        let mut u = vec![0.0f64; len];
        for step in 0..40u64 {
            let g: Vec<f32> = (0..len)
                .map(|i| ((i as u64 * 31 + step * 17) % 23) as f32 / 23.0 - 0.5)
                .collect();
            // The reference: the velocity each coordinate would have, restarted where it was sent.
            for i in 0..len {
                u[i] = 0.9 * u[i] + g[i] as f64;
                accumulated[i] += u[i];
            }
            let s = mc.step(&g, 5).unwrap();
            assert_eq!(s.indices.len(), 5);
            for (&i, &v) in s.indices.iter().zip(&s.values) {
                let i = i as usize;
                sent[i] += v as f64;
                // Masking: the reference restarts there too.
                u[i] = 0.0;
            }
            for i in 0..len {
                let total = sent[i] + mc.residual()[i] as f64;
                assert!(
                    (total - accumulated[i]).abs() < 1e-3,
                    "step {step} element {i}: {total} vs {}",
                    accumulated[i]
                );
            }
        }
    }

    #[test]
    fn the_largest_residuals_are_sent_and_cleared() {
        let mut mc = MomentumCorrection::new(4, 0.5).unwrap();
        let s = mc.step(&[0.1, -3.0, 2.0, 0.2], 2).unwrap();
        assert_eq!(s.indices, vec![1, 2]);
        assert_eq!(s.values, vec![-3.0, 2.0]);
        assert_eq!(mc.residual(), &[0.1, 0.0, 0.0, 0.2]);
        assert_eq!(mc.velocity(), &[0.1, 0.0, 0.0, 0.2]);
        // Next step: the unsent keep their momentum (u = 0.5·0.1 + 0.1), the sent start afresh.
        let _ = mc.step(&[0.1, 0.0, 0.0, 0.0], 0).unwrap();
        assert!((mc.velocity()[0] - 0.15).abs() < 1e-6);
        assert!((mc.residual()[0] - 0.25).abs() < 1e-6);
        assert_eq!(mc.velocity()[1], 0.0);
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert!(MomentumCorrection::new(3, 1.0).is_err());
        assert!(MomentumCorrection::new(3, -0.1).is_err());
        let mut mc = MomentumCorrection::new(3, 0.9).unwrap();
        assert!(matches!(
            mc.step(&[1.0], 1),
            Err(Error::LengthMismatch { got: 1, .. })
        ));
    }

    #[test]
    fn warm_up_falls_exponentially_to_the_target() {
        // DGC: 25%, 6.25%, 1.5625%, 0.4%, 0.1% over four epochs.
        let d: Vec<f32> = (0..6).map(|s| warmup_density(0.25, 0.001, 4, s)).collect();
        assert!((d[0] - 0.25).abs() < 1e-6);
        assert!(d.windows(2).all(|w| w[1] <= w[0]), "{d:?}");
        assert!((d[1] / d[0] - d[2] / d[1]).abs() < 1e-3, "{d:?}");
        assert_eq!(d[4], 0.001);
        assert_eq!(d[5], 0.001);
        assert_eq!(warmup_density(0.01, 0.1, 10, 0), 0.1);
        assert_eq!(warmup_density(0.25, 0.01, 0, 0), 0.01);
    }
}
