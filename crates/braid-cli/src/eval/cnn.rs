//! A small convolutional network over one flat parameter vector, for images of one channel:
//! conv 3×3 → ReLU → max-pool 2×2 → conv 3×3 → ReLU → max-pool 2×2 → dense → ReLU → dense, softmax
//! cross-entropy on top. Convolutions pad by one pixel ("same"), so only the pools shrink the image.
//!
//! The flat layout, per layer, is the weights then the biases: conv weights `out × in × 3 × 3`, dense
//! weights row-major `out × in`. Weight sharing, pooling and a dense head give its gradients the
//! structure of real vision models (a few heavy conv filters, many small head weights), which is what
//! compression sees in practice.

use super::mlp::{cross_entropy, score};
use super::rng::Rng;

/// Shapes of the network and where each layer's parameters sit.
#[derive(Clone, Debug)]
pub struct Cnn {
    /// Image side (square), a multiple of 4.
    side: usize,
    /// Channels of the two convolutions.
    c1: usize,
    c2: usize,
    /// Width of the hidden dense layer.
    hidden: usize,
    classes: usize,
    /// (weight offset, bias offset) of conv1, conv2, fc1, fc2.
    offsets: [(usize, usize); 4],
    params: usize,
}

/// Buffers reused across samples.
#[derive(Default)]
pub struct Workspace {
    a1: Vec<f32>,
    p1: Vec<f32>,
    i1: Vec<usize>,
    a2: Vec<f32>,
    p2: Vec<f32>,
    i2: Vec<usize>,
    h: Vec<f32>,
    z: Vec<f32>,
    dz: Vec<f32>,
    dh: Vec<f32>,
    dp2: Vec<f32>,
    da2: Vec<f32>,
    dp1: Vec<f32>,
    da1: Vec<f32>,
}

/// Calls `f(k, at)` for each tap `k = 3·dy + dx` of the 3×3 window centred on `(y, x)` that falls
/// inside a `side × side` plane, `at` being the input pixel it reads.
fn window(side: usize, y: usize, x: usize, mut f: impl FnMut(usize, usize)) {
    for dy in 0..3 {
        let sy = y + dy;
        if sy == 0 || sy > side {
            continue;
        }
        for dx in 0..3 {
            let sx = x + dx;
            if sx == 0 || sx > side {
                continue;
            }
            f(dy * 3 + dx, (sy - 1) * side + sx - 1);
        }
    }
}

/// `out[co][y][x] = b[co] + Σ_ci Σ_dy Σ_dx w[co][ci][dy][dx] · in[ci][y+dy−1][x+dx−1]` (zero outside).
fn conv_forward(input: &[f32], cin: usize, side: usize, w: &[f32], b: &[f32], out: &mut Vec<f32>) {
    let cout = b.len();
    out.clear();
    out.resize(cout * side * side, 0.0);
    for co in 0..cout {
        let plane = &mut out[co * side * side..(co + 1) * side * side];
        plane.fill(b[co]);
        for ci in 0..cin {
            let src = &input[ci * side * side..(ci + 1) * side * side];
            let k = &w[(co * cin + ci) * 9..(co * cin + ci + 1) * 9];
            for y in 0..side {
                for x in 0..side {
                    let mut s = 0.0;
                    window(side, y, x, |t, at| s += k[t] * src[at]);
                    plane[y * side + x] += s;
                }
            }
        }
    }
}

/// The backward pass of [`conv_forward`]: adds `scale ·` the weight and bias gradients to `dw`, `db`,
/// and writes the input gradient to `din` when asked.
#[allow(clippy::too_many_arguments)]
fn conv_backward(
    input: &[f32],
    cin: usize,
    side: usize,
    w: &[f32],
    dout: &[f32],
    scale: f32,
    dw: &mut [f32],
    db: &mut [f32],
    mut din: Option<&mut Vec<f32>>,
) {
    let cout = db.len();
    if let Some(d) = din.as_deref_mut() {
        d.clear();
        d.resize(cin * side * side, 0.0);
    }
    for co in 0..cout {
        let g = &dout[co * side * side..(co + 1) * side * side];
        db[co] += scale * g.iter().sum::<f32>();
        for ci in 0..cin {
            let src = &input[ci * side * side..(ci + 1) * side * side];
            let base = (co * cin + ci) * 9;
            for y in 0..side {
                for x in 0..side {
                    let gv = g[y * side + x];
                    if gv == 0.0 {
                        continue;
                    }
                    window(side, y, x, |t, at| {
                        dw[base + t] += scale * gv * src[at];
                        if let Some(d) = din.as_deref_mut() {
                            d[ci * side * side + at] += gv * w[base + t];
                        }
                    });
                }
            }
        }
    }
}

