//! The tensors a flat gradient bucket is made of, so that PowerSGD factorises each layer's gradient as
//! its own matrix rather than the whole bucket as one.
//!
//! A trainer hands a collective one flat buffer, but low-rank compression only means something for a
//! layer's gradient seen as a matrix: PyTorch's PowerSGD hook views a tensor of shape `(d0, d1, …)` as a
//! `d0 × (d1·…)` matrix and sends 1-D tensors (biases, norm scales) as they are. A [`Layout`] records the
//! shapes in bucket order and is checked once, against the bucket's length, when it is made; what PowerSGD
//! then does with each tensor is its [`Plan`](crate::power_sgd::Plan).

use std::fmt::Write as _;
use std::ops::Range;

use crate::{Error, Result};

/// The shapes of the tensors a flat buffer of [`len`](Layout::len) elements holds, in order: tensor `i`
/// occupies the elements after tensor `i − 1`, row-major. Every dimension is at least 1, the element
/// counts add up to the length, and each tensor of two or more dimensions, viewed as `d0 × (d1·…)`, has
/// rows and columns that fit u32 (the wire format's limit). A 0-D shape (`[]`, a scalar) is one element.
///
/// ```
/// use braid_compress::Layout;
/// // A linear layer 8 → 4 (weight [4, 8], bias [4]) and a norm scale [4].
/// let layout = Layout::new([vec![4, 8], vec![4], vec![4]], 40).unwrap();
/// let views: Vec<_> = layout.views().collect();
/// assert_eq!(views[0], (0..32, Some((4, 8))));
/// assert_eq!(views[1], (32..36, None));
/// let e = Layout::new([vec![4, 8], vec![4]], 40).unwrap_err();
/// assert!(e.to_string().contains("add up to 36 elements"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    shapes: Vec<Vec<usize>>,
    len: usize,
}

/// The most dimensions of a shape an error message repeats.
const SHOWN_DIMS: usize = 8;

/// `shape` for an error message, cut after [`SHOWN_DIMS`] dimensions.
fn show(shape: &[usize]) -> String {
    let mut s = String::from("[");
    for (i, d) in shape.iter().take(SHOWN_DIMS).enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{d}");
    }
    if shape.len() > SHOWN_DIMS {
        let _ = write!(s, ", … ({} dimensions)", shape.len());
    }
    s.push(']');
    s
}

