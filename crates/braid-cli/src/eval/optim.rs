//! SGD with momentum and Adam, over flat parameter and gradient vectors.

use std::fmt;
use std::str::FromStr;

use braid::Output;

/// Which optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OptKind {
    /// SGD with heavy-ball momentum 0.9.
    Sgd,
    /// Adam (β1 0.9, β2 0.999, ε 1e-8).
    Adam,
}

impl FromStr for OptKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sgd" => Ok(OptKind::Sgd),
            "adam" => Ok(OptKind::Adam),
            other => Err(format!(
                "unknown optimizer {other:?} (expected sgd or adam)"
            )),
        }
    }
}

impl fmt::Display for OptKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OptKind::Sgd => "sgd",
            OptKind::Adam => "adam",
        })
    }
}

impl OptKind {
    /// Whether the optimizer scales steps by a second-moment estimate (the seed's adaptive optimizers).
    pub fn is_adaptive(self) -> bool {
        matches!(self, OptKind::Adam)
    }
}

/// An optimizer's state for one parameter vector.
#[derive(Clone, Debug)]
pub enum Optimizer {
    /// `v = μ·v + g; p −= lr·v` (the PyTorch form, no dampening).
    Sgd {
        lr: f32,
        momentum: f32,
        velocity: Vec<f32>,
    },
    /// `m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²; p −= lr·m̂ / (√v̂ + ε)` with bias-corrected `m̂`, `v̂`.
    /// Given the first moment instead of the gradient (Adam-safe compression, [`Output::Momentum`]), it
    /// takes `m` as given, keeps `v` (and its bias correction) frozen, and steps
    /// `p −= lr·m / (√max(v̂, m²) + ε)`: the floor bounds every step by `lr`, as Adam's own steps are.
    Adam {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        t: i32,
        m: Vec<f32>,
        v: Vec<f32>,
    },
}

impl Optimizer {
    /// SGD with momentum 0.9.
    #[cfg(test)]
    pub fn sgd(lr: f32, len: usize) -> Self {
        Self::sgd_with(lr, 0.9, len)
    }

    /// SGD with the given momentum (0 for plain SGD, as momentum correction needs).
    pub fn sgd_with(lr: f32, momentum: f32, len: usize) -> Self {
        Optimizer::Sgd {
            lr,
            momentum,
            velocity: vec![0.0; len],
        }
    }

    /// Adam with β1 0.9, β2 0.999, ε 1e-8.
    pub fn adam(lr: f32, len: usize) -> Self {
        Optimizer::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            t: 0,
            m: vec![0.0; len],
            v: vec![0.0; len],
        }
    }

    /// Sets the learning rate (for a schedule).
    pub fn set_lr(&mut self, rate: f32) {
        match self {
            Optimizer::Sgd { lr, .. } | Optimizer::Adam { lr, .. } => *lr = rate,
        }
    }

    /// Applies one step of `grad` to `params`.
    #[cfg(test)]
    pub fn step(&mut self, params: &mut [f32], grad: &[f32]) {
        self.step_with(params, grad, Output::Gradient);
    }

    /// Applies one step of what a synchronisation returned: the gradient, or (Adam-safe compression)
    /// Adam's first moment, which Adam applies with its second moment frozen. SGD treats both alike.
    pub fn step_with(&mut self, params: &mut [f32], grad: &[f32], output: Output) {
        match self {
            Optimizer::Sgd {
                lr,
                momentum,
                velocity,
            } => {
                assert!(params.len() == velocity.len() && grad.len() == velocity.len());
                for ((p, v), g) in params.iter_mut().zip(velocity.iter_mut()).zip(grad) {
                    *v = *momentum * *v + g;
                    *p -= *lr * *v;
                }
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                t,
                m,
                v,
            } => {
                assert!(params.len() == m.len() && grad.len() == m.len());
                if output == Output::Momentum {
                    // The second moment (and its bias correction) stays as the warm-up left it, floored
                    // by the moment's square: a parameter whose gradient was zero through the warm-up
                    // (a dead unit) has v ≈ 0, and m / √v would throw it arbitrarily far; with the floor
                    // no step exceeds lr, as no Adam step does.
                    let c2 = 1.0 - beta2.powi((*t).max(1));
                    for (((p, m), v), &g) in
                        params.iter_mut().zip(m.iter_mut()).zip(v.iter()).zip(grad)
                    {
                        *m = g;
                        let vh = (*v / c2).max(g * g);
                        *p -= *lr * g / (vh.sqrt() + *eps);
                    }
                    return;
                }
                *t += 1;
                let c1 = 1.0 - beta1.powi(*t);
                let c2 = 1.0 - beta2.powi(*t);
                for (((p, m), v), &g) in params
                    .iter_mut()
                    .zip(m.iter_mut())
                    .zip(v.iter_mut())
                    .zip(grad)
                {
                    *m = *beta1 * *m + (1.0 - *beta1) * g;
                    *v = *beta2 * *v + (1.0 - *beta2) * g * g;
                    let mh = *m / c1;
                    let vh = *v / c2;
                    *p -= *lr * mh / (vh.sqrt() + *eps);
                }
            }
        }
    }
}

