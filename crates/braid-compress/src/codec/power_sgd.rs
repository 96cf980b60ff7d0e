//! PowerSGD: rank-`r` approximation by one step of subspace iteration, as PyTorch's `powerSGD_hook`.
//!
//! The tensor of `len` elements is viewed as a `rows × cols` row-major matrix `M`, zero-padded to
//! `rows · cols` (`rows = ⌈len / cols⌉`). With `Q` (`cols × r`) from the previous step (warm start) or
//! freshly drawn:
//!
//! 1. `P = M·Q` ([`multiply`]);
//! 2. orthonormalise the columns of `P` ([`orthogonalize`], modified Gram–Schmidt);
//! 3. `Q = Mᵀ·P` ([`multiply_transposed`]);
//! 4. the approximation is `P·Qᵀ`.
//!
//! In a collective the phases are interleaved with two all-reduces: every rank computes `P` from its own
//! gradient, `P` is all-reduced (summed), every rank orthogonalises the same sum, computes `Q` from its own
//! gradient, and `Q` is all-reduced. Both all-reduces are sums, so the functions here are also the reference
//! for that protocol. The [`PowerSgd`] codec runs all four steps on one rank.
//!
//! All matrices are row-major f32. Products accumulate in f32 in ascending order of the summed index;
//! [`orthogonalize`] accumulates its dot products and norms in f64. GPU implementations will differ in
//! summation order and agree within a tolerance, not bit for bit.

use super::{Codec, Transport};
use crate::rng::{Stream, TAG_POWER_SGD};
use crate::wire::Payload;
use crate::{Compressed, Error, Result};

/// The matrix view `(rows, cols, rank)` of a tensor of `len` elements: `cols` is the given number of
/// columns (clamped to `len`), or `⌈√len⌉` when `None`; `rows = ⌈len / cols⌉`; the rank is clamped to
/// `min(rows, cols)`. An empty tensor is `(0, 1, 0)`.
pub fn matrix_shape(len: usize, cols: Option<usize>, rank: usize) -> (usize, usize, usize) {
    if len == 0 {
        return (0, 1, 0);
    }
    let cols = match cols {
        Some(c) => c.clamp(1, len),
        None => {
            let s = len.isqrt();
            if s * s < len {
                s + 1
            } else {
                s
            }
        }
    };
    let rows = len.div_ceil(cols);
    (rows, cols, rank.min(rows).min(cols))
}

/// The initial `Q` (`cols × rank`, row-major): entry `j·rank + c` is
/// `Stream::new(seed, TAG_POWER_SGD, step).normal_at(j·rank + c)`, then [`orthogonalize`]d with epsilon 0.
/// Every rank with the same seed and step starts from the same `Q`.
pub fn initial_q(seed: u64, step: u64, cols: usize, rank: usize) -> Vec<f32> {
    let s = Stream::new(seed, TAG_POWER_SGD, step);
    let mut q: Vec<f32> = (0..(cols * rank) as u64).map(|i| s.normal_at(i)).collect();
    orthogonalize(&mut q, rank, 0.0);
    q
}

/// `P = M·Q`: `p[i·rank + c] = Σ_j m[i·cols + j]·q[j·rank + c]` over the elements of row `i` that exist
/// (`i·cols + j < m.len()`), in f32, `j` ascending. `p` has `⌈m.len()/cols⌉ · rank` elements, `q` has
/// `cols · rank`.
///
/// # Panics
///
/// If `cols == 0` or a buffer has the wrong size.
pub fn multiply(m: &[f32], cols: usize, q: &[f32], rank: usize, p: &mut [f32]) {
    assert!(cols > 0, "PowerSGD: cols must be at least 1");
    assert_eq!(
        q.len(),
        cols * rank,
        "PowerSGD: Q must have cols·rank elements"
    );
    assert_eq!(
        p.len(),
        m.len().div_ceil(cols) * rank,
        "PowerSGD: P must have rows·rank elements"
    );
    if rank == 0 {
        return;
    }
    for (row, pi) in m.chunks(cols).zip(p.chunks_exact_mut(rank)) {
        pi.fill(0.0);
        for (&x, qj) in row.iter().zip(q.chunks_exact(rank)) {
            for (a, &b) in pi.iter_mut().zip(qj) {
                *a += x * b;
            }
        }
    }
}

