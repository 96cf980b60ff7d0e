//! Topology-aware schedules: the ring in any rank order, and the hierarchical all-reduce over hosts
//! whose ranks carry arbitrary numbers, simulated against a reference, for bit-identical results, and
//! against the traffic and cost model of `cost`.

mod common;

use braid_core::{DType, ReduceOp};
use braid_exec::sim;
use braid_sched::cost::{
    flat_ring_cost, flat_ring_traffic, hier_cost, hier_traffic, traffic, HostLinks,
};
use braid_sched::{hier, plan, ring, Action, Collective, PlanSpec};
use common::*;
use proptest::prelude::*;

/// `sizes[h]` ranks on host `h`, numbered by the permutation `perm` of `0..n` (host by host).
fn layout(sizes: &[usize], perm: &[usize]) -> Vec<Vec<usize>> {
    let mut at = 0;
    sizes
        .iter()
        .map(|&s| {
            at += s;
            perm[at - s..at].to_vec()
        })
        .collect()
}

/// Uniform hosts (1..=4 hosts of 1..=4 ranks), ranks numbered in a random order.
fn uniform_hosts() -> impl Strategy<Value = Vec<Vec<usize>>> {
    (1usize..=4, 1usize..=4).prop_flat_map(|(h, l)| {
        Just((0..h * l).collect::<Vec<_>>())
            .prop_shuffle()
            .prop_map(move |perm| layout(&vec![l; h], &perm))
    })
}

/// 1..=4 hosts of 1..=4 ranks each, sizes independent, ranks numbered in a random order.
fn uneven_hosts() -> impl Strategy<Value = Vec<Vec<usize>>> {
    prop::collection::vec(1usize..=4, 1..=4).prop_flat_map(|sizes| {
        let n = sizes.iter().sum::<usize>();
        Just((0..n).collect::<Vec<_>>())
            .prop_shuffle()
            .prop_map(move |perm| layout(&sizes, &perm))
    })
}

fn world(hosts: &[Vec<usize>]) -> usize {
    hosts.iter().map(Vec::len).sum()
}

fn host_of(hosts: &[Vec<usize>], r: usize) -> usize {
    hosts.iter().position(|h| h.contains(&r)).unwrap()
}

/// Bytes the simulated run sent from one host to another.
fn crossing(hosts: &[Vec<usize>], out: &sim::Outcome) -> usize {
    let n = world(hosts);
    let mut total = 0;
    for a in 0..n {
        for b in 0..n {
            if host_of(hosts, a) != host_of(hosts, b) {
                total += out.link_bytes[a][b];
            }
        }
    }
    total
}

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

