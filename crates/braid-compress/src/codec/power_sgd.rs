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
//!
//! # Per-layer factorisation
//!
//! A flat bucket of several layers is better compressed layer by layer, as PyTorch's hook does: with a
//! [`Layout`], each tensor of shape `(d0, d1, …)` is its own `d0 × (d1·…)` matrix factorised at rank
//! `r = min(rank, rows, cols)`, while 1-D tensors and matrices that would not shrink
//! (`r·(rows + cols) ≥ rows·cols`) are sent as they are. A [`Plan`] says which element runs are
//! factorised and where each layer's factors sit in one concatenated `P` buffer and one concatenated `Q`
//! buffer, so the collective still makes two all-reduces (P with the dense parts, then Q), whatever the
//! number of layers. Without a layout the plan is today's single matrix of [`matrix_shape`].

use std::ops::Range;

use super::{Codec, Transport};
use crate::layout::Layout;
use crate::rng::{Stream, TAG_POWER_SGD};
use crate::wire::{Payload, Piece};
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
    let mut q = vec![0.0; cols * rank];
    initial_q_into(&Stream::new(seed, TAG_POWER_SGD, step), 0, rank, &mut q);
    q
}

/// Fills `q` (`cols × rank`) with the stream's normals from index `first` on, then orthogonalises it.
fn initial_q_into(s: &Stream, first: usize, rank: usize, q: &mut [f32]) {
    for (i, x) in q.iter_mut().enumerate() {
        *x = s.normal_at((first + i) as u64);
    }
    orthogonalize(q, rank, 0.0);
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

/// The `(cols, rank)` of each block of a concatenated Q.
type QShape = Vec<(usize, usize)>;

/// What PowerSGD does with one run of a tensor's elements (see [`Plan`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    /// Sent as they are: 1-D tensors, and matrices that factorising would not shrink. Adjacent ones are
    /// one segment. `at` is where the run starts in the plan's dense buffer.
    Dense {
        /// The elements, in the tensor.
        range: Range<usize>,
        /// Offset in the concatenated dense values.
        at: usize,
    },
    /// A `rows × cols` row-major matrix factorised at `rank`; its `P` (`rows × rank`) starts at `p_at` in
    /// the concatenated P buffer and its `Q` (`cols × rank`) at `q_at` in the concatenated Q buffer. Only
    /// the single-matrix view pads (its last row may be short); a layer's matrix is exactly `rows · cols`.
    Matrix {
        /// The elements, in the tensor.
        range: Range<usize>,
        /// Rows of the view.
        rows: usize,
        /// Columns of the view.
        cols: usize,
        /// Rank of the factorisation, at most `min(rows, cols)`.
        rank: usize,
        /// Offset of this matrix's P in the concatenated P buffer.
        p_at: usize,
        /// Offset of this matrix's Q in the concatenated Q buffer.
        q_at: usize,
    },
}

/// How PowerSGD of a given rank treats a tensor of [`len`](Plan::len) elements: its [`segments`](Plan::segments)
/// in order, and the sizes of the three buffers a step works on, the concatenated `P` factors
/// ([`p_len`](Plan::p_len)), `Q` factors ([`q_len`](Plan::q_len)) and dense values
/// ([`dense_len`](Plan::dense_len)). The methods apply the module's steps to every matrix at once; a
/// collective sums `[P | dense]` in one all-reduce and `Q` in another.
///
/// The compressed form ([`compressed`](Plan::compressed)) is [`Payload::LowRank`] for the single-matrix
/// plan, as before layouts existed, and [`Payload::Layered`] for a layout's plan.
///
/// ```
/// use braid_compress::power_sgd::{Plan, Segment};
/// use braid_compress::Layout;
/// // Weight [64, 32] factorised at rank 4 (4·96 < 2048), bias [64], weight [2, 64] too small to gain.
/// let layout = Layout::new([vec![64, 32], vec![64], vec![2, 64]], 2048 + 64 + 128).unwrap();
/// let plan = Plan::layered(&layout, 4);
/// assert_eq!((plan.p_len(), plan.q_len(), plan.dense_len()), (64 * 4, 32 * 4, 64 + 128));
/// assert!(matches!(plan.segments()[1], Segment::Dense { at: 0, .. }));
/// assert_eq!(plan.segments().len(), 2, "the bias and the small weight are one dense run");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    len: usize,
    layered: bool,
    segments: Vec<Segment>,
    p_len: usize,
    q_len: usize,
    dense_len: usize,
}

/// Whether a `rows × cols` matrix shrinks when factorised at `rank`: `rank·(rows + cols) < rows·cols`.
pub fn worth_factorising(rows: usize, cols: usize, rank: usize) -> bool {
    (rank as u128) * (rows as u128 + cols as u128) < rows as u128 * cols as u128
}

