//! CPU reduce kernels over raw byte buffers.
//!
//! Buffers are `&[u8]` because they come from users (any alignment) and from shared-memory slots. Every
//! kernel takes a fast path when all buffers are aligned for their element type (typed slices, loops the
//! compiler vectorises, no per-element dispatch: the reduction is a monomorphised closure) and otherwise
//! goes through small aligned blocks on the stack; [`reduce_ordered`] of at most 16 elements (the
//! latency path) reads each element unaligned instead.
//!
//! Partial results live in the accumulator type ([`DType::accumulator`]): f16 and bf16 partials are f32 and
//! are rounded once, when the result is finalised. Integer arithmetic wraps. `avg` sums and then divides by
//! the number of contributions in the accumulator type (integer division for integer types).
//!
//! NaNs: a NaN that a sum, product or average makes, and a NaN widened from f16 or bf16, is the canonical
//! NaN ([`CANONICAL_NAN_F32`], `0x7fff` once rounded to f16 or bf16, and [`CANONICAL_NAN_F64`]), whatever
//! NaN went in: that is what a GPU's arithmetic and conversions return, whereas a CPU keeps one
//! operand's payload, and which one depends on how the compiler ordered the operands. So every rank, CPU
//! or GPU, gets the same bits. Max and min keep an f32 or f64 NaN's sign and payload.
//!
//! The pipeline of a chain of ranks is `to_acc` (first contribution), `combine` (each further one) and
//! `finalize` (the last one, which also rounds and divides). [`reduce_ordered`] does the same for inputs
//! that are all at hand. Both orders are fixed, so every rank that runs them gets bit-identical results.

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};

use crate::{DType, ReduceOp};

/// A source operand: a buffer, or the destination's current contents (for in-place operation).
#[derive(Clone, Copy, Debug)]
pub enum Src<'a> {
    /// Read from this buffer.
    Buf(&'a [u8]),
    /// Read the destination before it is overwritten.
    Dst,
}

const BLOCK: usize = 512;

/// Arithmetic of an accumulator type.
trait Acc: Pod + PartialOrd {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
    fn band(self, o: Self) -> Self;
    fn bor(self, o: Self) -> Self;
    fn bxor(self, o: Self) -> Self;
}

/// A stored element type and its accumulator.
trait Elem: Pod {
    type A: Acc;
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
}

macro_rules! int_acc {
    ($($t:ty),*) => {$(
        impl Acc for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)] fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            #[inline(always)] fn min(self, o: Self) -> Self { Ord::min(self, o) }
            #[inline(always)] fn max(self, o: Self) -> Self { Ord::max(self, o) }
            #[inline(always)] fn div_n(self, n: usize) -> Self { (self as i128 / n as i128) as $t }
            #[inline(always)] fn band(self, o: Self) -> Self { self & o }
            #[inline(always)] fn bor(self, o: Self) -> Self { self | o }
            #[inline(always)] fn bxor(self, o: Self) -> Self { self ^ o }
        }
        impl Elem for $t {
            type A = $t;
            #[inline(always)] fn load(self) -> $t { self }
            #[inline(always)] fn store(a: $t) -> $t { a }
        }
    )*};
}
int_acc!(i8, u8, i32, u32, i64, u64);

/// The NaN an f32 sum, product or average comes out as: what a GPU's arithmetic returns.
pub const CANONICAL_NAN_F32: u32 = 0x7fff_ffff;
/// The NaN an f64 sum, product or average comes out as.
pub const CANONICAL_NAN_F64: u64 = 0x7fff_ffff_ffff_ffff;

/// `r`, or the canonical NaN when `r` is a NaN (a select the compiler vectorises).
trait Canonical: Copy {
    fn canonical(self) -> Self;
}
impl Canonical for f32 {
    #[inline(always)]
    fn canonical(self) -> f32 {
        if self.is_nan() {
            f32::from_bits(CANONICAL_NAN_F32)
        } else {
            self
        }
    }
}
impl Canonical for f64 {
    #[inline(always)]
    fn canonical(self) -> f64 {
        if self.is_nan() {
            f64::from_bits(CANONICAL_NAN_F64)
        } else {
            self
        }
    }
}

