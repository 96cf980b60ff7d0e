//! A multilayer perceptron over one flat parameter vector: dense layers, ReLU between them, softmax
//! cross-entropy on top.
//!
//! Parameters and gradients are single contiguous `f32` slices (per layer: the weight matrix, row-major
//! `out × in`, then the bias), so one gradient is one buffer to synchronise, as a data-parallel trainer
//! hands it to an all-reduce.

use super::rng::Rng;

/// Layer shapes and where each layer's weights and biases sit in the flat vector.
#[derive(Clone, Debug)]
pub struct Mlp {
    sizes: Vec<usize>,
    /// Per layer: offset of the weights, offset of the biases.
    offsets: Vec<(usize, usize)>,
    params: usize,
}

/// Buffers reused across samples: activations per layer and the backward signal.
#[derive(Default)]
pub struct Workspace {
    acts: Vec<Vec<f32>>,
    delta: Vec<f32>,
    next: Vec<f32>,
}

impl Mlp {
    /// A network with layer widths `sizes` (input, hidden…, classes): at least two entries, none zero.
    pub fn new(sizes: &[usize]) -> Result<Self, String> {
        if sizes.len() < 2 || sizes.contains(&0) {
            return Err(format!(
                "an MLP needs at least an input and an output width, all non-zero; got {sizes:?}"
            ));
        }
        let mut offsets = Vec::with_capacity(sizes.len() - 1);
        let mut at = 0;
        for w in sizes.windows(2) {
            let (fan_in, fan_out) = (w[0], w[1]);
            offsets.push((at, at + fan_in * fan_out));
            at += fan_in * fan_out + fan_out;
        }
        Ok(Mlp {
            sizes: sizes.to_vec(),
            offsets,
            params: at,
        })
    }

    /// Number of parameters (the length of the parameter and gradient vectors).
    pub fn num_params(&self) -> usize {
        self.params
    }

    /// Layer widths, input first.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// The shapes of the tensors in the flat parameter vector, in order: per layer the weight
    /// `[out, in]`, then the bias `[out]` (what PowerSGD factorises layer by layer).
    pub fn layer_shapes(&self) -> Vec<Vec<usize>> {
        self.sizes
            .windows(2)
            .flat_map(|w| [vec![w[1], w[0]], vec![w[1]]])
            .collect()
    }

    /// Input width.
    pub fn inputs(&self) -> usize {
        self.sizes[0]
    }

    /// He-initialised weights (normal, standard deviation `gain · sqrt(2 / fan_in)`) and zero biases, a
    /// pure function of `seed`.
    pub fn init(&self, seed: u64, gain: f32) -> Vec<f32> {
        let mut rng = Rng::new(seed, 0x1417);
        let mut p = vec![0.0f32; self.params];
        for (l, w) in self.sizes.windows(2).enumerate() {
            let (fan_in, fan_out) = (w[0], w[1]);
            let std = gain as f64 * (2.0 / fan_in as f64).sqrt();
            let (wo, _) = self.offsets[l];
            for v in &mut p[wo..wo + fan_in * fan_out] {
                *v = (rng.normal() * std) as f32;
            }
        }
        p
    }

    /// Runs one sample forward; `ws.acts[l]` holds layer `l`'s output (after ReLU for hidden layers,
    /// logits for the last), `ws.acts[0]` the input.
    fn forward(&self, params: &[f32], x: &[f32], ws: &mut Workspace) {
        ws.acts.resize(self.sizes.len(), Vec::new());
        ws.acts[0].clear();
        ws.acts[0].extend_from_slice(x);
        let layers = self.offsets.len();
        for l in 0..layers {
            let (fan_in, fan_out) = (self.sizes[l], self.sizes[l + 1]);
            let (wo, bo) = self.offsets[l];
            let (before, after) = ws.acts.split_at_mut(l + 1);
            let input = &before[l];
            let out = &mut after[0];
            out.clear();
            for o in 0..fan_out {
                let row = &params[wo + o * fan_in..wo + (o + 1) * fan_in];
                let mut s = params[bo + o];
                for (w, a) in row.iter().zip(input.iter()) {
                    s += w * a;
                }
                out.push(if l + 1 < layers { s.max(0.0) } else { s });
            }
        }
    }

    /// The logits of one sample.
    pub fn logits(&self, params: &[f32], x: &[f32], ws: &mut Workspace) -> Vec<f32> {
        self.forward(params, x, ws);
        ws.acts.last().expect("layers").clone()
    }