impl Plan {
    /// The single-matrix view of `len` elements, [`matrix_shape`]`(len, cols, rank)`; an error if that
    /// view has more than `u32::MAX` rows or columns.
    pub fn single(len: usize, cols: Option<usize>, rank: usize) -> Result<Self> {
        let (rows, cols, rank) = matrix_shape(len, cols, rank);
        if rows > u32::MAX as usize || cols > u32::MAX as usize {
            return Err(Error::InvalidParameter(format!(
                "PowerSGD: a {rows} × {cols} matrix view does not fit u32 dimensions"
            )));
        }
        Ok(Plan {
            len,
            layered: false,
            segments: vec![Segment::Matrix {
                range: 0..len,
                rows,
                cols,
                rank,
                p_at: 0,
                q_at: 0,
            }],
            p_len: rows * rank,
            q_len: cols * rank,
            dense_len: 0,
        })
    }

    /// One matrix per tensor of `layout` of two or more dimensions, factorised at
    /// `r = min(rank, rows, cols)` when [`worth_factorising`]; every other tensor dense.
    pub fn layered(layout: &Layout, rank: usize) -> Self {
        let mut plan = Plan {
            len: layout.len(),
            layered: true,
            segments: Vec::new(),
            p_len: 0,
            q_len: 0,
            dense_len: 0,
        };
        for (range, view) in layout.views() {
            match view.map(|(rows, cols)| (rows, cols, rank.min(rows).min(cols))) {
                Some((rows, cols, r)) if worth_factorising(rows, cols, r) => {
                    plan.segments.push(Segment::Matrix {
                        range,
                        rows,
                        cols,
                        rank: r,
                        p_at: plan.p_len,
                        q_at: plan.q_len,
                    });
                    plan.p_len += rows * r;
                    plan.q_len += cols * r;
                }
                _ => {
                    plan.dense_len += range.len();
                    match plan.segments.last_mut() {
                        Some(Segment::Dense { range: last, .. }) => last.end = range.end,
                        _ => plan.segments.push(Segment::Dense {
                            at: plan.dense_len - range.len(),
                            range,
                        }),
                    }
                }
            }
        }
        plan
    }

    /// Number of elements of the tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this is a layout's plan (rather than the single-matrix view).
    pub fn is_layered(&self) -> bool {
        self.layered
    }

    /// The segments, in element order; together they cover `0..len`.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Elements of the concatenated P factors.
    pub fn p_len(&self) -> usize {
        self.p_len
    }

    /// Elements of the concatenated Q factors.
    pub fn q_len(&self) -> usize {
        self.q_len
    }

    /// Elements sent as they are.
    pub fn dense_len(&self) -> usize {
        self.dense_len
    }