/// 2×2 max-pool of `channels` planes of `side × side`; `arg` records where each maximum came from.
fn pool_forward(
    input: &[f32],
    channels: usize,
    side: usize,
    out: &mut Vec<f32>,
    arg: &mut Vec<usize>,
) {
    let half = side / 2;
    out.clear();
    arg.clear();
    for c in 0..channels {
        for y in 0..half {
            for x in 0..half {
                let mut best = c * side * side + 2 * y * side + 2 * x;
                for (dy, dx) in [(0, 1), (1, 0), (1, 1)] {
                    let at = c * side * side + (2 * y + dy) * side + 2 * x + dx;
                    if input[at] > input[best] {
                        best = at;
                    }
                }
                out.push(input[best]);
                arg.push(best);
            }
        }
    }
}

/// Routes each pooled gradient back to the position its maximum came from.
fn pool_backward(dout: &[f32], arg: &[usize], len: usize, din: &mut Vec<f32>) {
    din.clear();
    din.resize(len, 0.0);
    for (g, &at) in dout.iter().zip(arg) {
        din[at] += g;
    }
}

/// `out = w · input + b` (`w` row-major `b.len() × input.len()`), then ReLU when `relu`.
fn dense_forward(input: &[f32], w: &[f32], b: &[f32], relu: bool, out: &mut Vec<f32>) {
    let n = input.len();
    out.clear();
    for (o, bias) in b.iter().enumerate() {
        let s = bias
            + w[o * n..(o + 1) * n]
                .iter()
                .zip(input)
                .map(|(a, x)| a * x)
                .sum::<f32>();
        out.push(if relu { s.max(0.0) } else { s });
    }
}

/// Adds `scale ·` the gradients of a dense layer to `dw`, `db`, and writes the input gradient to `din`.
fn dense_backward(
    input: &[f32],
    w: &[f32],
    dout: &[f32],
    scale: f32,
    dw: &mut [f32],
    db: &mut [f32],
    din: &mut Vec<f32>,
) {
    let n = input.len();
    din.clear();
    din.resize(n, 0.0);
    for (o, &g) in dout.iter().enumerate() {
        if g == 0.0 {
            continue;
        }
        db[o] += scale * g;
        for (i, x) in input.iter().enumerate() {
            dw[o * n + i] += scale * g * x;
            din[i] += g * w[o * n + i];
        }
    }
}

/// Zeroes `grad` where the ReLU output `act` was not positive.
fn relu_backward(grad: &mut [f32], act: &[f32]) {
    for (g, a) in grad.iter_mut().zip(act) {
        if *a <= 0.0 {
            *g = 0.0;
        }
    }
}

impl Cnn {
    /// A network for `side × side` images (`side` a positive multiple of 4) with `c1` and `c2`
    /// convolution channels, a dense layer of `hidden` units and `classes` outputs.
    pub fn new(
        side: usize,
        c1: usize,
        c2: usize,
        hidden: usize,
        classes: usize,
    ) -> Result<Self, String> {
        if side == 0 || side % 4 != 0 || [c1, c2, hidden, classes].contains(&0) {
            return Err(format!(
                "a CNN needs a side that is a positive multiple of 4 and non-zero widths; got side {side}, \
                 channels {c1}, {c2}, hidden {hidden}, classes {classes}"
            ));
        }
        let flat = c2 * (side / 4) * (side / 4);
        let shapes = [(c1, 9), (c2, c1 * 9), (hidden, flat), (classes, hidden)];
        let mut offsets = [(0, 0); 4];
        let mut at = 0;
        for (l, (out, fan_in)) in shapes.iter().enumerate() {
            offsets[l] = (at, at + out * fan_in);
            at += out * fan_in + out;
        }
        Ok(Cnn {
            side,
            c1,
            c2,
            hidden,
            classes,
            offsets,
            params: at,
        })
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.params
    }