macro_rules! float_acc {
    ($($t:ty),*) => {$(
        impl Acc for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { (self + o).canonical() }
            #[inline(always)] fn mul(self, o: Self) -> Self { (self * o).canonical() }
            #[inline(always)] fn min(self, o: Self) -> Self { if o < self { o } else { self } }
            #[inline(always)] fn max(self, o: Self) -> Self { if o > self { o } else { self } }
            #[inline(always)] fn div_n(self, n: usize) -> Self { (self / n as $t).canonical() }
            // Never reached through a communicator (ReduceOp::check_dtype refuses bitwise reductions of
            // floats); defined on the bits so that the kernels stay total.
            #[inline(always)] fn band(self, o: Self) -> Self { <$t>::from_bits(self.to_bits() & o.to_bits()) }
            #[inline(always)] fn bor(self, o: Self) -> Self { <$t>::from_bits(self.to_bits() | o.to_bits()) }
            #[inline(always)] fn bxor(self, o: Self) -> Self { <$t>::from_bits(self.to_bits() ^ o.to_bits()) }
        }
        impl Elem for $t {
            type A = $t;
            #[inline(always)] fn load(self) -> $t { self }
            #[inline(always)] fn store(a: $t) -> $t { a }
        }
    )*};
}
float_acc!(f32, f64);

impl Elem for f16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32().canonical()
    }
    #[inline(always)]
    fn store(a: f32) -> f16 {
        if a.is_nan() {
            f16::from_bits(0x7fff)
        } else {
            f16::from_f32(a)
        }
    }
}

impl Elem for bf16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32().canonical()
    }
    #[inline(always)]
    fn store(a: f32) -> bf16 {
        if a.is_nan() {
            bf16::from_bits(0x7fff)
        } else {
            bf16::from_f32(a)
        }
    }
}

/// Runs `$body` with `$t` bound to the Rust type of `$dtype`.
macro_rules! with_type {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::I8 => {
                type $t = i8;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::U32 => {
                type $t = u32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::U64 => {
                type $t = u64;
                $body
            }
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                $body
            }
        }
    };
}

/// Runs `$body` with `$f` bound to the binary function of `$op` (avg combines as sum).
macro_rules! with_op {
    ($op:expr, $f:ident => $body:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                let $f = |a, b| Acc::add(a, b);
                $body
            }
            ReduceOp::Prod => {
                let $f = |a, b| Acc::mul(a, b);
                $body
            }
            ReduceOp::Min => {
                let $f = |a, b| Acc::min(a, b);
                $body
            }
            ReduceOp::Max => {
                let $f = |a, b| Acc::max(a, b);
                $body
            }
            ReduceOp::BitAnd => {
                let $f = |a, b| Acc::band(a, b);
                $body
            }
            ReduceOp::BitOr => {
                let $f = |a, b| Acc::bor(a, b);
                $body
            }
            ReduceOp::BitXor => {
                let $f = |a, b| Acc::bxor(a, b);
                $body
            }
        }
    };
}

/// Typed view of `bytes` when aligned, else a copy into `tmp`.
#[inline(always)]
fn view<'a, T: Pod>(bytes: &'a [u8], tmp: &'a mut [T; BLOCK]) -> &'a [T] {
    match bytemuck::try_cast_slice(bytes) {
        Ok(s) => s,
        Err(_) => {
            let t = &mut tmp[..bytes.len() / size_of::<T>()];
            bytemuck::cast_slice_mut(t).copy_from_slice(bytes);
            t
        }
    }
}

/// Applies `k(dst, a, b)` over whole buffers: directly when every buffer is aligned, else block by block
/// through aligned temporaries. `b` may be `None` (for one-input kernels).
///
/// Inlined into its caller in optimised builds only: unoptimised, every (dtype, op) instance of the
/// callers would otherwise keep its own copy of the temporaries in one frame, which outgrows a
/// thread's stack.
#[cfg_attr(debug_assertions, inline(never))]
#[cfg_attr(not(debug_assertions), inline(always))]
fn map<O: Pod, I: Pod, J: Pod>(
    dst: &mut [u8],
    a: &[u8],
    b: Option<&[u8]>,
    k: impl Fn(&mut [O], &[I], Option<&[J]>),
) {
    let n = dst.len() / size_of::<O>();
    assert_eq!(dst.len(), n * size_of::<O>(), "destination length");
    assert_eq!(a.len(), n * size_of::<I>(), "first operand length");
    if let Some(b) = b {
        assert_eq!(b.len(), n * size_of::<J>(), "second operand length");
    }
    if let (Ok(d), Ok(x)) = (
        bytemuck::try_cast_slice_mut::<u8, O>(dst),
        bytemuck::try_cast_slice::<u8, I>(a),
    ) {
        match b.map(bytemuck::try_cast_slice::<u8, J>) {
            None => return k(d, x, None),
            Some(Ok(y)) => return k(d, x, Some(y)),
            Some(Err(_)) => {}
        }
    }
    let (mut td, mut ta, mut tb) = (
        [O::zeroed(); BLOCK],
        [I::zeroed(); BLOCK],
        [J::zeroed(); BLOCK],
    );
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let x = view(
            &a[start * size_of::<I>()..(start + len) * size_of::<I>()],
            &mut ta,
        );
        let y = b.map(|b| &b[start * size_of::<J>()..(start + len) * size_of::<J>()]);
        let y = y.map(|y| view(y, &mut tb));
        let out = &mut dst[start * size_of::<O>()..(start + len) * size_of::<O>()];
        match bytemuck::try_cast_slice_mut::<u8, O>(out) {
            Ok(d) => k(d, x, y),
            Err(_) => {
                // Kernels may read the destination (in-place accumulation): load it first.
                bytemuck::cast_slice_mut(&mut td[..len]).copy_from_slice(out);
                k(&mut td[..len], x, y);
                out.copy_from_slice(bytemuck::cast_slice(&td[..len]));
            }
        }
        start += len;
    }
}

