//! The model a task trains: an MLP or the small CNN, behind one interface over flat parameter and
//! gradient vectors.

use super::cnn;
use super::mlp;

/// A model over one flat parameter vector.
#[derive(Clone, Debug)]
pub enum Net {
    /// Dense layers (see [`mlp::Mlp`]).
    Mlp(mlp::Mlp),
    /// Two convolutions and a dense head (see [`cnn::Cnn`]).
    Cnn(cnn::Cnn),
}

/// Buffers reused across samples, for either model.
#[derive(Default)]
pub struct Workspace {
    mlp: mlp::Workspace,
    cnn: cnn::Workspace,
}

impl Net {
    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        match self {
            Net::Mlp(m) => m.num_params(),
            Net::Cnn(c) => c.num_params(),
        }
    }

    /// The shapes of the tensors in the flat parameter vector, in order (what PowerSGD factorises one by
    /// one).
    pub fn layer_shapes(&self) -> Vec<Vec<usize>> {
        match self {
            Net::Mlp(m) => m.layer_shapes(),
            Net::Cnn(c) => c.shapes(),
        }
    }

    /// Initial parameters, a pure function of `seed`.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        match self {
            Net::Mlp(m) => m.init(seed, 1.0),
            Net::Cnn(c) => c.init(seed, 1.0),
        }
    }

    /// Adds `scale ·` the gradient of the summed loss to `grad`; returns the summed loss.
    pub fn loss_and_grad(
        &self,
        params: &[f32],
        xs: &[f32],
        ys: &[u32],
        scale: f32,
        grad: &mut [f32],
        ws: &mut Workspace,
    ) -> f64 {
        match self {
            Net::Mlp(m) => m.loss_and_grad(params, xs, ys, scale, grad, &mut ws.mlp),
            Net::Cnn(c) => c.loss_and_grad(params, xs, ys, scale, grad, &mut ws.cnn),
        }
    }

    /// Summed loss and correct predictions.
    pub fn evaluate(
        &self,
        params: &[f32],
        xs: &[f32],
        ys: &[u32],
        ws: &mut Workspace,
    ) -> (f64, usize) {
        match self {
            Net::Mlp(m) => m.evaluate(params, xs, ys, &mut ws.mlp),
            Net::Cnn(c) => c.evaluate(params, xs, ys, &mut ws.cnn),
        }
    }
}

impl std::fmt::Display for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Net::Mlp(m) => write!(f, "MLP {:?}", m.sizes()),
            Net::Cnn(c) => write!(f, "CNN {:?}", c.shapes()),
        }
    }
}
