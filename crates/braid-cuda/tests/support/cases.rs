//! The kernel cases every runner of the reduce-copy kernels is checked with (the host driver's two
//! builds, the GPU): reproducible data with the awkward values, braid-core's answers, and the layouts
//! and lengths that reach every path of the kernels.

use braid_core::reduce::{self, Src};
use braid_core::{DType, ReduceOp};
use braid_cuda::{kernel_name, Shape};

/// Runs one kernel of the catalogue.
pub trait Runner {
    /// Runs kernel `name` over `grid` (a runner may choose its own) on `count` elements, with
    /// `nranks` the divisor of avg; destinations are (misalignment, bytes), destination 0 being source
    /// `alias` when given (in place). Returns each destination's bytes.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        name: &str,
        grid: Grid,
        count: usize,
        nranks: u32,
        srcs: &[Operand],
        dsts: &[(u32, usize)],
        alias: Option<usize>,
    ) -> Vec<Vec<u8>>;
}

/// A grid: blocks × threads per block.
#[derive(Clone, Copy, Debug)]
pub struct Grid(pub u32, pub u32);

/// One operand of a request.
pub struct Operand {
    /// Bytes past 16-byte alignment the operand starts at.
    pub misalign: u32,
    /// Its contents.
    pub bytes: Vec<u8>,
}

/// xorshift64*: reproducible inputs without a dependency.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `count` elements of `dtype` (or of its accumulator type when `acc`): random bits for integers; for
/// floats mostly small values whose sums round (with now and then a NaN, an infinity, a signed zero, a
/// subnormal or random bits).
pub fn data(rng: &mut Rng, dtype: DType, acc: bool, count: usize) -> Vec<u8> {
    let t = if acc { dtype.accumulator() } else { dtype };
    let mut out = Vec::with_capacity(count * t.size());
    for _ in 0..count {
        let r = rng.next();
        let special = rng.below(16) == 0;
        let x = (rng.below(20001) as f64 - 10000.0) / 64.0 * (1.0 + (r % 7) as f64 / 3.0);
        let pick = rng.below(6);
        match t {
            DType::F32 => {
                let v = if !special {
                    x as f32
                } else {
                    [
                        f32::NAN,
                        f32::INFINITY,
                        -0.0,
                        1e-40,
                        f32::from_bits(r as u32),
                        65504.0,
                    ][pick as usize]
                };
                out.extend(v.to_le_bytes());
            }
            DType::F64 => {
                let v = if !special {
                    x
                } else {
                    [
                        f64::NAN,
                        f64::NEG_INFINITY,
                        -0.0,
                        1e-310,
                        f64::from_bits(r),
                        3.0,
                    ][pick as usize]
                };
                out.extend(v.to_le_bytes());
            }
            DType::F16 => {
                let v = if !special {
                    half::f16::from_f64(x)
                } else {
                    half::f16::from_bits(r as u16)
                };
                out.extend(v.to_le_bytes());
            }
            DType::BF16 => {
                let v = if !special {
                    half::bf16::from_f64(x)
                } else {
                    half::bf16::from_bits(r as u16)
                };
                out.extend(v.to_le_bytes());
            }
            _ => {
                // Integers: mostly small values (products stay interesting), sometimes full-width bits.
                let v = if special { r } else { (r % 7).wrapping_sub(3) };
                out.extend(&v.to_le_bytes()[..t.size()]);
            }
        }
    }
    out
}

/// braid-core's answer for `shape` (every destination gets the same bytes).
pub fn reference(
    shape: Shape,
    dtype: DType,
    op: ReduceOp,
    nranks: usize,
    srcs: &[Vec<u8>],
    count: usize,
) -> Vec<u8> {
    let dsize = if shape.destinations()[0] {
        dtype.accumulator().size()
    } else {
        dtype.size()
    };
    let mut out = vec![0u8; count * dsize];
    match shape {
        Shape::ToAcc => reduce::to_acc(dtype, &mut out, &srcs[0]),
        Shape::Combine => reduce::combine(dtype, op, &mut out, &srcs[0], &srcs[1]),
        Shape::CombineAcc => {
            out.copy_from_slice(&srcs[0]);
            reduce::combine_acc(dtype, op, &mut out, &srcs[1]);
        }
        Shape::FinishAcc => reduce::finish_acc(dtype, op, nranks, &mut out, &srcs[0]),
        Shape::Finalize | Shape::Finalize2 => {
            reduce::finalize(dtype, op, nranks, &mut out, &srcs[0], Src::Buf(&srcs[1]))
        }
        Shape::Ordered(_) => {
            let s: Vec<Src<'_>> = srcs.iter().map(|b| Src::Buf(b)).collect();
            reduce::reduce_ordered(dtype, op, &mut out, &s);
        }
    }
    out
}