/// `dst = to_acc(src)`: the first contribution of a chain, in the accumulator type of `dtype`.
/// `dst` holds `src.len() / dtype.size()` accumulator elements.
pub fn to_acc(dtype: DType, dst: &mut [u8], src: &[u8]) {
    with_type!(dtype, T => map::<<T as Elem>::A, T, u8>(dst, src, None, |d, x, _| {
        for (d, x) in d.iter_mut().zip(x) {
            *d = x.load();
        }
    }))
}

/// `dst = partial op input`: a further contribution of a chain. `partial` and `dst` are in the
/// accumulator type, `input` in `dtype`.
pub fn combine(dtype: DType, op: ReduceOp, dst: &mut [u8], partial: &[u8], input: &[u8]) {
    with_type!(dtype, T => with_op!(op, f => map::<<T as Elem>::A, <T as Elem>::A, T>(dst, partial, Some(input), |d, p, x| {
        for ((d, p), x) in d.iter_mut().zip(p).zip(x.unwrap_or_default()) {
            *d = f(*p, x.load());
        }
    })))
}

/// `acc = acc op partial`, both in the accumulator type of `dtype`: merges a received partial into a
/// rank's running partial.
pub fn combine_acc(dtype: DType, op: ReduceOp, acc: &mut [u8], partial: &[u8]) {
    with_type!(dtype, T => with_op!(op, f => map::<<T as Elem>::A, <T as Elem>::A, u8>(acc, partial, None, |d, p, _| {
        for (d, p) in d.iter_mut().zip(p) {
            *d = f(*d, *p);
        }
    })))
}

/// `dst = finish(acc)`: rounds a finished partial (accumulator type) to `dtype`, dividing by `nranks`
/// for avg.
pub fn finish_acc(dtype: DType, op: ReduceOp, nranks: usize, dst: &mut [u8], acc: &[u8]) {
    let avg = op == ReduceOp::Avg;
    with_type!(dtype, T => map::<T, <T as Elem>::A, u8>(dst, acc, None, |d, a, _| {
        for (d, a) in d.iter_mut().zip(a) {
            *d = T::store(if avg { a.div_n(nranks) } else { *a });
        }
    }))
}

/// `dst = finish(partial op input)`: the last contribution of a chain of `nranks`, rounded to `dtype`
/// (and divided by `nranks` for avg). `input` may be [`Src::Dst`] for in-place operation.
pub fn finalize(
    dtype: DType,
    op: ReduceOp,
    nranks: usize,
    dst: &mut [u8],
    partial: &[u8],
    input: Src<'_>,
) {
    let avg = op == ReduceOp::Avg;
    with_type!(dtype, T => with_op!(op, f => {
        let fin = |a: <T as Elem>::A| T::store(if avg { a.div_n(nranks) } else { a });
        let kernel = |d: &mut [T], p: &[<T as Elem>::A], x: Option<&[T]>| {
            for ((d, p), x) in d.iter_mut().zip(p).zip(x.unwrap_or_default()) {
                *d = fin(f(*p, x.load()));
            }
        };
        match input {
            Src::Buf(input) => map(dst, partial, Some(input), kernel),
            Src::Dst => {
                // In place: copy each destination block aside before overwriting it.
                let (es, ps) = (size_of::<T>(), size_of::<<T as Elem>::A>());
                let n = dst.len() / es;
                let mut saved = [T::zeroed(); BLOCK];
                let mut start = 0;
                while start < n {
                    let len = BLOCK.min(n - start);
                    let out = &mut dst[start * es..(start + len) * es];
                    bytemuck::cast_slice_mut(&mut saved[..len]).copy_from_slice(out);
                    let p = &partial[start * ps..(start + len) * ps];
                    map(out, p, Some(bytemuck::cast_slice(&saved[..len])), kernel);
                    start += len;
                }
            }
        }
    }))
}

