use super::*;
use proptest::prelude::*;

/// Scalar reference: element values as f64 (floats, after rounding to their type) or i128 (integers),
/// reduced left to right with the documented semantics, written without the kernels' machinery.
fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let es = dtype.size();
    let n = inputs[0].len() / es;
    let mut out = vec![0u8; n * es];
    for i in 0..n {
        fn el(b: &[u8], i: usize, es: usize) -> &[u8] {
            &b[i * es..(i + 1) * es]
        }
        let o = &mut out[i * es..(i + 1) * es];
        macro_rules! float {
            ($t:ty, $load:expr, $store:expr) => {{
                let vals: Vec<$t> = inputs.iter().map(|b| $load(el(b, i, es))).collect();
                let mut a = vals[0];
                for v in &vals[1..] {
                    a = match op {
                        ReduceOp::Sum | ReduceOp::Avg => a + v,
                        ReduceOp::Prod => a * v,
                        ReduceOp::Min => {
                            if *v < a {
                                *v
                            } else {
                                a
                            }
                        }
                        ReduceOp::Max => {
                            if *v > a {
                                *v
                            } else {
                                a
                            }
                        }
                        ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {
                            unreachable!("bitwise reductions take integers")
                        }
                    };
                }
                if op == ReduceOp::Avg {
                    a /= inputs.len() as $t;
                }
                o.copy_from_slice(&$store(a));
            }};
        }
        macro_rules! int {
            ($t:ty) => {{
                let vals: Vec<$t> = inputs
                    .iter()
                    .map(|b| <$t>::from_ne_bytes(el(b, i, es).try_into().unwrap()))
                    .collect();
                let mut a = vals[0];
                for v in &vals[1..] {
                    a = match op {
                        ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(*v),
                        ReduceOp::Prod => a.wrapping_mul(*v),
                        ReduceOp::Min => Ord::min(a, *v),
                        ReduceOp::Max => Ord::max(a, *v),
                        ReduceOp::BitAnd => a & *v,
                        ReduceOp::BitOr => a | *v,
                        ReduceOp::BitXor => a ^ *v,
                    };
                }
                if op == ReduceOp::Avg {
                    a = (a as i128 / inputs.len() as i128) as $t;
                }
                o.copy_from_slice(&a.to_ne_bytes());
            }};
        }
        match dtype {
            DType::I8 => int!(i8),
            DType::U8 => int!(u8),
            DType::I32 => int!(i32),
            DType::U32 => int!(u32),
            DType::I64 => int!(i64),
            DType::U64 => int!(u64),
            DType::F32 => float!(
                f32,
                |b: &[u8]| f32::from_ne_bytes(b.try_into().unwrap()),
                |a: f32| a.to_ne_bytes()
            ),
            DType::F64 => float!(
                f64,
                |b: &[u8]| f64::from_ne_bytes(b.try_into().unwrap()),
                |a: f64| a.to_ne_bytes()
            ),
            DType::F16 => float!(
                f32,
                |b: &[u8]| f16::from_ne_bytes(b.try_into().unwrap()).to_f32(),
                |a: f32| f16::from_f32(a).to_ne_bytes()
            ),
            DType::BF16 => float!(
                f32,
                |b: &[u8]| bf16::from_ne_bytes(b.try_into().unwrap()).to_f32(),
                |a: f32| bf16::from_f32(a).to_ne_bytes()
            ),
        }
    }
    out
}

/// Deterministic inputs: small integers (exact in every float type) or raw bytes for integer types.
fn inputs(dtype: DType, nranks: usize, count: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..nranks)
        .map(|_| {
            let mut v = Vec::with_capacity(count * dtype.size());
            for _ in 0..count {
                let r = next();
                let small = (r % 9) as f64 - 4.0 + if r & 0x100 != 0 { 0.5 } else { 0.0 };
                match dtype {
                    DType::F32 => v.extend((small as f32).to_ne_bytes()),
                    DType::F64 => v.extend(small.to_ne_bytes()),
                    DType::F16 => v.extend(f16::from_f64(small).to_ne_bytes()),
                    DType::BF16 => v.extend(bf16::from_f64(small).to_ne_bytes()),
                    _ => v.extend(&r.to_ne_bytes()[..dtype.size()]),
                }
            }
            v
        })
        .collect()
}

/// Copies `data` into a fresh buffer at byte offset `off`, so tests see unaligned slices.
fn at_offset(data: &[u8], off: usize) -> Vec<u8> {
    let mut v = vec![0u8; data.len() + off];
    v[off..].copy_from_slice(data);
    v
}