    /// Pixels per image.
    pub fn inputs(&self) -> usize {
        self.side * self.side
    }

    /// The parameter tensors' shapes in flat order (weights then biases per layer), as a framework
    /// would list them.
    pub fn shapes(&self) -> Vec<Vec<usize>> {
        let flat = self.c2 * (self.side / 4) * (self.side / 4);
        vec![
            vec![self.c1, 1, 3, 3],
            vec![self.c1],
            vec![self.c2, self.c1, 3, 3],
            vec![self.c2],
            vec![self.hidden, flat],
            vec![self.hidden],
            vec![self.classes, self.hidden],
            vec![self.classes],
        ]
    }

    /// He-initialised weights and zero biases, a pure function of `seed`.
    pub fn init(&self, seed: u64, gain: f32) -> Vec<f32> {
        let mut rng = Rng::new(seed, 0xc0de);
        let mut p = vec![0.0f32; self.params];
        let flat = self.c2 * (self.side / 4) * (self.side / 4);
        let fan_ins = [9, self.c1 * 9, flat, self.hidden];
        for (l, &fan_in) in fan_ins.iter().enumerate() {
            let (wo, bo) = self.offsets[l];
            let std = gain as f64 * (2.0 / fan_in as f64).sqrt();
            for v in &mut p[wo..bo] {
                *v = (rng.normal() * std) as f32;
            }
        }
        p
    }