    /// Adds `scale ·` the gradient of the summed loss over the samples (`xs`: `ys.len()` rows of
    /// [`inputs`](Self::inputs) values) to `grad`, and returns the summed loss.
    pub fn loss_and_grad(
        &self,
        params: &[f32],
        xs: &[f32],
        ys: &[u32],
        scale: f32,
        grad: &mut [f32],
        ws: &mut Workspace,
    ) -> f64 {
        assert_eq!(params.len(), self.params, "parameter vector length");
        assert_eq!(grad.len(), self.params, "gradient vector length");
        let d = self.inputs();
        let mut total = 0.0;
        let layers = self.offsets.len();
        for (i, &y) in ys.iter().enumerate() {
            self.forward(params, &xs[i * d..(i + 1) * d], ws);
            let mut delta = std::mem::take(&mut ws.delta);
            total += cross_entropy(&ws.acts[layers], y as usize, &mut delta);
            // dL/dlogits = softmax − onehot.
            delta[y as usize] -= 1.0;
            for l in (0..layers).rev() {
                let (fan_in, fan_out) = (self.sizes[l], self.sizes[l + 1]);
                let (wo, bo) = self.offsets[l];
                let input = &ws.acts[l];
                for o in 0..fan_out {
                    let g = delta[o] * scale;
                    if g != 0.0 {
                        grad[bo + o] += g;
                        let row = &mut grad[wo + o * fan_in..wo + (o + 1) * fan_in];
                        for (gw, a) in row.iter_mut().zip(input.iter()) {
                            *gw += g * a;
                        }
                    }
                }
                if l > 0 {
                    // Back through the weights, then through the ReLU of layer l's input.
                    ws.next.clear();
                    ws.next.resize(fan_in, 0.0);
                    for (o, &dv) in delta.iter().enumerate().take(fan_out) {
                        if dv != 0.0 {
                            let row = &params[wo + o * fan_in..wo + (o + 1) * fan_in];
                            for (n, w) in ws.next.iter_mut().zip(row) {
                                *n += dv * w;
                            }
                        }
                    }
                    for (n, a) in ws.next.iter_mut().zip(input.iter()) {
                        if *a <= 0.0 {
                            *n = 0.0;
                        }
                    }
                    std::mem::swap(&mut delta, &mut ws.next);
                }
            }
            ws.delta = delta;
        }
        total
    }

    /// Summed loss and number of correct predictions over the samples.
    pub fn evaluate(
        &self,
        params: &[f32],
        xs: &[f32],
        ys: &[u32],
        ws: &mut Workspace,
    ) -> (f64, usize) {
        let d = self.inputs();
        let layers = self.offsets.len();
        score(ys, |i, logits| {
            self.forward(params, &xs[i * d..(i + 1) * d], ws);
            logits.clone_from(&ws.acts[layers]);
        })
    }
}

/// Softmax cross-entropy of `logits` against class `y` (computed stably in f64), and the probabilities
/// in `probs`.
pub fn cross_entropy(logits: &[f32], y: usize, probs: &mut Vec<f32>) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&z| (z as f64 - max).exp()).sum();
    probs.clear();
    probs.extend(
        logits
            .iter()
            .map(|&z| ((z as f64 - max).exp() / sum) as f32),
    );
    sum.ln() + max - logits[y] as f64
}

/// Summed cross-entropy and correct predictions over the labels `ys`, `logits(i, out)` writing sample
/// `i`'s logits into `out`.
pub fn score(ys: &[u32], mut logits: impl FnMut(usize, &mut Vec<f32>)) -> (f64, usize) {
    let (mut z, mut probs) = (Vec::new(), Vec::new());
    let (mut loss, mut correct) = (0.0, 0);
    for (i, &y) in ys.iter().enumerate() {
        logits(i, &mut z);
        loss += cross_entropy(&z, y as usize, &mut probs);
        if argmax(&z) == y as usize {
            correct += 1;
        }
    }
    (loss, correct)
}