/// The ways operands are laid out in memory: misalignment of each operand, in bytes.
#[derive(Clone, Copy, Debug)]
pub enum Layout {
    /// Every operand 16-byte aligned.
    Aligned,
    /// Every operand shifted by the same number of elements: a scalar head, then the vector path.
    SameHead,
    /// Element-aligned operands that no head aligns together: the element path.
    Mismatched,
    /// Operands off their element alignment: the byte path.
    Bytes,
}

pub fn misalign(layout: Layout, rng: &mut Rng, elem: usize, shift: u64, i: usize) -> u32 {
    let m = match layout {
        Layout::Aligned => 0,
        Layout::SameHead => (shift as usize * elem) % 16,
        Layout::Mismatched => {
            // Operand 0 aligned, the others one element off (when an element is under 16 bytes; else a
            // further 8 bytes, which 8-byte types see as misaligned for 16-byte packs).
            if i == 0 {
                0
            } else {
                (elem % 16).max(8)
            }
        }
        Layout::Bytes => 1 + rng.below(elem.max(2) as u64 - 1) as usize,
    };
    m as u32
}

/// Runs every case of kernel (`shape`, `dtype`, `op`) through `d` and checks each destination against
/// braid-core bit for bit (panicking with the first differing element); returns the number of cases.
pub fn check_kernel(
    d: &mut dyn Runner,
    rng: &mut Rng,
    shape: Shape,
    dtype: DType,
    op: ReduceOp,
) -> usize {
    let name = kernel_name(shape, dtype, op).unwrap();
    let (sacc, dacc) = (shape.sources(), shape.destinations());
    let size = |acc: bool| {
        if acc {
            dtype.accumulator().size()
        } else {
            dtype.size()
        }
    };
    let mut cases = 0;
    let group = 16 / dtype.size();
    // Lengths: empty, shorter than a pack, and odd lengths over the unrolled loop and its remainder.
    let counts = [
        0,
        1,
        group - 1,
        4 * group * 3 + 5,
        8 * group * 5 + group / 2 + 3,
        1021,
    ];
    let layouts = [
        Layout::Aligned,
        Layout::SameHead,
        Layout::Mismatched,
        Layout::Bytes,
    ];
    for (ci, &count) in counts.iter().enumerate() {
        for (li, &layout) in layouts.iter().enumerate() {
            if (ci + li) % 2 == 1 && count > group {
                continue; // every layout meets short and long lengths; not every pair is needed
            }
            // One thread, one partial warp, several blocks of odd size, two full warps in two blocks.
            let grid = [Grid(1, 1), Grid(1, 3), Grid(3, 7), Grid(2, 32)][(ci + li) % 4];
            let shift = 1 + rng.below(group as u64 - 1).min(group as u64);
            let nranks = match shape {
                Shape::Ordered(n) => n,
                _ => 1 + rng.below(6) as usize,
            };
            let srcs: Vec<Vec<u8>> = sacc.iter().map(|&a| data(rng, dtype, a, count)).collect();
            let ops: Vec<Operand> = srcs
                .iter()
                .zip(&sacc)
                .enumerate()
                .map(|(i, (b, &a))| Operand {
                    misalign: misalign(layout, rng, size(a), shift, i),
                    bytes: b.clone(),
                })
                .collect();
            let dsts: Vec<(u32, usize)> = dacc
                .iter()
                .enumerate()
                .map(|(j, &a)| {
                    (
                        misalign(layout, rng, size(a), shift, j + 1),
                        count * size(a),
                    )
                })
                .collect();
            // combine_acc runs in place (acc is source 0 and destination 0), as the executor runs it.
            let alias = (shape == Shape::CombineAcc).then_some(0);
            let got = d.run(&name, grid, count, nranks as u32, &ops, &dsts, alias);
            let want = reference(shape, dtype, op, nranks, &srcs, count);
            for (j, g) in got.iter().enumerate() {
                if *g != want {
                    let es = size(dacc[j]);
                    let first =
                        (0..count).find(|&e| g[e * es..(e + 1) * es] != want[e * es..(e + 1) * es]);
                    panic!(
                        "{name}: destination {j} differs from braid-core ({count} elements, {layout:?}, \
                         grid {grid:?}, nranks {nranks}), first at element {first:?}: got {:02x?}, want {:02x?}",
                        first.map(|e| &g[e * es..(e + 1) * es]),
                        first.map(|e| &want[e * es..(e + 1) * es])
                    );
                }
            }
            cases += 1;
        }
    }
    cases
}