    fn slices<'a>(&self, p: &'a [f32], l: usize) -> (&'a [f32], &'a [f32]) {
        let (wo, bo) = self.offsets[l];
        let end = self.offsets.get(l + 1).map_or(self.params, |o| o.0);
        (&p[wo..bo], &p[bo..end])
    }

    fn forward(&self, p: &[f32], x: &[f32], ws: &mut Workspace) {
        let s = self.side;
        let (w, b) = self.slices(p, 0);
        conv_forward(x, 1, s, w, b, &mut ws.a1);
        ws.a1.iter_mut().for_each(|v| *v = v.max(0.0));
        pool_forward(&ws.a1, self.c1, s, &mut ws.p1, &mut ws.i1);
        let (w, b) = self.slices(p, 1);
        conv_forward(&ws.p1, self.c1, s / 2, w, b, &mut ws.a2);
        ws.a2.iter_mut().for_each(|v| *v = v.max(0.0));
        pool_forward(&ws.a2, self.c2, s / 2, &mut ws.p2, &mut ws.i2);
        let (w, b) = self.slices(p, 2);
        dense_forward(&ws.p2, w, b, true, &mut ws.h);
        let (w, b) = self.slices(p, 3);
        dense_forward(&ws.h, w, b, false, &mut ws.z);
    }

    /// Adds `scale ·` the gradient of the summed loss over the samples to `grad` and returns the summed
    /// loss (the same contract as the MLP's).
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
        let (d, s) = (self.inputs(), self.side);
        let mut total = 0.0;
        for (i, &y) in ys.iter().enumerate() {
            let x = &xs[i * d..(i + 1) * d];
            self.forward(params, x, ws);
            total += cross_entropy(&ws.z, y as usize, &mut ws.dz);
            ws.dz[y as usize] -= 1.0;
            let [g0, g1, g2, g3] = self.grads(grad);
            let (w, _) = self.slices(params, 3);
            dense_backward(&ws.h, w, &ws.dz, scale, g3.0, g3.1, &mut ws.dh);
            relu_backward(&mut ws.dh, &ws.h);
            let (w, _) = self.slices(params, 2);
            dense_backward(&ws.p2, w, &ws.dh, scale, g2.0, g2.1, &mut ws.dp2);
            pool_backward(&ws.dp2, &ws.i2, ws.a2.len(), &mut ws.da2);
            relu_backward(&mut ws.da2, &ws.a2);
            let (w, _) = self.slices(params, 1);
            conv_backward(
                &ws.p1,
                self.c1,
                s / 2,
                w,
                &ws.da2,
                scale,
                g1.0,
                g1.1,
                Some(&mut ws.dp1),
            );
            pool_backward(&ws.dp1, &ws.i1, ws.a1.len(), &mut ws.da1);
            relu_backward(&mut ws.da1, &ws.a1);
            let (w, _) = self.slices(params, 0);
            conv_backward(x, 1, s, w, &ws.da1, scale, g0.0, g0.1, None);
        }
        total
    }

    /// The gradient vector cut into each layer's (weights, biases).
    fn grads<'a>(&self, g: &'a mut [f32]) -> [(&'a mut [f32], &'a mut [f32]); 4] {
        let [(w0, b0), (w1, b1), (w2, b2), (w3, b3)] = self.offsets;
        let (l0, rest) = g.split_at_mut(w1);
        let (l1, rest) = rest.split_at_mut(w2 - w1);
        let (l2, l3) = rest.split_at_mut(w3 - w2);
        let (a0, c0) = l0.split_at_mut(b0 - w0);
        let (a1, c1) = l1.split_at_mut(b1 - w1);
        let (a2, c2) = l2.split_at_mut(b2 - w2);
        let (a3, c3) = l3.split_at_mut(b3 - w3);
        [(a0, c0), (a1, c1), (a2, c2), (a3, c3)]
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
        score(ys, |i, logits| {
            self.forward(params, &xs[i * d..(i + 1) * d], ws);
            logits.clone_from(&ws.z);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net() -> Cnn {
        Cnn::new(8, 3, 4, 5, 3).unwrap()
    }

    #[test]
    fn layout_counts_every_tensor() {
        let m = net();
        let want: usize = m.shapes().iter().map(|s| s.iter().product::<usize>()).sum();
        assert_eq!(m.num_params(), want);
        assert_eq!(
            m.num_params(),
            (3 * 9 + 3) + (4 * 27 + 4) + (5 * 16 + 5) + (3 * 5 + 3)
        );
        assert!(Cnn::new(6, 3, 4, 5, 3).is_err());
        assert!(Cnn::new(8, 0, 4, 5, 3).is_err());
        assert_eq!(m.init(3, 1.0), m.init(3, 1.0));
        assert_ne!(m.init(3, 1.0), m.init(4, 1.0));
    }

    /// Central finite differences agree with backpropagation for every parameter.
    #[test]
    fn gradient_matches_finite_differences() {
        let m = net();
        let mut p = m.init(5, 1.0);
        let mut r = Rng::new(6, 0);
        for v in p.iter_mut() {
            *v += (r.normal() * 0.05) as f32;
        }
        let n = 3;
        let xs: Vec<f32> = (0..n * m.inputs()).map(|_| r.normal() as f32).collect();
        let ys: Vec<u32> = (0..n).map(|i| (i % 3) as u32).collect();
        let mut ws = Workspace::default();
        let mut grad = vec![0.0f32; m.num_params()];
        let scale = 0.5;
        let loss = m.loss_and_grad(&p, &xs, &ys, scale, &mut grad, &mut ws);
        let (check, _) = m.evaluate(&p, &xs, &ys, &mut ws);
        assert!((loss - check).abs() < 1e-9, "{loss} vs {check}");
        let h = 1e-3f32;
        let mut bad = Vec::new();
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
            // A ReLU kink or a pooling tie inside ±h can spoil a few differences; almost all must agree.
            if err > 2e-2 {
                bad.push((i, numeric, grad[i]));
            }
        }
        assert!(
            bad.len() * 50 < m.num_params(),
            "{} of {} parameters disagree: {bad:?}",
            bad.len(),
            m.num_params()
        );
    }

    #[test]
    fn a_step_against_the_gradient_lowers_the_loss() {
        let m = net();
        let p = m.init(1, 1.0);
        let mut r = Rng::new(2, 0);
        let xs: Vec<f32> = (0..8 * m.inputs()).map(|_| r.normal() as f32).collect();
        let ys: Vec<u32> = (0..8).map(|i| (i % 3) as u32).collect();
        let mut ws = Workspace::default();
        let mut g = vec![0.0f32; m.num_params()];
        let before = m.loss_and_grad(&p, &xs, &ys, 1.0, &mut g, &mut ws);
        let stepped: Vec<f32> = p.iter().zip(&g).map(|(w, g)| w - 0.01 * g).collect();
        let (after, _) = m.evaluate(&stepped, &xs, &ys, &mut ws);
        assert!(after < before, "{after} >= {before}");
    }
}
