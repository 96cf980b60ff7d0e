//! Every schedule, simulated on many ranks, against a reference and against its cost formula.

mod common;

use braid_core::{DType, ReduceOp};
use braid_exec::sim;
use braid_sched::{direct, ring, Action};
use common::*;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_ring_and_direct(dtype in dtypes(), op in ops(), world in worlds(), count in 0usize..300,
        chunk in 1usize..40, depth in 2usize..5, seed in any::<u64>(), use_direct in any::<bool>()) {
        let ins = exact_inputs(dtype, op, world, count, seed);
        let want = reference(dtype, op, &ins);
        let p = if use_direct {
            plans(world, |r| direct::all_reduce(world, r, count, chunk))
        } else {
            plans(world, |r| ring::all_reduce(world, r, count, chunk))
        };
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        for o in &out.outputs {
            prop_assert_eq!(o, &want);
        }
    }

    #[test]
    fn ring_results_bit_identical_for_any_floats(world in 2usize..9, count in 1usize..200, chunk in 1usize..50,
        seed in any::<u64>()) {
        // Arbitrary values: the order of additions matters, but every rank must get the same bits.
        let ins: Vec<Vec<u8>> = (0..world as u64).map(|r| {
            (0..count as u64).flat_map(|i| (((seed ^ (r * 7919 + i)).wrapping_mul(0x9E3779B97F4A7C15) >> 40) as f32 / 3.7).to_ne_bytes()).collect()
        }).collect();
        let p = plans(world, |r| ring::all_reduce(world, r, count, chunk));
        let out = sim::run(&p, DType::F32, ReduceOp::Sum, &ins, count, 2).unwrap();
        for o in &out.outputs[1..] {
            prop_assert_eq!(o, &out.outputs[0]);
        }
    }

    #[test]
    fn reduce_scatter_and_all_gather(dtype in dtypes(), op in ops(), world in worlds(), rc in 0usize..60,
        chunk in 1usize..20, depth in 2usize..4, seed in any::<u64>()) {
        let es = dtype.size();
        let ins = exact_inputs(dtype, op, world, world * rc, seed);
        let want = reference(dtype, op, &ins);
        let p = plans(world, |r| ring::reduce_scatter(world, r, rc, chunk));
        let out = sim::run(&p, dtype, op, &ins, rc, depth).unwrap();
        for (r, o) in out.outputs.iter().enumerate() {
            prop_assert_eq!(&o[..], &want[r * rc * es..(r + 1) * rc * es]);
        }
        let blocks: Vec<Vec<u8>> = (0..world).map(|r| ins[r][..rc * es].to_vec()).collect();
        let p = plans(world, |r| ring::all_gather(world, r, rc, chunk));
        let out = sim::run(&p, dtype, op, &blocks, world * rc, depth).unwrap();
        let want: Vec<u8> = blocks.concat();
        for o in &out.outputs {
            prop_assert_eq!(o, &want);
        }
    }

    #[test]
    fn broadcast_and_reduce(dtype in dtypes(), op in ops(), world in worlds(), count in 0usize..200,
        chunk in 1usize..30, depth in 2usize..4, root_pick in any::<usize>(), seed in any::<u64>()) {
        let root = root_pick % world;
        let ins = exact_inputs(dtype, op, world, count, seed);
        let p = plans(world, |r| ring::broadcast(world, r, root, count, chunk));
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        for o in &out.outputs {
            prop_assert_eq!(o, &ins[root]);
        }
        let p = plans(world, |r| ring::reduce(world, r, root, count, chunk));
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        prop_assert_eq!(&out.outputs[root], &reference(dtype, op, &ins));
    }
}