/// The cosine schedule's factor at `step` of `steps`: `(1 + cos(π · step / steps)) / 2`, from 1 down
/// towards 0, so runs end with small steps and their final losses are not one noisy snapshot.
pub fn cosine(step: u64, steps: u64) -> f32 {
    (0.5 * (1.0 + (std::f64::consts::PI * step as f64 / steps.max(1) as f64).cos())) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64) -> bool {
        (a as f64 - b).abs() <= 1e-6 * b.abs().max(1.0)
    }

    #[test]
    fn sgd_momentum_matches_hand_computed_steps() {
        // p0 = [1, -2], lr 0.1, μ 0.9.
        // g1 = [1, 0.5]: v = [1, 0.5],      p = [0.9, -2.05]
        // g2 = [1, -1]:  v = [1.9, -0.55],  p = [0.71, -1.995]
        let mut opt = Optimizer::sgd(0.1, 2);
        let mut p = [1.0f32, -2.0];
        opt.step(&mut p, &[1.0, 0.5]);
        assert!(close(p[0], 0.9) && close(p[1], -2.05), "{p:?}");
        opt.step(&mut p, &[1.0, -1.0]);
        assert!(close(p[0], 0.71) && close(p[1], -1.995), "{p:?}");
    }

    #[test]
    fn adam_matches_hand_computed_steps() {
        // lr 0.1, p0 = 0. Step 1, g = 2: m = 0.2, v = 0.004, m̂ = 2, v̂ = 4,
        //   p = −0.1 · 2 / (2 + 1e-8) = −0.09999999950.
        // Step 2, g = −1: m = 0.18 − 0.1 = 0.08, v = 0.003996 + 0.001 = 0.004996,
        //   m̂ = 0.08 / 0.19 = 0.4210526316, v̂ = 0.004996 / 0.001999 = 2.4992496248,
        //   √v̂ = 1.5809015228, step = 0.1 · 0.4210526316 / 1.5809015228 = 0.0266337038,
        //   p = −0.0999999995 − 0.0266337038 = −0.1266337033.
        let mut opt = Optimizer::adam(0.1, 1);
        let mut p = [0.0f32];
        opt.step(&mut p, &[2.0]);
        assert!(close(p[0], -0.0999999995), "{p:?}");
        opt.step(&mut p, &[-1.0]);
        assert!(close(p[0], -0.1266337033), "{p:?}");
    }

    #[test]
    fn adam_first_step_is_lr_times_sign_whatever_the_scale() {
        for g in [1e-3f32, 1.0, 1e3] {
            let mut opt = Optimizer::adam(0.01, 2);
            let mut p = [0.0f32, 0.0];
            opt.step(&mut p, &[g, -g]);
            assert!(close(p[0], -0.01) && close(p[1], 0.01), "g {g}: {p:?}");
        }
    }

    #[test]
    fn set_lr_changes_the_next_step_only() {
        let mut opt = Optimizer::sgd(0.1, 1);
        let mut p = [0.0f32];
        opt.step(&mut p, &[1.0]); // v = 1, p = -0.1
        opt.set_lr(0.01);
        opt.step(&mut p, &[1.0]); // v = 1.9, p = -0.1 - 0.019
        assert!(close(p[0], -0.119), "{p:?}");
    }

    #[test]
    fn adam_given_the_first_moment_keeps_its_second_moment_frozen() {
        // One ordinary step (g = 2: m = 0.2, v = 0.004, v̂ = 4), then the moment 0.5 is given:
        // p −= 0.1 · 0.5 / (√4 + ε), and v stays 0.004 however large the moment.
        let mut opt = Optimizer::adam(0.1, 1);
        let mut p = [0.0f32];
        opt.step(&mut p, &[2.0]);
        let after_one = p[0] as f64;
        opt.step_with(&mut p, &[0.5], Output::Momentum);
        assert!(close(p[0], after_one - 0.025), "{p:?}");
        // A moment far above √v̂ moves the parameter by lr at most (the floor), not by lr·m/√v̂.
        opt.step_with(&mut p, &[100.0], Output::Momentum);
        assert!(close(p[0], after_one - 0.025 - 0.1), "{p:?}");
        let Optimizer::Adam { v, m, t, .. } = &opt else {
            unreachable!()
        };
        assert!(
            (v[0] - 0.004).abs() < 1e-6 && m[0] == 100.0 && *t == 1,
            "{v:?} {m:?} {t}"
        );
        // SGD with momentum 0 is plain SGD.
        let mut sgd = Optimizer::sgd_with(0.1, 0.0, 1);
        let mut q = [0.0f32];
        sgd.step(&mut q, &[1.0]);
        sgd.step(&mut q, &[1.0]);
        assert!(close(q[0], -0.2), "{q:?}");
    }

    /// Half a cosine from the base rate to zero.
    #[test]
    fn cosine_schedule_runs_from_full_to_zero() {
        assert_eq!(cosine(0, 100), 1.0);
        assert!((cosine(50, 100) - 0.5).abs() < 1e-6);
        assert!(cosine(99, 100) < 0.001);
        assert!(cosine(25, 100) > cosine(75, 100));
    }

    #[test]
    fn kinds_parse_and_report_adaptivity() {
        assert_eq!("SGD".parse::<OptKind>().unwrap(), OptKind::Sgd);
        assert_eq!("adam".parse::<OptKind>().unwrap(), OptKind::Adam);
        assert!("rmsprop".parse::<OptKind>().is_err());
        assert!(OptKind::Adam.is_adaptive() && !OptKind::Sgd.is_adaptive());
    }
}