/// Index of the largest value (the first one on ties).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(seed: u64, n: usize, d: usize, classes: usize) -> (Vec<f32>, Vec<u32>) {
        let mut r = Rng::new(seed, 5);
        let xs = (0..n * d).map(|_| r.normal() as f32).collect();
        let ys = (0..n).map(|_| r.below(classes) as u32).collect();
        (xs, ys)
    }

    #[test]
    fn layout_counts_weights_and_biases() {
        let m = Mlp::new(&[3, 4, 2]).unwrap();
        assert_eq!(m.num_params(), 3 * 4 + 4 + 4 * 2 + 2);
        assert!(Mlp::new(&[3]).is_err());
        assert!(Mlp::new(&[3, 0, 2]).is_err());
        // The shapes follow the flat vector: weight [out, in] at its offset, then the bias.
        let shapes = m.layer_shapes();
        assert_eq!(shapes, [vec![4, 3], vec![4], vec![2, 4], vec![2]]);
        let mut at = 0;
        for (l, &(wo, bo)) in m.offsets.iter().enumerate() {
            assert_eq!((wo, bo), (at, at + shapes[2 * l].iter().product::<usize>()));
            at = bo + shapes[2 * l + 1][0];
        }
        assert_eq!(at, m.num_params());
    }

    #[test]
    fn init_is_a_function_of_the_seed() {
        let m = Mlp::new(&[5, 7, 3]).unwrap();
        assert_eq!(m.init(9, 1.0), m.init(9, 1.0));
        assert_ne!(m.init(9, 1.0), m.init(10, 1.0));
        // Biases start at zero, weights do not.
        let p = m.init(9, 1.0);
        assert!(p[5 * 7..5 * 7 + 7].iter().all(|b| *b == 0.0));
        assert!(p[..5 * 7].iter().any(|w| *w != 0.0));
    }

    /// Central finite differences in f64 arithmetic over the f32 model agree with backpropagation.
    #[test]
    fn gradient_matches_finite_differences() {
        let m = Mlp::new(&[4, 6, 5, 3]).unwrap();
        let mut p = m.init(11, 1.0);
        // Non-zero biases, so that their gradients and ReLU boundaries are exercised.
        let mut r = Rng::new(12, 0);
        for v in p.iter_mut() {
            *v += (r.normal() * 0.1) as f32;
        }
        let (xs, ys) = sample(13, 6, 4, 3);
        let mut ws = Workspace::default();
        let mut grad = vec![0.0f32; m.num_params()];
        let scale = 0.5;
        let loss = m.loss_and_grad(&p, &xs, &ys, scale, &mut grad, &mut ws);
        assert!(loss > 0.0);
        let (check, _) = m.evaluate(&p, &xs, &ys, &mut ws);
        assert!((loss - check).abs() < 1e-9, "{loss} vs {check}");
        let h = 1e-2f32;
        let mut worst = 0.0f64;
        for i in 0..m.num_params() {
            let orig = p[i];
            p[i] = orig + h;
            let (up, _) = m.evaluate(&p, &xs, &ys, &mut ws);
            p[i] = orig - h;
            let (down, _) = m.evaluate(&p, &xs, &ys, &mut ws);
            p[i] = orig;
            let numeric = scale as f64 * (up - down) / (2.0 * h as f64);
            let err =
                (numeric - grad[i] as f64).abs() / (1e-2 + numeric.abs().max(grad[i].abs() as f64));
            worst = worst.max(err);
        }
        assert!(worst < 2e-2, "worst relative gradient error {worst}");
    }

    #[test]
    fn gradient_accumulates_and_a_step_against_it_lowers_the_loss() {
        let m = Mlp::new(&[4, 8, 3]).unwrap();
        let p = m.init(1, 1.0);
        let (xs, ys) = sample(2, 16, 4, 3);
        let mut ws = Workspace::default();
        let mut once = vec![0.0f32; m.num_params()];
        m.loss_and_grad(&p, &xs, &ys, 1.0, &mut once, &mut ws);
        let mut twice = once.clone();
        m.loss_and_grad(&p, &xs, &ys, 1.0, &mut twice, &mut ws);
        for (a, b) in once.iter().zip(&twice) {
            assert!((2.0 * a - b).abs() <= 1e-5 * a.abs().max(1.0));
        }
        let (before, _) = m.evaluate(&p, &xs, &ys, &mut ws);
        let stepped: Vec<f32> = p.iter().zip(&once).map(|(w, g)| w - 0.01 * g).collect();
        let (after, _) = m.evaluate(&stepped, &xs, &ys, &mut ws);
        assert!(after < before, "{after} >= {before}");
    }

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[5.0]), 0);
    }
}