fn chain(dtype: DType, op: ReduceOp, ins: &[Vec<u8>], off: usize, in_place: bool) -> Vec<u8> {
    let n = ins[0].len() / dtype.size();
    let acc_len = n * dtype.accumulator().size();
    let mut a = at_offset(&vec![0u8; acc_len], off);
    let mut b = at_offset(&vec![0u8; acc_len], (off + 1) % 8);
    let first = at_offset(&ins[0], off);
    to_acc(dtype, &mut a[off..], &first[off..]);
    let mut cur_in_a = true;
    for x in ins.iter().take(ins.len().saturating_sub(1)).skip(1) {
        let x = at_offset(x, off + 3);
        if cur_in_a {
            combine(dtype, op, &mut b[(off + 1) % 8..], &a[off..], &x[off + 3..]);
        } else {
            combine(dtype, op, &mut a[off..], &b[(off + 1) % 8..], &x[off + 3..]);
        }
        cur_in_a = !cur_in_a;
    }
    let partial = if cur_in_a {
        &a[off..]
    } else {
        &b[(off + 1) % 8..]
    };
    if ins.len() == 1 {
        // A chain of one: finalize of the first contribution is a plain conversion.
        let mut out = ins[0].clone();
        reduce_ordered(dtype, op, &mut out, &[Src::Dst]);
        return out;
    }
    let last = ins.last().unwrap();
    if in_place {
        let mut out = at_offset(last, off + 5);
        finalize(dtype, op, ins.len(), &mut out[off + 5..], partial, Src::Dst);
        out[off + 5..].to_vec()
    } else {
        let x = at_offset(last, off + 2);
        let mut out = at_offset(&vec![0u8; last.len()], off + 5);
        finalize(
            dtype,
            op,
            ins.len(),
            &mut out[off + 5..],
            partial,
            Src::Buf(&x[off + 2..]),
        );
        out[off + 5..].to_vec()
    }
}

fn dtypes() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}
fn ops() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn chain_and_ordered_match_reference(dtype in dtypes(), op in ops(), nranks in 1usize..9,
        count in prop_oneof![0usize..20, 0usize..1500], off in 0usize..8, seed in any::<u64>(), in_place in any::<bool>()) {
        prop_assume!(op.check_dtype(dtype).is_ok());
        let ins = inputs(dtype, nranks, count, seed);
        let want = reference(dtype, op, &ins);
        prop_assert_eq!(&chain(dtype, op, &ins, off, in_place), &want, "chain");
        let bufs: Vec<Vec<u8>> = ins.iter().map(|b| at_offset(b, off)).collect();
        let mut srcs: Vec<Src> = bufs.iter().map(|b| Src::Buf(&b[off..])).collect();
        let mut out = at_offset(&vec![0u8; want.len()], (off + 3) % 8);
        let o = (off + 3) % 8;
        if in_place {
            out[o..].copy_from_slice(&ins[nranks - 1]);
            srcs[nranks - 1] = Src::Dst;
        }
        reduce_ordered(dtype, op, &mut out[o..], &srcs);
        prop_assert_eq!(&out[o..], &want[..], "ordered");
    }
}

#[test]
fn half_types_accumulate_in_f32() {
    // 2048 + 1 + 1 in f16 arithmetic rounds to 2048 at each step; accumulating in f32 gives 2050.
    let x: Vec<Vec<u8>> = [2048.0f32, 1.0, 1.0]
        .iter()
        .map(|v| f16::from_f32(*v).to_ne_bytes().to_vec())
        .collect();
    let mut out = [0u8; 2];
    let srcs: Vec<Src> = x.iter().map(|b| Src::Buf(b)).collect();
    reduce_ordered(DType::F16, ReduceOp::Sum, &mut out, &srcs);
    assert_eq!(f16::from_ne_bytes(out).to_f32(), 2050.0);
    let mut acc = [0u8; 4];
    to_acc(DType::F16, &mut acc, &x[0]);
    let mut acc2 = [0u8; 4];
    combine(DType::F16, ReduceOp::Sum, &mut acc2, &acc, &x[1]);
    finalize(
        DType::F16,
        ReduceOp::Sum,
        3,
        &mut out,
        &acc2,
        Src::Buf(&x[2]),
    );
    assert_eq!(f16::from_ne_bytes(out).to_f32(), 2050.0);
}

#[test]
fn avg_divides_once_and_integers_wrap() {
    let a = 7i32.to_ne_bytes();
    let b = 8i32.to_ne_bytes();
    let mut out = [0u8; 4];
    reduce_ordered(
        DType::I32,
        ReduceOp::Avg,
        &mut out,
        &[Src::Buf(&a), Src::Buf(&b)],
    );
    assert_eq!(i32::from_ne_bytes(out), 7);
    let a = [200u8];
    let mut o = [0u8];
    reduce_ordered(
        DType::U8,
        ReduceOp::Sum,
        &mut o,
        &[Src::Buf(&a), Src::Buf(&a)],
    );
    assert_eq!(o[0], 144);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn scratch_accumulation_matches_reference(dtype in dtypes(), op in ops(), nranks in 1usize..9,
        count in 0usize..1200, off in 0usize..8, seed in any::<u64>()) {
        prop_assume!(op.check_dtype(dtype).is_ok());
        // Tree-style: load one contribution, merge the others' partials in, finish.
        let ins = inputs(dtype, nranks, count, seed);
        let want = reference(dtype, op, &ins);
        let acc = dtype.accumulator().size();
        let mut scratch = at_offset(&vec![0u8; count * acc], off);
        to_acc(dtype, &mut scratch[off..], &ins[0]);
        for x in &ins[1..] {
            let mut p = at_offset(&vec![0u8; count * acc], (off + 3) % 8);
            to_acc(dtype, &mut p[(off + 3) % 8..], x);
            combine_acc(dtype, op, &mut scratch[off..], &p[(off + 3) % 8..]);
        }
        let mut out = at_offset(&vec![0u8; count * dtype.size()], (off + 5) % 8);
        finish_acc(dtype, op, nranks, &mut out[(off + 5) % 8..], &scratch[off..]);
        prop_assert_eq!(&out[(off + 5) % 8..], &want[..]);
    }
}