/// `Q = Mᵀ·P`: `q[j·rank + c] = Σ_i m[i·cols + j]·p[i·rank + c]` over the rows where the element exists,
/// in f32, `i` ascending. Sizes as in [`multiply`].
///
/// # Panics
///
/// If `cols == 0` or a buffer has the wrong size.
pub fn multiply_transposed(m: &[f32], cols: usize, p: &[f32], rank: usize, q: &mut [f32]) {
    assert!(cols > 0, "PowerSGD: cols must be at least 1");
    assert_eq!(
        q.len(),
        cols * rank,
        "PowerSGD: Q must have cols·rank elements"
    );
    assert_eq!(
        p.len(),
        m.len().div_ceil(cols) * rank,
        "PowerSGD: P must have rows·rank elements"
    );
    q.fill(0.0);
    if rank == 0 {
        return;
    }
    for (row, pi) in m.chunks(cols).zip(p.chunks_exact(rank)) {
        for (&x, qj) in row.iter().zip(q.chunks_exact_mut(rank)) {
            for (a, &b) in qj.iter_mut().zip(pi) {
                *a += x * b;
            }
        }
    }
}

/// Orthonormalises the `rank` columns of the row-major `a` (`n × rank`) in place by modified Gram–Schmidt,
/// as PyTorch's `_orthogonalize_gram_schmidt`. For each column `c` in order: its norm `‖a_c‖` (f64 sum of
/// squares, square root, rounded to f32) is taken and the column divided by `‖a_c‖ + epsilon`, or set to
/// zero if that is 0 (PyTorch would produce NaN); then every later column `d` loses its projection,
/// `a_d −= (a_c·a_d)·a_c` (the dot product summed in f64 and rounded to f32).
///
/// # Panics
///
/// If `a.len()` is not a multiple of `rank` (for `rank > 0`).
pub fn orthogonalize(a: &mut [f32], rank: usize, epsilon: f32) {
    if rank == 0 {
        return;
    }
    assert_eq!(
        a.len() % rank,
        0,
        "PowerSGD: matrix size must be a multiple of the rank"
    );
    for c in 0..rank {
        let norm = (a
            .chunks_exact(rank)
            .map(|r| (r[c] as f64) * (r[c] as f64))
            .sum::<f64>()
            .sqrt()) as f32;
        let d = norm + epsilon;
        for r in a.chunks_exact_mut(rank) {
            r[c] = if d == 0.0 { 0.0 } else { r[c] / d };
        }
        for e in c + 1..rank {
            let dot = a
                .chunks_exact(rank)
                .map(|r| r[c] as f64 * r[e] as f64)
                .sum::<f64>() as f32;
            for r in a.chunks_exact_mut(rank) {
                r[e] -= dot * r[c];
            }
        }
    }
}

/// PowerSGD of rank `r` on one rank: the four steps of the [module documentation](self), producing a
/// [`Payload::LowRank`] with the orthonormal `P` and `Q = Mᵀ·P`.
///
/// With warm start (the default, as PyTorch) the `Q` computed at one step is the starting `Q` of the next,
/// as long as the matrix shape stays the same; the first step, a shape change or [`reset`](Codec::reset)
/// draws [`initial_q`]`(seed, step, …)`. Without warm start every step draws afresh.
///
/// A matrix `M = A·Σ·Bᵀ` of rank at most `r` is reproduced exactly in exact arithmetic. In f32, a step that
/// starts from a random `Q` loses accuracy in proportion to the conditioning of `Bᵀ·Q`, which a random `Q`
/// occasionally makes poor (relative errors up to ~10⁻³ were seen in one start out of several thousand);
/// warm-started steps start from `Q` in `M`'s row space and are exact to f32 rounding. The approximation is
/// a projection (`P·Pᵀ·M`), so its error never exceeds `‖M‖`.
#[derive(Clone, Debug, PartialEq)]
pub struct PowerSgd {
    rank: usize,
    cols: Option<usize>,
    seed: u64,
    warm_start: bool,
    epsilon: f32,
    warm_q: Option<(usize, usize, Vec<f32>)>,
}

