//! Top-k's sparse all-reduce on 4, 16 and 64 simulated ranks, run with the real executor over the
//! in-memory network: the reduce-scatter way (route the pairs by range, exchange them, sum each range
//! in rank order with its second error buffer, keep the quota, gather what was kept) against a plain
//! dense reference, with every rank's bytes exactly what `braid_sched::sparse` says; the all-gather way
//! and a dense ring beside it, also to the byte. `cargo test -p braid-exec --test sparse -- --nocapture`
//! prints the bytes per rank of the three ways.

use std::ops::Range;

use braid_core::{DType, ReduceOp};
use braid_exec::sim;
use braid_sched::sparse::{
    all_gather_bytes, dense_ring_bytes, quota, reduce_scatter_bytes, Partition, COUNT_BYTES,
    GATHER_HEADER_BYTES, HISTOGRAM_BUCKETS, LOAD_BYTES, PAIR_BYTES, ROUTE_BYTES,
};
use braid_sched::{direct, ring, Action};
use proptest::prelude::*;

/// Bytes per message in the simulated network.
const CHUNK: usize = 4096;

fn mix(rank: usize, step: u64, i: usize) -> u64 {
    let mut z = ((rank as u64) << 40) ^ (step << 32) ^ i as u64;
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A gradient whose large values crowd into one band (`len/8..len/4`), as a layer with large gradients
/// would: an even partition puts most of the load on one rank.
fn gradient(rank: usize, step: u64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let u = (mix(rank, step, i) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if (len / 8..len / 4).contains(&i) {
                u * 16.0
            } else {
                u
            }
        })
        .collect()
}

/// The ascending indices of the `k` largest magnitudes, ties to the lower index.
fn top_k(v: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..v.len() as u32).collect();
    order.sort_by(|&a, &b| {
        v[b as usize]
            .abs()
            .total_cmp(&v[a as usize].abs())
            .then(a.cmp(&b))
    });
    order.truncate(k);
    order.sort();
    order
}

/// Runs one collective of byte blocks on every rank; the outputs and each rank's bytes sent.
fn exchange(plans: &[Vec<Action>], inputs: &[Vec<u8>], out: usize) -> (Vec<Vec<u8>>, Vec<usize>) {
    let o = sim::run(plans, DType::U8, ReduceOp::Sum, inputs, out, 2).expect("simulated exchange");
    (o.outputs, o.bytes_sent)
}

