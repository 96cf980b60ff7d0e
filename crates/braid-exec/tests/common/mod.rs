//! Helpers shared by the schedule tests: inputs with exact results, a reference reduction, strategies.
#![allow(dead_code)]

use braid_core::reduce::{reduce_ordered, Src};
use braid_core::{DType, ReduceOp};
use braid_sched::Action;
use half::{bf16, f16};
use proptest::prelude::*;

/// Inputs whose reduction is exact in any order: integers in -2..=2 (or ±1, ±2 for prod) for floats,
/// anything for integer types (wrapping arithmetic is associative and commutative).
pub fn exact_inputs(
    dtype: DType,
    op: ReduceOp,
    world: usize,
    count: usize,
    seed: u64,
) -> Vec<Vec<u8>> {
    let mut x = seed | 1;
    (0..world)
        .map(|_| {
            let mut v = Vec::new();
            for _ in 0..count {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let small = if op == ReduceOp::Prod {
                    [1.0, 2.0, -1.0, -2.0][(x % 4) as usize]
                } else {
                    (x % 5) as f64 - 2.0
                };
                match dtype {
                    DType::F32 => v.extend((small as f32).to_ne_bytes()),
                    DType::F64 => v.extend(small.to_ne_bytes()),
                    DType::F16 => v.extend(f16::from_f64(small).to_ne_bytes()),
                    DType::BF16 => v.extend(bf16::from_f64(small).to_ne_bytes()),
                    _ => v.extend(&x.to_ne_bytes()[..dtype.size()]),
                }
            }
            v
        })
        .collect()
}

/// Arbitrary finite f32 values of every magnitude: the order of operations changes the bits.
pub fn arbitrary_f32(world: usize, count: usize, seed: u64) -> Vec<Vec<u8>> {
    (0..world as u64)
        .map(|r| {
            (0..count as u64)
                .flat_map(|i| {
                    let h = (seed ^ (r * 7919 + i)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    let v = (h >> 40) as f32 / 3.7 * if h & 1 == 1 { -1.0 } else { 1.0 };
                    v.to_ne_bytes()
                })
                .collect()
        })
        .collect()
}

pub fn reference(dtype: DType, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = vec![0u8; inputs[0].len()];
    let srcs: Vec<Src> = inputs.iter().map(|b| Src::Buf(b)).collect();
    reduce_ordered(dtype, op, &mut out, &srcs);
    out
}

pub fn dtypes() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

pub fn ops() -> impl Strategy<Value = ReduceOp> {
    prop::sample::select(ReduceOp::ARITHMETIC.to_vec())
}

pub fn worlds() -> impl Strategy<Value = usize> {
    prop_oneof![6 => 1usize..=9, 1 => Just(16usize), 1 => Just(33usize), 1 => Just(64usize)]
}

pub fn plans(world: usize, f: impl Fn(usize) -> Vec<Action>) -> Vec<Vec<Action>> {
    (0..world).map(f).collect()
}

/// Every rank's flat all-reduce schedule of `algo`.
pub fn all_reduce_plans(
    algo: braid_sched::Algo,
    world: usize,
    count: usize,
    chunk: usize,
) -> Vec<Vec<Action>> {
    plans(world, |rank| {
        braid_sched::plan(&braid_sched::PlanSpec {
            collective: braid_sched::Collective::AllReduce,
            root: 0,
            algo,
            world,
            rank,
            count,
            chunk,
            hosts: &[],
            channels: 1,
        })
    })
}
