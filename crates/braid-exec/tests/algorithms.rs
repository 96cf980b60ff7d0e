//! The tree, recursive halving-doubling and direct schedules, simulated on many ranks against a
//! reference, for bit-identical results, and against the traffic and cost model of `cost`.

mod common;

use braid_core::{DType, ReduceOp};
use braid_exec::sim;
use braid_sched::cost::{all_reduce_cost, all_reduce_traffic, LinkCost};
use braid_sched::{direct, tree, Action, Algo};
use common::*;
use proptest::prelude::*;

/// Every message fits in one slot of `chunk` elements.
fn messages_fit(p: &[Vec<Action>], chunk: usize) -> bool {
    p.iter().flatten().all(|a| match a {
        Action::Send { range, .. }
        | Action::SendAcc { range, .. }
        | Action::SendScratch { range, .. }
        | Action::RecvCombine { range, .. }
        | Action::RecvReduceSend { range, .. }
        | Action::RecvReduceAll { input: range, .. } => range.len() <= chunk,
        Action::RecvCopy { output, .. } => output.len() <= chunk,
        Action::RecvReduceFinal { input, .. } => input.len() <= chunk,
        Action::Copy { .. } | Action::LoadAcc { .. } | Action::FinishScratch { .. } => true,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_tree_and_rhd(dtype in dtypes(), op in ops(), world in worlds(), count in 0usize..300,
        chunk in 1usize..40, depth in 2usize..=4, seed in any::<u64>(), algo in prop::sample::select(vec![Algo::Tree, Algo::Rhd])) {
        let ins = exact_inputs(dtype, op, world, count, seed);
        let want = reference(dtype, op, &ins);
        let p = all_reduce_plans(algo, world, count, chunk);
        prop_assert!(messages_fit(&p, chunk));
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        for o in &out.outputs {
            prop_assert_eq!(o, &want);
        }
    }

    #[test]
    fn tree_and_rhd_bit_identical_for_any_floats(world in worlds(), count in 1usize..300,
        chunk in 1usize..40, seed in any::<u64>(), algo in prop::sample::select(vec![Algo::Tree, Algo::Rhd]),
        op in prop::sample::select(vec![ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Max])) {
        let ins = arbitrary_f32(world, count, seed);
        let p = all_reduce_plans(algo, world, count, chunk);
        let out = sim::run(&p, DType::F32, op, &ins, count, 2).unwrap();
        for o in &out.outputs[1..] {
            prop_assert_eq!(o, &out.outputs[0]);
        }
    }

    #[test]
    fn tree_broadcast_and_reduce(dtype in dtypes(), op in ops(), world in worlds(), count in 0usize..300,
        chunk in 1usize..40, depth in 2usize..=4, root_pick in any::<usize>(), seed in any::<u64>()) {
        let root = root_pick % world;
        let ins = exact_inputs(dtype, op, world, count, seed);
        let p = plans(world, |r| tree::broadcast(world, r, root, count, chunk));
        prop_assert!(messages_fit(&p, chunk));
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        for o in &out.outputs {
            prop_assert_eq!(o, &ins[root]);
        }
        let p = plans(world, |r| tree::reduce(world, r, root, count, chunk));
        prop_assert!(messages_fit(&p, chunk));
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        prop_assert_eq!(&out.outputs[root], &reference(dtype, op, &ins));
    }

    #[test]
    fn direct_all_gather(dtype in dtypes(), world in worlds(), send_count in 0usize..60,
        chunk in 1usize..40, depth in 2usize..=4, seed in any::<u64>()) {
        let es = dtype.size();
        let ins = exact_inputs(dtype, ReduceOp::Sum, world, send_count, seed);
        let p = plans(world, |r| direct::all_gather(world, r, send_count, chunk));
        prop_assert!(messages_fit(&p, chunk));
        let out = sim::run(&p, dtype, ReduceOp::Sum, &ins, world * send_count, depth).unwrap();
        let want: Vec<u8> = ins.concat();
        prop_assert_eq!(want.len(), world * send_count * es);
        for o in &out.outputs {
            prop_assert_eq!(o, &want);
        }
    }
}

/// What rank `rank` must hold after an all-to-all of `count` elements per peer: block `j` is rank `j`'s
/// input block `rank`.
fn transposed(ins: &[Vec<u8>], rank: usize, count: usize, es: usize) -> Vec<u8> {
    let b = count * es;
    ins.iter()
        .flat_map(|i| i[rank * b..(rank + 1) * b].to_vec())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn direct_all_to_all(dtype in dtypes(), world in worlds(), count in 0usize..40,
        chunk in 1usize..40, depth in 2usize..=4, seed in any::<u64>()) {
        let es = dtype.size();
        let ins = exact_inputs(dtype, ReduceOp::Sum, world, world * count, seed);
        let p = plans(world, |r| direct::all_to_all(world, r, count, chunk));
        prop_assert!(messages_fit(&p, chunk));
        let out = sim::run(&p, dtype, ReduceOp::Sum, &ins, world * count, depth).unwrap();
        for (r, o) in out.outputs.iter().enumerate() {
            prop_assert_eq!(o, &transposed(&ins, r, count, es));
        }
    }
}

#[test]
fn all_to_all_every_small_case_at_depth_two_and_its_traffic() {
    for world in (1..=9).chain([16, 33]) {
        for count in [0, 1, 2, 3, 7, 8, 9] {
            for chunk in [1, 3, 8] {
                let dtype = DType::F32;
                let ins = arbitrary_f32(world, world * count, (world * 100 + count) as u64);
                let p = plans(world, |r| direct::all_to_all(world, r, count, chunk));
                let out = sim::run(&p, dtype, ReduceOp::Sum, &ins, world * count, 2)
                    .unwrap_or_else(|e| panic!("world {world} count {count} chunk {chunk}: {e}"));
                let positions = count.div_ceil(chunk).max(1);
                for r in 0..world {
                    assert_eq!(
                        out.outputs[r],
                        transposed(&ins, r, count, 4),
                        "{world} {count} {chunk} rank {r}"
                    );
                    // Every block but its own leaves the rank, once, in one message per chunk position.
                    assert_eq!(out.bytes_sent[r], (world - 1) * count * 4);
                    assert_eq!(out.messages[r], (world - 1) * positions);
                }
            }
        }
    }
}

#[test]
fn every_world_and_small_counts() {
    // Exhaustive over the small cases that are easiest to get wrong: empty halves and blocks, counts
    // below the world size, one-element chunks.
    for world in (1..=9).chain([16, 33, 64]) {
        for count in [0, 1, 2, 3, world - 1, world, world + 1, 2 * world + 3] {
            for chunk in [1, 2, 7] {
                let (dtype, op) = (DType::BF16, ReduceOp::Avg);
                let ins = exact_inputs(dtype, op, world, count, (world * 1000 + count) as u64);
                let want = reference(dtype, op, &ins);
                for algo in [Algo::Tree, Algo::Rhd] {
                    let p = all_reduce_plans(algo, world, count, chunk);
                    let out = sim::run(&p, dtype, op, &ins, count, 2)
                        .unwrap_or_else(|e| panic!("{algo} world {world} count {count}: {e}"));
                    assert!(
                        out.outputs.iter().all(|o| o == &want),
                        "{algo} {world} {count} {chunk}"
                    );
                }
            }
        }
    }
}

#[test]
fn traffic_matches_the_simulator() {
    for (dtype, world, count, chunk) in [
        (DType::F32, 4, 4096, 256),
        (DType::BF16, 8, 8000, 100),
        (DType::F16, 6, 1001, 64),
        (DType::F64, 3, 999, 1000),
        (DType::I8, 2, 64, 8),
        (DType::U32, 5, 3, 1),
        (DType::F32, 33, 500, 7),
        (DType::BF16, 64, 300, 16),
        (DType::I64, 7, 0, 4),
    ] {
        let (es, acc) = (dtype.size(), dtype.accumulator().size());
        let ins = exact_inputs(dtype, ReduceOp::Sum, world, count, 1);
        for algo in [Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Direct] {
            let p = all_reduce_plans(algo, world, count, chunk);
            let out = sim::run(&p, dtype, ReduceOp::Sum, &ins, count, 2).unwrap();
            for r in 0..world {
                let (m, b) = all_reduce_traffic(algo, world, r, count, es, acc, chunk);
                assert_eq!(
                    (m, b),
                    (out.messages[r], out.bytes_sent[r]),
                    "{algo} {dtype:?} world {world} rank {r}"
                );
            }
        }
    }
}

#[test]
fn tree_and_rhd_move_about_what_a_ring_moves() {
    // Double tree: no rank sends more than one buffer of partials plus one of results (a ring sends
    // (n-1)/n of each); rhd on a power of two sends exactly what the ring does.
    for world in [16, 33] {
        let (count, chunk) = (world * 1024, 512);
        for r in 0..world {
            let ring = all_reduce_traffic(Algo::Ring, world, r, count, 4, 4, chunk).1;
            let tree = all_reduce_traffic(Algo::Tree, world, r, count, 4, 4, chunk).1;
            let rhd = all_reduce_traffic(Algo::Rhd, world, r, count, 4, 4, chunk).1;
            if world.is_power_of_two() {
                assert_eq!(rhd, ring);
            }
            assert!(ring < count * (4 + 4));
            assert!(tree <= count * (4 + 4), "world {world} rank {r}: {tree}");
        }
    }
}

#[test]
fn cost_model_ranks_algorithms() {
    let f = 1.0;
    // Latency-bound: large alpha, tiny beta; 64 ranks, a small buffer.
    let slow_hops = LinkCost {
        alpha_us: 10.0,
        beta_us_per_byte: 1e-6,
        gamma_us_per_byte: 1e-6,
    };
    let cost =
        |a: Algo, bytes: usize, link: &LinkCost| all_reduce_cost(a, 64, bytes, f, 1 << 16, link);
    let ring = cost(Algo::Ring, 4096, &slow_hops);
    for a in [Algo::Tree, Algo::Rhd, Algo::Direct] {
        assert!(cost(a, 4096, &slow_hops) < ring / 4.0, "{a}");
    }
    assert!(cost(Algo::Direct, 4096, &slow_hops) < cost(Algo::Tree, 4096, &slow_hops));
    // Bandwidth-bound: no latency, a large buffer: the ring moves the fewest bytes (rhd moves as many on
    // a power of two but pays an extra scratch pass), direct the most.
    let fast_hops = LinkCost {
        alpha_us: 0.0,
        beta_us_per_byte: 1e-3,
        gamma_us_per_byte: 1e-4,
    };
    for world in [6, 33, 64] {
        let bytes = 64 << 20;
        let c = |a: Algo| all_reduce_cost(a, world, bytes, 2.0, 1 << 20, &fast_hops);
        let ring = c(Algo::Ring);
        assert!(ring < c(Algo::Tree), "world {world}");
        assert!(ring < c(Algo::Direct), "world {world}");
        assert!(ring < c(Algo::Rhd), "world {world}");
    }
    // Nothing to do on one rank; hier, which needs the hosts, is never chosen on one class of links.
    assert_eq!(
        all_reduce_cost(Algo::Tree, 1, 1000, f, 100, &slow_hops),
        0.0
    );
    assert_eq!(
        all_reduce_cost(Algo::Hier, 8, 1000, f, 100, &slow_hops),
        f64::INFINITY
    );
    // More latency or more bytes never costs less.
    for a in [Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Direct] {
        let small = all_reduce_cost(a, 8, 1 << 10, f, 1 << 12, &slow_hops);
        let large = all_reduce_cost(a, 8, 1 << 24, f, 1 << 12, &slow_hops);
        assert!(small > 0.0 && small < large, "{a}");
    }
}

#[test]
fn world_of_one_is_a_copy() {
    for algo in [Algo::Tree, Algo::Rhd] {
        assert_eq!(
            all_reduce_plans(algo, 1, 5, 2).remove(0),
            vec![Action::Copy {
                src: 0..5,
                dst: 0..5
            }]
        );
    }
}