fn u64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn le(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A block of pairs: the indices (u32) then the values (f32).
fn pairs(idx: &[u32], val: &[f32]) -> Vec<u8> {
    let mut b: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
    b.extend(val.iter().flat_map(|v| v.to_le_bytes()));
    b
}

fn unpairs(b: &[u8]) -> Vec<(usize, f32)> {
    let k = b.len() / 8;
    (0..k)
        .map(|e| {
            let i = u32::from_le_bytes(b[4 * e..4 * e + 4].try_into().unwrap()) as usize;
            let v = f32::from_le_bytes(b[4 * (k + e)..4 * (k + e) + 4].try_into().unwrap());
            (i, v)
        })
        .collect()
}

/// Consecutive ranges of these lengths.
fn consecutive(lens: impl IntoIterator<Item = usize>) -> Vec<Range<usize>> {
    let mut at = 0;
    lens.into_iter()
        .map(|l| {
            let r = at..at + l;
            at = r.end;
            r
        })
        .collect()
}

/// Consecutive byte ranges of `counts[p]` pairs.
fn blocks(counts: &[u64]) -> Vec<Range<usize>> {
    consecutive(counts.iter().map(|&c| 8 * c as usize))
}

/// One rank of the simulated scheme: what it keeps between steps.
struct Rank {
    /// Local error feedback.
    error: Vec<f32>,
    /// The partition it computed (every rank's must be the same).
    partition: Partition,
    /// The second error buffer of its range.
    server: Vec<f32>,
}

/// The dense reference: the same algorithm on whole tensors, with no pairs and no network.
struct Reference {
    errors: Vec<Vec<f32>>,
    /// Every range's second error buffer, as one tensor.
    server: Vec<f32>,
    partition: Partition,
}

/// What one step of the simulated scheme measured.
struct Step {
    result: Vec<Vec<f32>>,
    bytes: Vec<u64>,
    want_bytes: Vec<u64>,
    loads: Vec<u64>,
    counts: Vec<u64>,
}

/// One step of the reduce-scatter way on `ranks`, every exchange through the simulator.
fn simulated_step(ranks: &mut [Rank], grads: &[Vec<f32>], k: usize) -> Step {
    let n = ranks.len();
    let len = grads[0].len();
    // Local error feedback and top-k.
    let mut sel: Vec<(Vec<u32>, Vec<f32>)> = Vec::new();
    for (r, g) in ranks.iter_mut().zip(grads) {
        let residual: Vec<f32> = g.iter().zip(&r.error).map(|(g, e)| g + 1.0 * e).collect();
        let idx = top_k(&residual, k);
        let val: Vec<f32> = idx.iter().map(|&i| residual[i as usize]).collect();
        r.error = residual;
        for &i in &idx {
            r.error[i as usize] = 0.0;
        }
        sel.push((idx, val));
    }
    let mut bytes = vec![0u64; n];
    let add = |bytes: &mut Vec<u64>, sent: Vec<usize>| {
        bytes.iter_mut().zip(sent).for_each(|(b, s)| *b += s as u64)
    };
    // Counts, all-gathered.
    let plans: Vec<_> = (0..n).map(|r| direct::all_gather(n, r, 8, CHUNK)).collect();
    let ins: Vec<_> = sel.iter().map(|s| le(&[s.0.len() as u64])).collect();
    let (outs, sent) = exchange(&plans, &ins, 8 * n);
    add(&mut bytes, sent);
    let counts = u64s(&outs[0]);
    assert!(outs.iter().all(|o| u64s(o) == counts));
    // Routes and fingerprints, all-to-all.
    let routes: Vec<Vec<Range<usize>>> = (0..n)
        .map(|r| ranks[r].partition.route(&sel[r].0))
        .collect();
    let plans: Vec<_> = (0..n)
        .map(|r| direct::all_to_all(n, r, 16, CHUNK))
        .collect();
    let ins: Vec<_> = (0..n)
        .map(|r| {
            let fp = ranks[r].partition.fingerprint();
            le(&routes[r]
                .iter()
                .flat_map(|x| [x.len() as u64, fp])
                .collect::<Vec<_>>())
        })
        .collect();
    let (outs, sent) = exchange(&plans, &ins, 16 * n);
    add(&mut bytes, sent);
    let incoming: Vec<Vec<u64>> = (0..n)
        .map(|r| {
            let h = u64s(&outs[r]);
            assert!(h
                .chunks(2)
                .all(|c| c[1] == ranks[r].partition.fingerprint()));
            h.chunks(2).map(|c| c[0]).collect()
        })
        .collect();
    // The pairs to their owners.
    let send_blocks: Vec<Vec<Range<usize>>> = routes
        .iter()
        .map(|rt| blocks(&rt.iter().map(|x| x.len() as u64).collect::<Vec<_>>()))
        .collect();
    let recv_blocks: Vec<Vec<Range<usize>>> = incoming.iter().map(|c| blocks(c)).collect();
    let plans: Vec<_> = (0..n)
        .map(|r| direct::all_to_all_v(n, r, &send_blocks[r], &recv_blocks[r], CHUNK))
        .collect();
    let ins: Vec<Vec<u8>> = (0..n)
        .map(|r| {
            routes[r]
                .iter()
                .flat_map(|x| pairs(&sel[r].0[x.clone()], &sel[r].1[x.clone()]))
                .collect()
        })
        .collect();
    let most = recv_blocks.iter().map(|b| b[n - 1].end).max().unwrap_or(0);
    let (outs, sent) = exchange(&plans, &ins, most);
    add(&mut bytes, sent);
    // Each owner: the rank-ordered sum of its range plus its second buffer; keep the quota.
    let mut kept = Vec::new();
    let mut load_msgs = Vec::new();
    for (r, rank) in ranks.iter_mut().enumerate() {
        let own = rank.partition.range(r);
        let mut sum = vec![0.0f32; own.len()];
        let mut hist = [0u64; HISTOGRAM_BUCKETS];
        for b in &recv_blocks[r] {
            let got = unpairs(&outs[r][b.clone()]);
            for &(i, v) in &got {
                assert!(own.contains(&i));
                sum[i - own.start] += v;
            }
            let h = rank.partition.histogram(r, got.iter().map(|p| p.0 as u32));
            hist.iter_mut().zip(h).for_each(|(a, x)| *a += x);
        }
        let residual: Vec<f32> = sum
            .iter()
            .zip(&rank.server)
            .map(|(s, e)| s + 1.0 * e)
            .collect();
        let q = quota(incoming[r].iter().sum(), n, own.len());
        let keep = top_k(&residual, q as usize);
        let val: Vec<f32> = keep.iter().map(|&i| residual[i as usize]).collect();
        rank.server = residual;
        for &i in &keep {
            rank.server[i as usize] = 0.0;
        }
        let global: Vec<u32> = keep.iter().map(|i| i + own.start as u32).collect();
        kept.push(pairs(&global, &val));
        let mut msg = vec![q];
        msg.extend(hist);
        load_msgs.push(le(&msg));
    }
    // Quotas and loads, all-gathered.
    let plans: Vec<_> = (0..n)
        .map(|r| direct::all_gather(n, r, LOAD_BYTES as usize, CHUNK))
        .collect();
    let (outs, sent) = exchange(&plans, &load_msgs, LOAD_BYTES as usize * n);
    add(&mut bytes, sent);
    let loads = u64s(&outs[0]);
    assert!(outs.iter().all(|o| u64s(o) == loads));
    let quotas: Vec<u64> = loads.chunks(1 + HISTOGRAM_BUCKETS).map(|l| l[0]).collect();
    let histogram: Vec<u64> = loads
        .chunks(1 + HISTOGRAM_BUCKETS)
        .flat_map(|l| l[1..].to_vec())
        .collect();
    // The kept pairs, all-gathered and decoded in rank order.
    let gathered = blocks(&quotas);
    let plans: Vec<_> = (0..n)
        .map(|r| direct::all_gather_v(n, r, &gathered, CHUNK))
        .collect();
    let (outs, sent) = exchange(&plans, &kept, gathered[n - 1].end);
    add(&mut bytes, sent);
    let mut result = Vec::new();
    for (r, rank) in ranks.iter().enumerate() {
        let mut x = vec![0.0f32; len];
        for (p, b) in gathered.iter().enumerate() {
            for (i, v) in unpairs(&outs[r][b.clone()]) {
                assert!(rank.partition.range(p).contains(&i));
                x[i] = v;
            }
        }
        result.push(x);
    }
    let want_bytes: Vec<u64> = (0..n)
        .map(|r| reduce_scatter_bytes(n, (sel[r].0.len() - routes[r][r].len()) as u64, quotas[r]))
        .collect();
    // The next partition, on every rank from what it received; what leaves a range goes back to the
    // owner's local error buffer.
    for (r, rank) in ranks.iter_mut().enumerate() {
        let next = rank.partition.rebalance(&histogram);
        let (old, new) = (rank.partition.range(r), next.range(r));
        let mut server = vec![0.0f32; new.len()];
        for (i, e) in old.zip(&rank.server) {
            if new.contains(&i) {
                server[i - new.start] = *e;
            } else {
                rank.error[i] += *e;
            }
        }
        rank.server = server;
        rank.partition = next;
    }
    let loads = (0..n)
        .map(|j| {
            histogram[j * HISTOGRAM_BUCKETS..][..HISTOGRAM_BUCKETS]
                .iter()
                .sum()
        })
        .collect();
    Step {
        result,
        bytes,
        want_bytes,
        loads,
        counts,
    }
}

/// The same step on dense tensors: the result every rank must hold.
fn reference_step(re: &mut Reference, grads: &[Vec<f32>], k: usize) -> Vec<f32> {
    let n = grads.len();
    let len = grads[0].len();
    let mut updates = Vec::new();
    for (e, g) in re.errors.iter_mut().zip(grads) {
        let residual: Vec<f32> = g.iter().zip(e.iter()).map(|(g, e)| g + 1.0 * e).collect();
        let mut u = vec![0.0f32; len];
        for i in top_k(&residual, k) {
            u[i as usize] = residual[i as usize];
        }
        *e = residual.iter().zip(&u).map(|(r, u)| r - u).collect();
        updates.push(u);
    }
    // Rank-ordered sum of the sparse updates, and each range's load.
    let mut sum = vec![0.0f32; len];
    for u in &updates {
        sum.iter_mut().zip(u).for_each(|(s, x)| *s += x);
    }
    let mut out = vec![0.0f32; len];
    let mut histogram = Vec::new();
    for j in 0..n {
        let own = re.partition.range(j);
        let load: u64 = updates
            .iter()
            .map(|u| {
                // Selected pairs in the range (a selected value is never exactly zero here).
                u[own.clone()].iter().filter(|x| **x != 0.0).count() as u64
            })
            .sum();
        for s in re.partition.sub_ranges(j) {
            histogram.push(
                updates
                    .iter()
                    .map(|u| u[s.clone()].iter().filter(|x| **x != 0.0).count() as u64)
                    .sum(),
            );
        }
        let residual: Vec<f32> = own.clone().map(|i| sum[i] + 1.0 * re.server[i]).collect();
        for i in top_k(&residual, quota(load, n, own.len()) as usize) {
            out[own.start + i as usize] = residual[i as usize];
        }
        for (i, r) in own.clone().zip(&residual) {
            re.server[i] = r - out[i];
        }
    }
    let next = re.partition.rebalance(&histogram);
    for j in 0..n {
        let (old, new) = (re.partition.range(j), next.range(j));
        for i in old.filter(|i| !new.contains(i)) {
            re.errors[j][i] += re.server[i];
            re.server[i] = 0.0;
        }
    }
    re.partition = next;
    out
}

/// The all-gather way, simulated: the result and each rank's bytes.
fn all_gather_way(sel: &[(Vec<u32>, Vec<f32>)], len: usize) -> (Vec<Vec<f32>>, Vec<u64>) {
    let n = sel.len();
    let counts: Vec<u64> = sel.iter().map(|s| s.0.len() as u64).collect();
    let plans: Vec<_> = (0..n).map(|r| direct::all_gather(n, r, 8, CHUNK)).collect();
    let (_, sent) = exchange(
        &plans,
        &counts.iter().map(|c| le(&[*c])).collect::<Vec<_>>(),
        8 * n,
    );
    let most = *counts.iter().max().unwrap() as usize;
    let block = GATHER_HEADER_BYTES as usize + 8 * most;
    let ins: Vec<Vec<u8>> = sel
        .iter()
        .map(|(i, v)| {
            let mut b = vec![0u8; GATHER_HEADER_BYTES as usize];
            b.extend(pairs(i, v));
            b.resize(block, 0);
            b
        })
        .collect();
    let plans: Vec<_> = (0..n)
        .map(|r| ring::all_gather(n, r, block, CHUNK))
        .collect();
    let (outs, sent2) = exchange(&plans, &ins, block * n);
    let results = outs
        .iter()
        .map(|o| {
            let mut x = vec![0.0f32; len];
            for (p, s) in sel.iter().enumerate() {
                let at = p * block + GATHER_HEADER_BYTES as usize;
                for (i, v) in unpairs(&o[at..at + 8 * s.0.len()]) {
                    x[i] += v;
                }
            }
            x
        })
        .collect();
    (
        results,
        sent.iter()
            .zip(sent2)
            .map(|(a, b)| (a + b) as u64)
            .collect(),
    )
}

#[test]
fn reduce_scatter_way_on_4_16_and_64_ranks() {
    let len = 1 << 16;
    let k = 6554; // 10%
    println!(
        "# bytes per rank (the busiest), {len} f32 elements, top-k at 10% (k = {k}), simulated, \
         third step (partition balanced by the load histogram)"
    );
    println!(
        "# {:>5} {:>14} {:>16} {:>14} {:>12}",
        "ranks", "all-gather", "reduce-scatter", "dense ring", "rs / dense"
    );
    for n in [4, 16, 64] {
        let mut ranks: Vec<Rank> = (0..n)
            .map(|r| {
                let partition = Partition::even(len, n);
                Rank {
                    error: vec![0.0; len],
                    server: vec![0.0; partition.range(r).len()],
                    partition,
                }
            })
            .collect();
        let mut re = Reference {
            errors: vec![vec![0.0; len]; n],
            server: vec![0.0; len],
            partition: Partition::even(len, n),
        };
        let mut given = vec![0.0f64; len];
        let mut applied = vec![0.0f64; len];
        let mut imbalance = Vec::new();
        for step in 0..3u64 {
            let grads: Vec<Vec<f32>> = (0..n).map(|r| gradient(r, step, len)).collect();
            // The all-gather way and a dense ring on this step's selection (before the step changes
            // the error buffers): their bytes, and the all-gather's exact sum.
            let sel: Vec<(Vec<u32>, Vec<f32>)> = ranks
                .iter()
                .zip(&grads)
                .map(|(r, g)| {
                    let res: Vec<f32> = g.iter().zip(&r.error).map(|(g, e)| g + 1.0 * e).collect();
                    let idx = top_k(&res, k);
                    let val = idx.iter().map(|&i| res[i as usize]).collect();
                    (idx, val)
                })
                .collect();
            let want = reference_step(&mut re, &grads, k);
            let s = simulated_step(&mut ranks, &grads, k);
            for (r, x) in s.result.iter().enumerate() {
                assert!(
                    x.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{n} ranks, step {step}: rank {r} differs from the reference"
                );
            }
            assert_eq!(
                s.bytes, s.want_bytes,
                "{n} ranks, step {step}: bytes per rank"
            );
            assert!(s.counts.iter().all(|c| *c == k as u64));
            let kept = want.iter().filter(|x| **x != 0.0).count();
            assert!(
                kept <= k + n && kept >= k - n,
                "{n} ranks: kept {kept} of k = {k}"
            );
            // The second buffers and the local ones hold what was not applied.
            for (j, g) in grads.iter().flat_map(|g| g.iter().enumerate()) {
                given[j] += *g as f64;
            }
            want.iter()
                .enumerate()
                .for_each(|(j, x)| applied[j] += *x as f64);
            let mut left = vec![0.0f64; len];
            for (r, rank) in ranks.iter().enumerate() {
                rank.error
                    .iter()
                    .enumerate()
                    .for_each(|(j, e)| left[j] += *e as f64);
                let own = rank.partition.range(r);
                rank.server
                    .iter()
                    .zip(own)
                    .for_each(|(e, j)| left[j] += *e as f64);
            }
            for j in 0..len {
                let d = (applied[j] + left[j] - given[j]).abs();
                assert!(
                    d <= 1e-3 * (1.0 + given[j].abs()),
                    "{n} ranks, step {step}: mass at {j} off by {d}"
                );
            }
            let mean = s.loads.iter().sum::<u64>() as f64 / n as f64;
            imbalance.push(*s.loads.iter().max().unwrap() as f64 / mean);

            let (gathered, ag_bytes) = all_gather_way(&sel, len);
            let mut exact = vec![0.0f32; len];
            for (i, v) in &sel {
                for (&i, v) in i.iter().zip(v) {
                    exact[i as usize] += v;
                }
            }
            assert!(
                gathered.iter().all(|x| x == &exact),
                "{n} ranks: the all-gather way's sum"
            );
            let counts = vec![k as u64; n];
            assert!(
                ag_bytes.iter().all(|b| *b == all_gather_bytes(&counts)),
                "{n} ranks: {ag_bytes:?}"
            );
            assert_eq!(
                all_gather_bytes(&counts),
                (n as u64 - 1) * (COUNT_BYTES + GATHER_HEADER_BYTES + PAIR_BYTES * k as u64)
            );
            if step == 2 {
                let dense = dense_ring(&grads);
                assert!(
                    dense.iter().all(|b| *b == dense_ring_bytes(n, len)),
                    "{n} ranks: {dense:?}"
                );
                let rs = *s.bytes.iter().max().unwrap();
                println!(
                    "  {n:>5} {:>14} {:>16} {:>14} {:>11.3}",
                    ag_bytes[0],
                    rs,
                    dense[0],
                    rs as f64 / dense[0] as f64
                );
                // Flat in n once balanced: the busiest rank sends at most half again 2·8k bytes of
                // pairs, plus the fixed exchanges per peer.
                let fixed = (n as u64 - 1) * (COUNT_BYTES + ROUTE_BYTES + LOAD_BYTES);
                assert!(rs - fixed <= 24 * k as u64, "{n} ranks: {rs} bytes");
            }
        }
        // The first step's even partition puts the hot band on few ranks; the load histogram evens
        // it out from the second step on.
        println!("#   {n} ranks: busiest range / mean load per step: {imbalance:.2?}");
        assert!(imbalance[0] > 1.5, "{imbalance:?}");
        assert!(imbalance[1] < 1.3 && imbalance[2] < 1.3, "{imbalance:?}");
    }
}

/// Each rank's bytes in a simulated ring all-reduce of its gradient.
fn dense_ring(grads: &[Vec<f32>]) -> Vec<u64> {
    let n = grads.len();
    let len = grads[0].len();
    let ins: Vec<Vec<u8>> = grads
        .iter()
        .map(|g| g.iter().flat_map(|x| x.to_ne_bytes()).collect())
        .collect();
    let plans: Vec<_> = (0..n)
        .map(|r| ring::all_reduce(n, r, len, CHUNK / 4))
        .collect();
    let o = sim::run(&plans, DType::F32, ReduceOp::Sum, &ins, len, 2).unwrap();
    assert!(o.outputs.iter().all(|x| x == &o.outputs[0]));
    o.bytes_sent.iter().map(|b| *b as u64).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Blocks of any sizes (empty ones included) arrive where they belong, in any chunking, with one
    /// slot per channel, and each rank sends exactly its blocks' bytes.
    #[test]
    fn all_to_all_and_all_gather_of_any_sizes(world in 1usize..9, sizes in proptest::collection::vec(0usize..40, 81),
        chunk in 1usize..17, depth in 1usize..3, seed in any::<u8>()) {
        let size = |i: usize, j: usize| sizes[i * 9 + j];
        let byte = |i: usize, j: usize, e: usize| (i * 31 + j * 7 + e + seed as usize) as u8;
        let mut plans = Vec::new();
        let mut ins = Vec::new();
        let mut recvs = Vec::new();
        for r in 0..world {
            let send = consecutive((0..world).map(|j| size(r, j)));
            let recv = consecutive((0..world).map(|i| size(i, r)));
            plans.push(direct::all_to_all_v(world, r, &send, &recv, chunk));
            ins.push((0..world).flat_map(|j| (0..size(r, j)).map(move |e| byte(r, j, e))).collect::<Vec<u8>>());
            recvs.push(recv);
        }
        let most = recvs.iter().map(|r| r[world - 1].end).max().unwrap_or(0);
        let o = sim::run(&plans, DType::U8, ReduceOp::Sum, &ins, most, depth).unwrap();
        for (r, recv) in recvs.iter().enumerate() {
            for (i, block) in recv.iter().enumerate() {
                let got = &o.outputs[r][block.clone()];
                let want: Vec<u8> = (0..size(i, r)).map(|e| byte(i, r, e)).collect();
                prop_assert_eq!(got, &want[..], "rank {} from {}", r, i);
            }
            let off: usize = (0..world).filter(|&j| j != r).map(|j| size(r, j)).sum();
            prop_assert_eq!(o.bytes_sent[r], off);
        }
        // All-gather of any sizes: rank r's block is sizes[r].
        let gathered = consecutive((0..world).map(|r| size(r, r)));
        let plans: Vec<_> = (0..world).map(|r| direct::all_gather_v(world, r, &gathered, chunk)).collect();
        let ins: Vec<Vec<u8>> = (0..world).map(|r| (0..size(r, r)).map(|e| byte(r, r, e)).collect()).collect();
        let o = sim::run(&plans, DType::U8, ReduceOp::Sum, &ins, gathered[world - 1].end, depth).unwrap();
        let want: Vec<u8> = ins.concat();
        for r in 0..world {
            prop_assert_eq!(&o.outputs[r][..want.len()], &want[..]);
            prop_assert_eq!(o.bytes_sent[r], (world - 1) * size(r, r));
        }
    }
}

#[test]
fn a_receiver_expecting_another_size_is_a_mismatch() {
    // Rank 1 expects 3 bytes from rank 0, which sends 5: the receive names the size, not a hang.
    let p = vec![
        direct::all_to_all_v(2, 0, &[0..0, 0..5], &[0..0, 0..0], 64),
        direct::all_to_all_v(2, 1, &[0..0, 0..0], &[0..3, 3..3], 64),
    ];
    let ins = [vec![1; 5], vec![]];
    let report = sim::simulate(&sim::Job::new(&p, DType::U8, ReduceOp::Sum, &ins, 5, 1)).unwrap();
    match &report.results[1] {
        Some(Err(braid_core::Error::Mismatch {
            peer: 0, detail, ..
        })) => assert!(
            detail.contains("received 5 bytes where 3 were expected"),
            "{detail}"
        ),
        other => panic!("{other:?}"),
    }
}