#[test]
fn ring_moves_what_the_cost_model_says() {
    // Each rank sends (n-1) partial segments (accumulator type) and (n-1) final segments (dtype), in
    // 2(n-1) messages per chunk position.
    for (dtype, world, count, chunk) in [
        (DType::F32, 4, 4096, 256),
        (DType::BF16, 8, 8000, 100),
        (DType::F64, 3, 999, 1000),
        (DType::I8, 2, 64, 8),
    ] {
        let ins = exact_inputs(dtype, ReduceOp::Sum, world, count, 1);
        let p = plans(world, |r| ring::all_reduce(world, r, count, chunk));
        let out = sim::run(&p, dtype, ReduceOp::Sum, &ins, count, 2).unwrap();
        let seg = count / world;
        let chunks = seg.div_ceil(chunk);
        for r in 0..world {
            assert_eq!(
                out.bytes_sent[r],
                (world - 1) * seg * (dtype.size() + dtype.accumulator().size())
            );
            assert_eq!(out.messages[r], 2 * (world - 1) * chunks);
        }
    }
    // Direct: one message per peer per chunk, the whole buffer to each.
    let ins = exact_inputs(DType::F32, ReduceOp::Sum, 4, 100, 1);
    let p = plans(4, |r| direct::all_reduce(4, r, 100, 100));
    let out = sim::run(&p, DType::F32, ReduceOp::Sum, &ins, 100, 1).unwrap();
    assert!(out.bytes_sent.iter().all(|b| *b == 3 * 400));
    assert!(out.messages.iter().all(|m| *m == 3));
}

#[test]
fn barrier_completes_and_mismatch_is_caught() {
    let p = plans(5, |r| direct::barrier(5, r));
    let out = sim::run(&p, DType::U8, ReduceOp::Sum, &vec![vec![]; 5], 0, 1).unwrap();
    assert!(out.messages.iter().all(|m| *m == 4));
    // Rank 1 runs a larger all-reduce than rank 0: the length check catches it.
    let p = vec![
        ring::all_reduce(2, 0, 8, 100),
        ring::all_reduce(2, 1, 10, 100),
    ];
    let ins = vec![vec![0u8; 8], vec![0u8; 10]];
    let err = sim::run(&p, DType::U8, ReduceOp::Sum, &ins, 10, 2).unwrap_err();
    assert!(
        matches!(
            err,
            sim::SimError::Failed {
                error: braid_core::Error::Mismatch { .. },
                ..
            }
        ),
        "{err:?}"
    );
    // A schedule that only receives deadlocks and is reported as such.
    let p = vec![
        vec![Action::RecvCopy {
            from: 1,
            output: 0..0,
            forward: None,
        }],
        vec![],
    ];
    assert!(matches!(
        sim::run(&p, DType::U8, ReduceOp::Sum, &[vec![], vec![]], 0, 1),
        Err(sim::SimError::Deadlock(_))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn multi_channel_rings(dtype in dtypes(), op in ops(), world in 1usize..=9, count in 0usize..300,
        chunk in 1usize..30, depth in 2usize..4, channels in 1usize..5, seed in any::<u64>()) {
        let ins = exact_inputs(dtype, op, world, count, seed);
        let want = reference(dtype, op, &ins);
        let p = plans(world, |r| ring::all_reduce_channels(world, r, count, chunk, channels));
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        for o in &out.outputs {
            prop_assert_eq!(o, &want);
        }
    }
}

#[test]
fn two_channels_use_both_directions() {
    let ins = exact_inputs(DType::F32, ReduceOp::Sum, 4, 4000, 3);
    let p = plans(4, |r| ring::all_reduce_channels(4, r, 4000, 100, 2));
    let out = sim::run(&p, DType::F32, ReduceOp::Sum, &ins, 4000, 2).unwrap();
    // Same bytes as one ring, half of them each way.
    assert!(out.bytes_sent.iter().all(|b| *b == 3 * 1000 * 8));
    let sends_to = |r: usize, to: usize| {
        p[r].iter()
            .filter(|a| matches!(a, Action::SendAcc { to: t, .. } if *t == to))
            .count()
    };
    assert!(sends_to(0, 1) > 0 && sends_to(0, 3) > 0);
}