    fn matrices(&self) -> impl Iterator<Item = (Range<usize>, usize, usize, usize, usize)> + '_ {
        self.segments.iter().filter_map(|s| match s {
            Segment::Matrix {
                range,
                cols,
                rank,
                p_at,
                q_at,
                ..
            } => Some((range.clone(), *cols, *rank, *p_at, *q_at)),
            Segment::Dense { .. } => None,
        })
    }

    /// The `(cols, rank)` of each block of the concatenated Q: what a warm-started Q must match.
    fn q_shape(&self) -> QShape {
        self.matrices().map(|(_, c, r, _, _)| (c, r)).collect()
    }

    fn check(&self, what: &'static str, expected: usize, got: usize) -> Result<()> {
        if expected == got {
            Ok(())
        } else {
            Err(Error::LengthMismatch {
                what,
                expected,
                got,
            })
        }
    }

    /// The initial concatenated Q: matrix `l`'s entry `j·rank + c` is
    /// `Stream::new(seed, TAG_POWER_SGD, step).normal_at(q_at + j·rank + c)` (one stream, consecutive
    /// blocks, so no two layers start alike), each block then [`orthogonalize`]d with epsilon 0. For the
    /// single-matrix plan this is [`initial_q`].
    pub fn initial_q(&self, seed: u64, step: u64) -> Vec<f32> {
        let s = Stream::new(seed, TAG_POWER_SGD, step);
        let mut q = vec![0.0; self.q_len];
        for (_, cols, rank, _, q_at) in self.matrices() {
            initial_q_into(&s, q_at, rank, &mut q[q_at..q_at + cols * rank]);
        }
        q
    }

    /// `P = M·Q` for every matrix ([`multiply`]): `m` is the tensor, `q` and `p` the concatenated factors.
    pub fn multiply(&self, m: &[f32], q: &[f32], p: &mut [f32]) -> Result<()> {
        self.check("PowerSGD tensor", self.len, m.len())?;
        self.check("PowerSGD Q", self.q_len, q.len())?;
        self.check("PowerSGD P", self.p_len, p.len())?;
        for (range, cols, rank, p_at, q_at) in self.matrices() {
            let rows = range.len().div_ceil(cols);
            multiply(
                &m[range],
                cols,
                &q[q_at..q_at + cols * rank],
                rank,
                &mut p[p_at..p_at + rows * rank],
            );
        }
        Ok(())
    }

    /// Orthonormalises the columns of every matrix's P in the concatenated `p` ([`orthogonalize`]).
    pub fn orthogonalize(&self, p: &mut [f32], epsilon: f32) -> Result<()> {
        self.check("PowerSGD P", self.p_len, p.len())?;
        for (range, cols, rank, p_at, _) in self.matrices() {
            let rows = range.len().div_ceil(cols);
            orthogonalize(&mut p[p_at..p_at + rows * rank], rank, epsilon);
        }
        Ok(())
    }

    /// `Q = Mᵀ·P` for every matrix ([`multiply_transposed`]).
    pub fn multiply_transposed(&self, m: &[f32], p: &[f32], q: &mut [f32]) -> Result<()> {
        self.check("PowerSGD tensor", self.len, m.len())?;
        self.check("PowerSGD P", self.p_len, p.len())?;
        self.check("PowerSGD Q", self.q_len, q.len())?;
        for (range, cols, rank, p_at, q_at) in self.matrices() {
            let rows = range.len().div_ceil(cols);
            multiply_transposed(
                &m[range],
                cols,
                &p[p_at..p_at + rows * rank],
                rank,
                &mut q[q_at..q_at + cols * rank],
            );
        }
        Ok(())
    }

    /// Copies the dense segments of `m`, in order, into `out` (`dense_len` elements).
    pub fn dense(&self, m: &[f32], out: &mut [f32]) -> Result<()> {
        self.check("PowerSGD tensor", self.len, m.len())?;
        self.check("PowerSGD dense values", self.dense_len, out.len())?;
        for s in &self.segments {
            if let Segment::Dense { range, at } = s {
                out[*at..*at + range.len()].copy_from_slice(&m[range.clone()]);
            }
        }
        Ok(())
    }

    /// The compressed tensor of the factors `p`, `q` and the dense values `dense`: each matrix is
    /// `P·Qᵀ`, each dense segment its values. An error if a buffer has the wrong size.
    pub fn compressed(&self, p: &[f32], q: &[f32], dense: &[f32]) -> Result<Compressed> {
        self.check("PowerSGD P", self.p_len, p.len())?;
        self.check("PowerSGD Q", self.q_len, q.len())?;
        self.check("PowerSGD dense values", self.dense_len, dense.len())?;
        Compressed::new(self.len, self.payload(p, q, dense))
    }

    /// [`compressed`](Self::compressed)'s payload, for buffers of the right sizes.
    fn payload(&self, p: &[f32], q: &[f32], dense: &[f32]) -> Payload {
        let low_rank = |rows: usize, cols: usize, rank: usize, p_at: usize, q_at: usize| {
            (
                rows as u32,
                cols as u32,
                rank as u32,
                p[p_at..p_at + rows * rank].to_vec(),
                q[q_at..q_at + cols * rank].to_vec(),
            )
        };
        if !self.layered {
            if let [Segment::Matrix {
                rows,
                cols,
                rank,
                p_at,
                q_at,
                ..
            }] = self.segments[..]
            {
                let (rows, cols, rank, p, q) = low_rank(rows, cols, rank, p_at, q_at);
                return Payload::LowRank {
                    rows,
                    cols,
                    rank,
                    p,
                    q,
                };
            }
        }
        Payload::Layered(
            self.segments
                .iter()
                .map(|s| match *s {
                    Segment::Dense { ref range, at } => {
                        Piece::Dense(dense[at..at + range.len()].to_vec())
                    }
                    Segment::Matrix {
                        rows,
                        cols,
                        rank,
                        p_at,
                        q_at,
                        ..
                    } => {
                        let (rows, cols, rank, p, q) = low_rank(rows, cols, rank, p_at, q_at);
                        Piece::LowRank {
                            rows,
                            cols,
                            rank,
                            p,
                            q,
                        }
                    }
                })
                .collect(),
        )
    }
}