impl Layout {
    /// Checks `shapes` against a buffer of `len` elements. An error names the tensor (by its position)
    /// and what is wrong with it: a dimension of 0, more elements than `usize` holds, a matrix view with
    /// more than `u32::MAX` rows or columns, more than `u32::MAX` tensors, or element counts that do not
    /// add up to `len`.
    pub fn new<I, S>(shapes: I, len: usize) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<[usize]>,
    {
        let bad = |why: String| Err(Error::InvalidParameter(format!("layer shapes: {why}")));
        let mut out = Vec::new();
        let mut total = 0usize;
        for (i, shape) in shapes.into_iter().enumerate() {
            let shape = shape.as_ref();
            if i >= u32::MAX as usize {
                return bad(format!("more than {} tensors", u32::MAX));
            }
            if let Some(d) = shape.iter().position(|&d| d == 0) {
                return bad(format!(
                    "tensor {i} has shape {}: dimension {d} is 0 (leave empty tensors out)",
                    show(shape)
                ));
            }
            let Some(n) = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) else {
                return bad(format!(
                    "tensor {i} has shape {}: its element count overflows usize",
                    show(shape)
                ));
            };
            if let [rows, ..] = *shape {
                let cols = n / rows;
                if shape.len() >= 2 && (rows > u32::MAX as usize || cols > u32::MAX as usize) {
                    return bad(format!(
                        "tensor {i} has shape {}: its {rows} × {cols} matrix view does not fit u32 \
                         dimensions",
                        show(shape)
                    ));
                }
            }
            let Some(t) = total.checked_add(n) else {
                return bad(format!(
                    "the element counts up to tensor {i} ({}) overflow usize",
                    show(shape)
                ));
            };
            total = t;
            out.push(shape.to_vec());
        }
        if total != len {
            return bad(format!(
                "the {} tensors' shapes add up to {total} elements, but the buffer has {len}",
                out.len()
            ));
        }
        Ok(Layout { shapes: out, len })
    }

    /// The shapes, in buffer order.
    pub fn shapes(&self) -> &[Vec<usize>] {
        &self.shapes
    }

    /// Number of elements of the buffer (the sum of the tensors' element counts).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements (no tensors).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of tensors.
    pub fn tensors(&self) -> usize {
        self.shapes.len()
    }

    /// Per tensor, in order: its element range in the buffer, and its matrix view `(rows, cols) = (d0,
    /// d1·…)` if it has two or more dimensions (`None` for 0-D and 1-D tensors).
    pub fn views(&self) -> impl Iterator<Item = (Range<usize>, Option<(usize, usize)>)> + '_ {
        let mut at = 0;
        self.shapes.iter().map(move |s| {
            let n: usize = s.iter().product();
            let range = at..at + n;
            at += n;
            let matrix = (s.len() >= 2).then(|| (s[0], n / s[0]));
            (range, matrix)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn why(shapes: &[&[usize]], len: usize) -> String {
        Layout::new(shapes, len).unwrap_err().to_string()
    }

    #[test]
    fn each_problem_is_named() {
        let m = why(&[&[3, 4], &[4, 0, 2]], 12);
        assert!(
            m.contains("tensor 1 has shape [4, 0, 2]: dimension 1 is 0"),
            "{m}"
        );
        let m = why(&[&[usize::MAX, 2]], 0);
        assert!(
            m.contains("tensor 0") && m.contains("overflows usize"),
            "{m}"
        );
        let big = u32::MAX as usize + 1;
        let m = why(&[&[2, 2], &[big, 2]], 4 + 2 * big);
        assert!(
            m.contains("tensor 1") && m.contains("does not fit u32"),
            "{m}"
        );
        let m = why(&[&[2, big]], 2 * big);
        assert!(m.contains(&format!("2 × {big}")), "{m}");
        let m = why(&[&[usize::MAX], &[1]], 0);
        assert!(
            m.contains("up to tensor 1") && m.contains("overflow"),
            "{m}"
        );
        let m = why(&[&[3, 4], &[4]], 17);
        assert!(
            m.contains("the 2 tensors' shapes add up to 16 elements, but the buffer has 17"),
            "{m}"
        );
        assert!(m.starts_with("invalid parameter: layer shapes:"), "{m}");
        let long: Vec<usize> = (0..40).map(|i| if i == 30 { 0 } else { 1 }).collect();
        let m = why(&[&long], 1);
        assert!(
            m.contains("… (40 dimensions)]: dimension 30 is 0") && m.len() < 200,
            "{m}"
        );
    }

    #[test]
    fn views_follow_the_shapes() {
        // A 1-D tensor stays 1-D even with huge length; a scalar is one element.
        let big = u32::MAX as usize + 7;
        let l = Layout::new(
            [vec![2, 3, 4], vec![], vec![big], vec![5, 1]],
            24 + 1 + big + 5,
        )
        .unwrap();
        let v: Vec<_> = l.views().collect();
        assert_eq!(
            v,
            [
                (0..24, Some((2, 12))),
                (24..25, None),
                (25..25 + big, None),
                (25 + big..30 + big, Some((5, 1)))
            ]
        );
        assert_eq!((l.tensors(), l.len(), l.is_empty()), (4, 30 + big, false));
        assert_eq!(l.shapes()[0], [2, 3, 4]);
        let empty = Layout::new(Vec::<Vec<usize>>::new(), 0).unwrap();
        assert!(empty.is_empty() && empty.views().next().is_none());
    }
}