/// Runs only the message traffic of `plans` over channels of `depth` slots, picking at every step a
/// random rank whose next action can run: whether the schedules finish whatever the relative speed of
/// the ranks (the simulator always runs ranks in one fixed order).
fn finishes_under_any_timing(plans: &[Vec<Action>], depth: usize, mut seed: u64) -> bool {
    let n = plans.len();
    let mut queued = vec![vec![0usize; n]; n];
    let mut pc = vec![0usize; n];
    loop {
        let ready: Vec<usize> = (0..n)
            .filter(|&r| {
                let has = |from: usize| queued[from][r] > 0;
                let room = |to: usize| queued[r][to] < depth;
                match plans[r].get(pc[r]) {
                    None => false,
                    Some(
                        Action::Send { to, .. }
                        | Action::SendAcc { to, .. }
                        | Action::SendScratch { to, .. },
                    ) => room(*to),
                    Some(Action::RecvReduceSend { from, to, .. }) => has(*from) && room(*to),
                    Some(
                        Action::RecvReduceFinal { from, forward, .. }
                        | Action::RecvCopy { from, forward, .. },
                    ) => has(*from) && forward.is_none_or(room),
                    Some(Action::RecvCombine { from, .. }) => has(*from),
                    Some(Action::RecvReduceAll { .. }) => (0..n).filter(|&p| p != r).all(has),
                    Some(
                        Action::Copy { .. } | Action::LoadAcc { .. } | Action::FinishScratch { .. },
                    ) => true,
                }
            })
            .collect();
        if ready.is_empty() {
            return (0..n).all(|r| pc[r] == plans[r].len());
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let r = ready[(seed % ready.len() as u64) as usize];
        let (from, to) = match &plans[r][pc[r]] {
            Action::Send { to, .. }
            | Action::SendAcc { to, .. }
            | Action::SendScratch { to, .. } => (None, Some(*to)),
            Action::RecvReduceSend { from, to, .. } => (Some(*from), Some(*to)),
            Action::RecvReduceFinal { from, forward, .. }
            | Action::RecvCopy { from, forward, .. } => (Some(*from), *forward),
            Action::RecvCombine { from, .. } => (Some(*from), None),
            _ => (None, None),
        };
        if let Some(f) = from {
            queued[f][r] -= 1;
        }
        if let Some(t) = to {
            queued[r][t] += 1;
        }
        pc[r] += 1;
    }
}

fn hier_plans(hosts: &[Vec<usize>], count: usize, chunk: usize) -> Vec<Vec<Action>> {
    plans(world(hosts), |r| hier::all_reduce(hosts, r, count, chunk))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn hier_all_reduce_exact(dtype in dtypes(), op in ops(), hosts in uniform_hosts(),
        count in 0usize..300, chunk in 1usize..40, depth in 2usize..=3, seed in any::<u64>()) {
        let n = world(&hosts);
        let ins = exact_inputs(dtype, op, n, count, seed);
        let want = reference(dtype, op, &ins);
        let p = hier_plans(&hosts, count, chunk);
        prop_assert!(messages_fit(&p, chunk));
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        for o in &out.outputs {
            prop_assert_eq!(o, &want);
        }
    }

    #[test]
    fn hier_all_reduce_uneven_hosts(dtype in dtypes(), op in ops(), hosts in uneven_hosts(),
        count in 0usize..300, chunk in 1usize..40, depth in 2usize..=3, seed in any::<u64>()) {
        let n = world(&hosts);
        let ins = exact_inputs(dtype, op, n, count, seed);
        let want = reference(dtype, op, &ins);
        let p = hier_plans(&hosts, count, chunk);
        prop_assert!(messages_fit(&p, chunk));
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        for o in &out.outputs {
            prop_assert_eq!(o, &want);
        }
    }

    #[test]
    fn hier_bit_identical_for_any_floats(hosts in uneven_hosts(), count in 1usize..300,
        chunk in 1usize..40, seed in any::<u64>(),
        op in prop::sample::select(vec![ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod, ReduceOp::Max])) {
        let n = world(&hosts);
        let ins = arbitrary_f32(n, count, seed);
        let out = sim::run(&hier_plans(&hosts, count, chunk), DType::F32, op, &ins, count, 2).unwrap();
        for o in &out.outputs[1..] {
            prop_assert_eq!(o, &out.outputs[0]);
        }
    }

    #[test]
    fn ordered_ring_exact_and_bit_identical(dtype in dtypes(), op in ops(), hosts in uneven_hosts(),
        count in 0usize..300, chunk in 1usize..40, depth in 2usize..=3, seed in any::<u64>()) {
        // The host-contiguous order of randomly numbered ranks: an arbitrary permutation.
        let order = hier::host_order(&hosts);
        let n = order.len();
        let ins = exact_inputs(dtype, op, n, count, seed);
        let want = reference(dtype, op, &ins);
        let p = plans(n, |r| ring::all_reduce_ordered(&order, r, count, chunk));
        prop_assert!(messages_fit(&p, chunk));
        let out = sim::run(&p, dtype, op, &ins, count, depth).unwrap();
        for o in &out.outputs {
            prop_assert_eq!(o, &want);
        }
        if count > 0 {
            let ins = arbitrary_f32(n, count, seed);
            let out = sim::run(&p, DType::F32, ReduceOp::Sum, &ins, count, 2).unwrap();
            for o in &out.outputs[1..] {
                prop_assert_eq!(o, &out.outputs[0]);
            }
        }
    }

    #[test]
    fn ordered_reduce_scatter_and_all_gather(dtype in dtypes(), op in ops(), hosts in uneven_hosts(),
        rc in 0usize..60, chunk in 1usize..20, depth in 2usize..=3, seed in any::<u64>()) {
        let order = hier::host_order(&hosts);
        let n = order.len();
        let es = dtype.size();
        let ins = exact_inputs(dtype, op, n, n * rc, seed);
        let want = reference(dtype, op, &ins);
        let p = plans(n, |r| ring::reduce_scatter_ordered(&order, r, rc, chunk));
        let out = sim::run(&p, dtype, op, &ins, rc, depth).unwrap();
        for (r, o) in out.outputs.iter().enumerate() {
            prop_assert_eq!(&o[..], &want[r * rc * es..(r + 1) * rc * es]);
        }
        let blocks: Vec<Vec<u8>> = (0..n).map(|r| ins[r][..rc * es].to_vec()).collect();
        let p = plans(n, |r| ring::all_gather_ordered(&order, r, rc, chunk));
        let out = sim::run(&p, dtype, op, &blocks, n * rc, depth).unwrap();
        let want: Vec<u8> = blocks.concat();
        for o in &out.outputs {
            prop_assert_eq!(o, &want);
        }
    }

    #[test]
    fn traffic_matches_the_simulator(hosts in uneven_hosts(), count in 0usize..400, chunk in 1usize..50,
        dtype in prop::sample::select(vec![DType::F32, DType::BF16, DType::I8, DType::F64])) {
        let n = world(&hosts);
        let (es, acc) = (dtype.size(), dtype.accumulator().size());
        let ins = exact_inputs(dtype, ReduceOp::Sum, n, count, 7);
        let order = hier::host_order(&hosts);
        let flat = plans(n, |r| ring::all_reduce_ordered(&order, r, count, chunk));
        for (p, traffic) in [
            (hier_plans(&hosts, count, chunk), hier_traffic as fn(&[Vec<usize>], usize, usize, usize, usize, usize) -> _),
            (flat, flat_ring_traffic),
        ] {
            let out = sim::run(&p, dtype, ReduceOp::Sum, &ins, count, 2).unwrap();
            for r in 0..n {
                let t = traffic(&hosts, r, count, es, acc, chunk);
                let h = host_of(&hosts, r);
                let away: usize = (0..n).filter(|&b| host_of(&hosts, b) != h).map(|b| out.link_bytes[r][b]).sum();
                prop_assert_eq!(
                    (t.messages, t.bytes, t.inter_host_bytes),
                    (out.messages[r], out.bytes_sent[r], away),
                    "rank {} of {:?}", r, &hosts
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// `plan` for every all-reduce algorithm, on one host (with channels) or several, is exact, and
    /// `cost::traffic` counts what it sends, and how much of it leaves the host, as the simulator does.
    #[test]
    fn planned_all_reduce_and_its_traffic(hosts in uneven_hosts(), count in 0usize..300,
        chunk in 1usize..40, channels in 1usize..=3, flat in any::<bool>(),
        dtype in prop::sample::select(vec![DType::F32, DType::BF16, DType::I8])) {
        let n = world(&hosts);
        let (es, acc) = (dtype.size(), dtype.accumulator().size());
        let op = ReduceOp::Sum;
        let ins = exact_inputs(dtype, op, n, count, 11);
        let want = reference(dtype, op, &ins);
        // A flat world: no hosts given, or all ranks on one.
        let one = [(0..n).collect::<Vec<_>>()];
        let layout: &[Vec<usize>] = if flat { &one } else { &hosts };
        for &algo in Collective::AllReduce.algos() {
            let spec = |rank| PlanSpec {
                collective: Collective::AllReduce,
                root: 0,
                algo,
                world: n,
                rank,
                count,
                chunk,
                hosts: layout,
                channels,
            };
            let p = plans(n, |r| plan(&spec(r)));
            let out = sim::run(&p, dtype, op, &ins, count, 2).unwrap();
            for r in 0..n {
                prop_assert_eq!(&out.outputs[r], &want, "{} rank {}", algo, r);
                let t = traffic(&spec(r), es, acc);
                let h = host_of(layout, r);
                let away: usize = (0..n).filter(|&b| host_of(layout, b) != h).map(|b| out.link_bytes[r][b]).sum();
                prop_assert_eq!(
                    (t.messages, t.bytes, t.inter_host_bytes),
                    (out.messages[r], out.bytes_sent[r], away),
                    "{} rank {} of {:?}", algo, r, layout
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn hier_never_deadlocks_with_two_slots(hosts in uneven_hosts(), count in 0usize..300,
        chunk in 1usize..40, seed in any::<u64>()) {
        let p = hier_plans(&hosts, count, chunk);
        for k in 0..8u64 {
            prop_assert!(finishes_under_any_timing(&p, 2, (seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1));
        }
    }
}

#[test]
fn random_timing_catches_a_deadlock() {
    // Two ranks that both send twice before receiving need three slots: the checker must say so.
    let p: Vec<Vec<Action>> = (0..2)
        .map(|r| {
            let send = Action::SendAcc {
                to: 1 - r,
                range: 0..1,
            };
            let recv = Action::RecvCombine {
                from: 1 - r,
                range: 0..1,
            };
            vec![
                send.clone(),
                send.clone(),
                send,
                recv.clone(),
                recv.clone(),
                recv,
            ]
        })
        .collect();
    assert!(!finishes_under_any_timing(&p, 2, 5));
    assert!(finishes_under_any_timing(&p, 3, 5));
}

#[test]
fn hier_crosses_hosts_less_than_the_flat_ring() {
    for nh in 2..=4 {
        for l in 2..=4 {
            let n = nh * l;
            // Ranks dealt round-robin over the hosts, so no host holds consecutive numbers.
            let hosts: Vec<Vec<usize>> = (0..nh)
                .map(|h| (0..l).map(|i| i * nh + h).collect())
                .collect();
            for count in [n, 3 * n + 1, 97, 300] {
                for chunk in [1, 8, 1000] {
                    let ins = exact_inputs(DType::F32, ReduceOp::Sum, n, count, 3);
                    let h = sim::run(
                        &hier_plans(&hosts, count, chunk),
                        DType::F32,
                        ReduceOp::Sum,
                        &ins,
                        count,
                        2,
                    )
                    .unwrap();
                    let order = hier::host_order(&hosts);
                    let flat = plans(n, |r| ring::all_reduce_ordered(&order, r, count, chunk));
                    let f = sim::run(&flat, DType::F32, ReduceOp::Sum, &ins, count, 2).unwrap();
                    let (hx, fx) = (crossing(&hosts, &h), crossing(&hosts, &f));
                    assert!(
                        hx < fx,
                        "{nh} hosts of {l}, count {count}, chunk {chunk}: hier {hx} vs flat {fx}"
                    );
                    // Exactly (H-1)·count·(elem + acc) for the hierarchical schedule.
                    assert_eq!(hx, (nh - 1) * count * 8);
                    // And the identity-numbered flat ring (no topology) crosses even more.
                    let naive = plans(n, |r| ring::all_reduce(n, r, count, chunk));
                    let naive =
                        sim::run(&naive, DType::F32, ReduceOp::Sum, &ins, count, 2).unwrap();
                    assert!(fx <= crossing(&hosts, &naive));
                }
            }
        }
    }
}

#[test]
fn every_small_layout_and_count() {
    // Exhaustive over host sizes 1..=3 on up to 3 hosts, the small counts that leave shards or
    // segments empty, and one-element chunks.
    let mut sizes_list = vec![];
    for a in 1..=3 {
        sizes_list.push(vec![a]);
        for b in 1..=3 {
            sizes_list.push(vec![a, b]);
            for c in 1..=3 {
                sizes_list.push(vec![a, b, c]);
            }
        }
    }
    for sizes in sizes_list {
        let n: usize = sizes.iter().sum();
        // Reverse numbering: host 0 holds the highest ranks.
        let perm: Vec<usize> = (0..n).rev().collect();
        let hosts = layout(&sizes, &perm);
        for count in [0, 1, 2, 3, n - 1, n, n + 1, 2 * n + 3, 41] {
            for chunk in [1, 2, 7] {
                let (dtype, op) = (DType::BF16, ReduceOp::Avg);
                let ins = exact_inputs(dtype, op, n, count, (n * 1000 + count) as u64);
                let want = reference(dtype, op, &ins);
                let out = sim::run(&hier_plans(&hosts, count, chunk), dtype, op, &ins, count, 2)
                    .unwrap_or_else(|e| panic!("{hosts:?} count {count} chunk {chunk}: {e}"));
                assert!(
                    out.outputs.iter().all(|o| o == &want),
                    "{hosts:?} {count} {chunk}"
                );
            }
        }
    }
}

#[test]
fn degenerate_layouts_are_rings() {
    let hosts = vec![vec![2, 0, 1]];
    for r in 0..3 {
        assert_eq!(
            hier::all_reduce(&hosts, r, 10, 3),
            ring::all_reduce_ordered(&[2, 0, 1], r, 10, 3)
        );
    }
    let hosts = vec![vec![1], vec![3], vec![0], vec![2]];
    for r in 0..4 {
        assert_eq!(
            hier::all_reduce(&hosts, r, 10, 3),
            ring::all_reduce_ordered(&[1, 3, 0, 2], r, 10, 3)
        );
    }
    // Nothing to send for an empty buffer.
    let hosts = vec![vec![0, 1], vec![2, 3]];
    assert!((0..4).all(|r| hier::all_reduce(&hosts, r, 0, 4).is_empty()));
    assert_eq!(hier::shards(&[vec![0, 1, 2], vec![3]]), 1);
}

#[test]
#[should_panic(expected = "exactly once")]
fn a_rank_listed_twice_is_refused() {
    hier::all_reduce(&[vec![0, 1], vec![1, 2]], 0, 10, 4);
}

#[test]
#[should_panic(expected = "not a permutation")]
fn an_order_that_is_not_a_permutation_is_refused() {
    ring::all_reduce_ordered(&[0, 2, 2], 0, 10, 4);
}

fn links(beta_x: f64, alpha_x: f64) -> HostLinks {
    HostLinks {
        intra_alpha_us: 0.5,
        intra_beta_us_per_byte: 1e-4,
        inter_alpha_us: alpha_x,
        inter_beta_us_per_byte: beta_x,
        gamma_us_per_byte: 1e-5,
    }
}

#[test]
fn cost_model_prefers_hier_on_a_slow_network() {
    let slow = links(1e-2, 20.0);
    for (nh, l) in [(2, 2), (2, 8), (4, 4), (8, 8)] {
        let sizes = vec![l; nh];
        for bytes in [4096, 1 << 20, 64 << 20] {
            let flat = flat_ring_cost(&sizes, bytes, 1.0, 1 << 17, &slow);
            let hier = hier_cost(&sizes, bytes, 1.0, 1 << 17, &slow);
            assert!(hier < flat, "{nh}x{l} {bytes}: hier {hier} flat {flat}");
        }
        // Bandwidth-bound: the ratio approaches the host-link volumes' ratio n(H-1)/(H(n-1)).
        let bytes = 256 << 20;
        let link_only = HostLinks {
            intra_alpha_us: 0.0,
            inter_alpha_us: 0.0,
            intra_beta_us_per_byte: 1e-7,
            gamma_us_per_byte: 0.0,
            ..slow
        };
        let ratio = hier_cost(&sizes, bytes, 1.0, 1 << 16, &link_only)
            / flat_ring_cost(&sizes, bytes, 1.0, 1 << 16, &link_only);
        let (h, n) = (nh as f64, (nh * l) as f64);
        let want = n * (h - 1.0) / (h * (n - 1.0));
        assert!(
            (ratio - want).abs() < 0.02 * want,
            "{nh}x{l}: {ratio} vs {want}"
        );
    }
}

#[test]
fn cost_model_degenerate_cases() {
    let l = links(1e-3, 10.0);
    // One rank: nothing to do. One host: the flat ring on host-local links, as the existing ring model.
    assert_eq!(flat_ring_cost(&[1], 1000, 1.0, 100, &l), 0.0);
    assert_eq!(hier_cost(&[1], 1000, 1.0, 100, &l), 0.0);
    let one_host = hier_cost(&[4], 1 << 20, 2.0, 1 << 16, &l);
    let one_class = braid_sched::cost::LinkCost {
        alpha_us: l.intra_alpha_us,
        beta_us_per_byte: l.intra_beta_us_per_byte,
        gamma_us_per_byte: l.gamma_us_per_byte,
    };
    let ring = braid_sched::cost::all_reduce_cost(
        braid_sched::Algo::Ring,
        4,
        1 << 20,
        2.0,
        1 << 16,
        &one_class,
    );
    assert!(
        (one_host - ring).abs() < 1e-9 * ring,
        "{one_host} vs {ring}"
    );
    // One rank per host: hier is the flat ring, on the network links.
    assert_eq!(
        hier_cost(&[1, 1, 1], 1 << 20, 1.0, 1 << 16, &l),
        flat_ring_cost(&[1, 1, 1], 1 << 20, 1.0, 1 << 16, &l)
    );
    // When the network is as fast as the host, the flat ring costs what the one-class ring model says.
    let even = HostLinks {
        inter_alpha_us: l.intra_alpha_us,
        inter_beta_us_per_byte: l.intra_beta_us_per_byte,
        ..l
    };
    let flat = flat_ring_cost(&[8, 8], 64 << 20, 2.0, 1 << 17, &even);
    let ring16 = braid_sched::cost::all_reduce_cost(
        braid_sched::Algo::Ring,
        16,
        64 << 20,
        2.0,
        1 << 17,
        &one_class,
    );
    assert!((flat - ring16).abs() < 1e-9 * ring16, "{flat} vs {ring16}");
    // More bytes never cost less.
    for sizes in [vec![2, 2], vec![4, 4, 4], vec![1, 3]] {
        let small = hier_cost(&sizes, 1 << 10, 1.0, 1 << 12, &l);
        let large = hier_cost(&sizes, 1 << 24, 1.0, 1 << 12, &l);
        assert!(small > 0.0 && small < large, "{sizes:?}");
    }
}