/// PowerSGD of rank `r` on one rank: the four steps of the [module documentation](self), producing a
/// [`Payload::LowRank`] with the orthonormal `P` and `Q = Mᵀ·P`, or, with a [layout](PowerSgd::with_layout),
/// a [`Payload::Layered`] with one such pair per factorised layer and the other layers as they are.
///
/// With warm start (the default, as PyTorch) the `Q` computed at one step is the starting `Q` of the next,
/// as long as the matrix shapes stay the same; the first step, a shape change or [`reset`](Codec::reset)
/// draws [`Plan::initial_q`]`(seed, step)`. Without warm start every step draws afresh.
///
/// A matrix `M = A·Σ·Bᵀ` of rank at most `r` is reproduced exactly in exact arithmetic. In f32, a step that
/// starts from a random `Q` loses accuracy in proportion to the conditioning of `Bᵀ·Q`, which a random `Q`
/// occasionally makes poor (relative errors up to ~10⁻³ were seen in one start out of several thousand);
/// warm-started steps start from `Q` in `M`'s row space and are exact to f32 rounding. The approximation is
/// a projection (`P·Pᵀ·M`), so its error never exceeds `‖M‖`.
///
/// [`compress`](Codec::compress) panics if the single-matrix view of the tensor does not fit u32
/// dimensions (more than `u32::MAX` rows: [`with_cols`](Self::with_cols) too small for the length); a
/// [layout](Self::with_layout) or [`plan`](Self::plan) avoids or detects that.
#[derive(Clone, Debug, PartialEq)]
pub struct PowerSgd {
    rank: usize,
    cols: Option<usize>,
    layout: Option<Layout>,
    seed: u64,
    warm_start: bool,
    epsilon: f32,
    /// The `(cols, rank)` of each block of the last Q, and the Q.
    warm_q: Option<(QShape, Vec<f32>)>,
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
            layout: None,
            seed,
            warm_start: true,
            epsilon: 0.0,
            warm_q: None,
        })
    }

    /// Views tensors as matrices with `cols` columns (for a weight of shape `[out, in]`, `in`). With a
    /// [layout](Self::with_layout), only tensors of another length than the layout's use this view.
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

    /// Factorises each layer of `layout` as its own matrix ([`Plan::layered`]) when the tensor has the
    /// layout's length. A tensor of any other length is not the one the layout describes and gets the
    /// single-matrix view, as without a layout; [`plan`](Self::plan) says which a length gets.
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = Some(layout);
        self.warm_q = None;
        self
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

    /// The layout, if any.
    pub fn layout(&self) -> Option<&Layout> {
        self.layout.as_ref()
    }

    /// The single-matrix view `(rows, cols, rank)` this codec uses for `len` elements without a layout
    /// of that length.
    pub fn shape(&self, len: usize) -> (usize, usize, usize) {
        matrix_shape(len, self.cols, self.rank)
    }

    /// The plan for a tensor of `len` elements: the layout's if `len` is its length, else the
    /// single-matrix view (an error if that view does not fit u32 dimensions).
    pub fn plan(&self, len: usize) -> Result<Plan> {
        match &self.layout {
            Some(l) if l.len() == len => Ok(Plan::layered(l, self.rank)),
            _ => Plan::single(len, self.cols, self.rank),
        }
    }
}

impl Codec for PowerSgd {
    fn name(&self) -> String {
        let cols = self
            .cols
            .map_or_else(|| "auto".to_string(), |c| c.to_string());
        let layers = self
            .layout
            .as_ref()
            .map_or_else(String::new, |l| format!("layers={}, ", l.tensors()));
        let warm = if self.warm_start { "warm" } else { "cold" };
        format!(
            "power-sgd(rank={}, {layers}cols={cols}, {warm}, seed={})",
            self.rank, self.seed
        )
    }

    fn transport(&self) -> Transport {
        Transport::PowerIteration
    }

    fn compress(&mut self, grad: &[f32], step: u64) -> Compressed {
        let plan = match self.plan(grad.len()) {
            Ok(plan) => plan,
            Err(e) => panic!("{e}"),
        };
        let q = match self.warm_q.take() {
            Some((shape, q)) if self.warm_start && shape == plan.q_shape() => q,
            _ => plan.initial_q(self.seed, step),
        };
        let mut p = vec![0.0; plan.p_len()];
        let mut dense = vec![0.0; plan.dense_len()];
        let sized = "PowerSGD: the plan sizes its own buffers";
        plan.multiply(grad, &q, &mut p).expect(sized);
        plan.orthogonalize(&mut p, self.epsilon).expect(sized);
        let mut q = q;
        plan.multiply_transposed(grad, &p, &mut q).expect(sized);
        plan.dense(grad, &mut dense).expect(sized);
        let out = Compressed::new_unchecked(grad.len(), plan.payload(&p, &q, &dense));
        if self.warm_start {
            self.warm_q = Some((plan.q_shape(), q));
        }
        out
    }

    fn reset(&mut self) {
        self.warm_q = None;
    }
}