/// `dst = finish(src[0] op src[1] op ...)`, left to right, accumulating in the accumulator type; `avg`
/// divides by `srcs.len()`. At most one source should be [`Src::Dst`] (the in-place contribution).
pub fn reduce_ordered(dtype: DType, op: ReduceOp, dst: &mut [u8], srcs: &[Src<'_>]) {
    assert!(!srcs.is_empty(), "reduce_ordered needs at least one source");
    let avg = op == ReduceOp::Avg;
    for s in srcs {
        if let Src::Buf(b) = s {
            assert_eq!(b.len(), dst.len(), "source length");
        }
    }
    with_type!(dtype, T => with_op!(op, f => {
        assert_eq!(dst.len() % size_of::<T>(), 0, "destination length");
        // Small messages (the latency path) go element by element: no stack blocks to set up.
        if dst.len() <= SMALL * size_of::<T>() {
            ordered_few::<T>(f, avg, dst, srcs)
        } else {
            ordered::<T, BLOCK>(f, avg, dst, srcs)
        }
    }))
}

const SMALL: usize = 16;

/// [`ordered`] for a few elements: each one read (unaligned) from every source in turn, combined in
/// the same order and accumulator type, and stored.
#[inline(always)]
fn ordered_few<T: Elem>(
    f: impl Fn(T::A, T::A) -> T::A,
    avg: bool,
    dst: &mut [u8],
    srcs: &[Src<'_>],
) {
    let es = size_of::<T>();
    for at in (0..dst.len()).step_by(es) {
        let mut acc = T::A::zeroed();
        for (i, s) in srcs.iter().enumerate() {
            let bytes = match s {
                Src::Buf(b) => &b[at..at + es],
                Src::Dst => &dst[at..at + es],
            };
            let x = bytemuck::pod_read_unaligned::<T>(bytes).load();
            acc = if i == 0 { x } else { f(acc, x) };
        }
        let v = T::store(if avg { acc.div_n(srcs.len()) } else { acc });
        dst[at..at + es].copy_from_slice(bytemuck::bytes_of(&v));
    }
}

/// Inlined in optimised builds only, as [`map`].
#[cfg_attr(debug_assertions, inline(never))]
#[cfg_attr(not(debug_assertions), inline(always))]
fn ordered<T: Elem, const B: usize>(
    f: impl Fn(T::A, T::A) -> T::A,
    avg: bool,
    dst: &mut [u8],
    srcs: &[Src<'_>],
) {
    let es = size_of::<T>();
    let n = dst.len() / es;
    let nranks = srcs.len();
    let mut acc = [T::A::zeroed(); B];
    let mut tmp = [T::zeroed(); B];
    let mut start = 0;
    while start < n {
        let len = B.min(n - start);
        let range = start * es..(start + len) * es;
        for (i, s) in srcs.iter().enumerate() {
            let bytes = match s {
                Src::Buf(b) => &b[range.clone()],
                Src::Dst => &dst[range.clone()],
            };
            let x: &[T] = match bytemuck::try_cast_slice(bytes) {
                Ok(x) => x,
                Err(_) => {
                    bytemuck::cast_slice_mut(&mut tmp[..len]).copy_from_slice(bytes);
                    &tmp[..len]
                }
            };
            let acc = &mut acc[..len];
            if i == 0 {
                for (a, x) in acc.iter_mut().zip(x) {
                    *a = x.load();
                }
            } else {
                for (a, x) in acc.iter_mut().zip(x) {
                    *a = f(*a, x.load());
                }
            }
        }
        let out = &mut dst[range];
        let write = |d: &mut [T]| {
            for (d, a) in d.iter_mut().zip(&acc[..len]) {
                *d = T::store(if avg { a.div_n(nranks) } else { *a });
            }
        };
        match bytemuck::try_cast_slice_mut::<u8, T>(out) {
            Ok(d) => write(d),
            Err(_) => {
                write(&mut tmp[..len]);
                out.copy_from_slice(bytemuck::cast_slice(&tmp[..len]));
            }
        }
        start += len;
    }
}

#[cfg(test)]
mod tests;