impl PowerSgd {
    /// Rank-`rank` PowerSGD (`rank ≥ 1`), square-ish matrix view, warm start, orthogonalisation epsilon 0,
    /// initial `Q` drawn from `seed` (which must be the same on every rank).
    pub fn new(rank: usize, seed: u64) -> Result<Self> {
        if rank == 0 || rank > u32::MAX as usize {
            return Err(Error::InvalidParameter(format!(
                "PowerSGD rank must be in 1..={}, got {rank}",
                u32::MAX
            )));
        }
        Ok(PowerSgd {
            rank,
            cols: None,
            seed,
            warm_start: true,
            epsilon: 0.0,
            warm_q: None,
        })
    }

    /// Views tensors as matrices with `cols` columns (for a weight of shape `[out, in]`, `in`).
    pub fn with_cols(mut self, cols: usize) -> Result<Self> {
        if cols == 0 || cols > u32::MAX as usize {
            return Err(Error::InvalidParameter(format!(
                "PowerSGD cols must be in 1..={}, got {cols}",
                u32::MAX
            )));
        }
        self.cols = Some(cols);
        self.warm_q = None;
        Ok(self)
    }

    /// Draws a fresh `Q` at every step instead of reusing the last one.
    pub fn without_warm_start(mut self) -> Self {
        self.warm_start = false;
        self.warm_q = None;
        self
    }

    /// Adds `epsilon ≥ 0` to each norm in [`orthogonalize`] (PyTorch's `orthogonalization_epsilon`).
    pub fn with_epsilon(mut self, epsilon: f32) -> Result<Self> {
        if !(epsilon >= 0.0 && epsilon.is_finite()) {
            return Err(Error::InvalidParameter(format!(
                "PowerSGD epsilon must be finite and ≥ 0, got {epsilon}"
            )));
        }
        self.epsilon = epsilon;
        Ok(self)
    }

    /// The configured rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The matrix view `(rows, cols, rank)` this codec uses for `len` elements.
    pub fn shape(&self, len: usize) -> (usize, usize, usize) {
        matrix_shape(len, self.cols, self.rank)
    }
}

impl Codec for PowerSgd {
    fn name(&self) -> String {
        let cols = self
            .cols
            .map_or_else(|| "auto".to_string(), |c| c.to_string());
        let warm = if self.warm_start { "warm" } else { "cold" };
        format!(
            "power-sgd(rank={}, cols={cols}, {warm}, seed={})",
            self.rank, self.seed
        )
    }

    fn transport(&self) -> Transport {
        Transport::PowerIteration
    }

    fn compress(&mut self, grad: &[f32], step: u64) -> Compressed {
        let (rows, cols, rank) = self.shape(grad.len());
        assert!(
            rows <= u32::MAX as usize && cols <= u32::MAX as usize,
            "PowerSGD: a {rows} × {cols} matrix view does not fit u32 dimensions"
        );
        let q = match self.warm_q.take() {
            Some((c, r, q)) if self.warm_start && (c, r) == (cols, rank) => q,
            _ => initial_q(self.seed, step, cols, rank),
        };
        let mut p = vec![0.0; rows * rank];
        multiply(grad, cols, &q, rank, &mut p);
        orthogonalize(&mut p, rank, self.epsilon);
        let mut q = q;
        multiply_transposed(grad, cols, &p, rank, &mut q);
        if self.warm_start {
            self.warm_q = Some((cols, rank, q.clone()));
        }
        Compressed::new_unchecked(
            grad.len(),
            Payload::LowRank {
                rows: rows as u32,
                cols: cols as u32,
                rank: rank as u32,
                p,
                q,
            },
        )
    }

    fn reset(&mut self) {
        self.warm_q = None;
    }
}
