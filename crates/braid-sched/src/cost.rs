//! An alpha-beta-gamma cost model of the all-reduce schedules, and the exact traffic each one sends.
//!
//! A message of `s` bytes costs `α + s·β` on the path it is on, and combining a partial costs `γ` per
//! accumulator byte. Partials weigh `acc_bytes_factor` times the data (2 for f16/bf16, which accumulate
//! in f32), and a message carries at most one slot (`chunk_bytes`) of partials: a range needs
//! `⌈partial bytes / chunk_bytes⌉` messages. With `n` ranks and `B` bytes (`f` the factor):
//!
//! - ring: each of `k = ⌈fB/n / chunk_bytes⌉` chunk positions goes once around the ring, `n−1` partial
//!   hops (each combined) then `n−1` result hops: `2(n−1)k·α + (n−1)/n·B·((1+f)β + fγ)`.
//! - tree: each half takes `k = ⌈fB/2 / chunk_bytes⌉` chunks. The first crosses the height `h` up and
//!   down (`2h` hops, each node combining two children), then the pipeline delivers one chunk per
//!   period, the time the busiest rank spends per chunk position on both trees (its messages, bytes
//!   sent and bytes combined).
//! - rhd: `log2 p` exchanges of halving sizes, each in pieces, combined on the way down and copied on
//!   the way back (`p` the largest power of two `≤ n`), plus the fold in and out for the `n − p` extra
//!   ranks. Not pipelined: the steps add up.
//! - direct: `⌈fB / chunk_bytes⌉` rounds of one hop; each rank sends `B` to `n−1` peers and combines
//!   `n−1` contributions.
//!
//! The model ranks algorithms; its absolute numbers are only as good as `α`, `β` and `γ`.
//!
//! Across hosts there are two link classes ([`HostLinks`]): [`flat_ring_cost`] and [`hier_cost`] model
//! the flat ring and the hierarchical all-reduce on them, and [`flat_ring_traffic`] and
//! [`hier_traffic`] count what each rank sends and how much of it leaves its host. [`traffic`] picks
//! among these the way [`crate::plan`] picks the schedule.

use crate::{chunks_needed, hier, partition, rhd, tree, Algo, Collective, PlanSpec};

/// Costs of one link, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkCost {
    /// Latency of one message.
    pub alpha_us: f64,
    /// Time per byte moved between ranks.
    pub beta_us_per_byte: f64,
    /// Time per (accumulator) byte reduced.
    pub gamma_us_per_byte: f64,
}

/// The modelled time, in microseconds, of an all-reduce of `bytes` bytes on `world` ranks with
/// algorithm `algo` on one class of links. [`Algo::Hier`] needs the hosts (see [`hier_cost`]) and
/// costs infinity here, so a selector never picks it on this model. Partials weigh `acc_bytes_factor`
/// times the data; a message carries at most `chunk_bytes` bytes of partials. One rank costs nothing.
pub fn all_reduce_cost(
    algo: Algo,
    world: usize,
    bytes: usize,
    acc_bytes_factor: f64,
    chunk_bytes: usize,
    link: &LinkCost,
) -> f64 {
    if algo == Algo::Hier {
        return f64::INFINITY;
    }
    if world <= 1 {
        return 0.0;
    }
    let (a, be, g) = (link.alpha_us, link.beta_us_per_byte, link.gamma_us_per_byte);
    let (n, b, f) = (world as f64, bytes as f64, acc_bytes_factor);
    let slot = chunk_bytes.max(1) as f64;
    // Messages for a range of `partial` accumulator bytes (at least one).
    let msgs = |partial: f64| (partial / slot).ceil().max(1.0);
    match algo {
        Algo::Ring => {
            let k = msgs(b * f / n);
            2.0 * (n - 1.0) * k * a + (n - 1.0) / n * b * ((1.0 + f) * be + f * g)
        }
        Algo::Tree => {
            let k = msgs(b * f / 2.0);
            let (sp, sd) = (b * f / 2.0 / k, b / 2.0 / k);
            let h = tree::height(world) as f64;
            let fill = h * (a + sp * be + 2.0 * sp * g) + h * (a + sd * be);
            let period = (0..world)
                .map(|r| {
                    tree::double_tree(world, r)
                        .iter()
                        .map(|node| {
                            let up = if node.parent.is_some() { 1.0 } else { 0.0 };
                            let kids = node.children.len() as f64;
                            up * (a + sp * be) + kids * (a + sd * be + sp * g)
                        })
                        .sum::<f64>()
                })
                .fold(0.0, f64::max);
            // Interior nodes accumulate in scratch: one more pass over the data.
            fill + (k - 1.0) * period + b * f * g
        }
        Algo::Rhd => {
            let p = rhd::fold_size(world);
            let mut t = 0.0;
            let mut part = b;
            for _ in 0..p.trailing_zeros() {
                part /= 2.0;
                t += 2.0 * msgs(part * f) * a + part * (f * be + f * g) + part * be;
            }
            if p < world {
                t += 2.0 * msgs(b * f) * a + b * (f * be + f * g) + b * be;
            }
            // The whole buffer is loaded into scratch first and is not pipelined with the exchanges.
            t + b * f * g
        }
        Algo::Direct => msgs(b * f) * a + (n - 1.0) * b * (be + f * g),
        Algo::Hier => unreachable!("costed above"),
    }
}

/// What rank `rank` sends in the flat all-reduce schedule `algo` of `count` elements of `elem_bytes`
/// bytes (partials `acc_bytes`), `chunk` elements per message: `(messages, payload bytes)`, exactly as
/// the schedule's actions do. On a flat world [`Algo::Hier`] is the ring, as [`crate::plan`] runs it;
/// the ring is the single-channel one ([`traffic`] counts channels and hosts).
///
/// # Panics
///
/// On a rank outside the world or a zero chunk.
pub fn all_reduce_traffic(
    algo: Algo,
    world: usize,
    rank: usize,
    count: usize,
    elem_bytes: usize,
    acc_bytes: usize,
    chunk: usize,
) -> (usize, usize) {
    flat_sends(algo, world, rank, count, elem_bytes, acc_bytes, chunk, 1)
        .into_iter()
        .fold((0, 0), |(m, b), s| (m + s.messages, b + s.bytes))
}

/// What rank `spec.rank` sends in the all-reduce schedule that [`crate::plan`] builds for `spec`
/// (`count` elements of `elem_bytes` bytes, partials of `acc_bytes`): across several hosts the ring
/// host by host ([`flat_ring_traffic`]) or the hierarchical schedule ([`hier_traffic`]), the others
/// as on a flat world with the bytes to other hosts counted; on one host the ring on
/// `spec.channels` rings, and [`Algo::Hier`] as the single ring.
///
/// # Panics
///
/// If `spec.collective` is not all-reduce, and as [`crate::plan`].
pub fn traffic(spec: &PlanSpec<'_>, elem_bytes: usize, acc_bytes: usize) -> Traffic {
    assert_eq!(
        spec.collective,
        Collective::AllReduce,
        "traffic is modelled for all-reduce only"
    );
    let (hosts, rank, count, chunk) = (spec.hosts, spec.rank, spec.count, spec.chunk);
    let multi = spec.multi_host();
    match spec.algo {
        Algo::Ring if multi => flat_ring_traffic(hosts, rank, count, elem_bytes, acc_bytes, chunk),
        Algo::Hier if multi => hier_traffic(hosts, rank, count, elem_bytes, acc_bytes, chunk),
        algo => {
            let channels = if algo == Algo::Ring { spec.channels } else { 1 };
            let host_of = |r: usize| {
                multi.then(|| {
                    hosts
                        .iter()
                        .position(|h| h.contains(&r))
                        .expect("every rank is on a host")
                })
            };
            let home = host_of(rank);
            let mut t = Traffic::default();
            let sends = flat_sends(
                algo, spec.world, rank, count, elem_bytes, acc_bytes, chunk, channels,
            );
            for s in sends {
                t.messages += s.messages;
                t.bytes += s.bytes;
                if host_of(s.to) != home {
                    t.inter_host_bytes += s.bytes;
                }
            }
            t
        }
    }
}

/// Messages and payload bytes one rank sends to one peer.
struct Sends {
    to: usize,
    messages: usize,
    bytes: usize,
}

/// What rank `rank` sends, peer by peer, in the flat all-reduce `algo` (the ring on `channels` rings;
/// [`Algo::Hier`] is the single ring).
#[allow(clippy::too_many_arguments)]
fn flat_sends(
    algo: Algo,
    world: usize,
    rank: usize,
    count: usize,
    elem_bytes: usize,
    acc_bytes: usize,
    chunk: usize,
    channels: usize,
) -> Vec<Sends> {
    assert!(rank < world, "rank {rank} out of range for world {world}");
    assert!(chunk > 0, "chunk of zero elements");
    if world == 1 {
        return Vec::new();
    }
    let n = world;
    let pieces = |len: usize| len.div_ceil(chunk);
    let send = |to, messages, bytes| Sends {
        to,
        messages,
        bytes,
    };
    match algo {
        Algo::Ring | Algo::Hier => {
            // Per ring (odd ones reversed, sending to the previous rank): partials of every segment
            // but its own, results of every segment but the next rank's, in 2(n-1) messages per chunk
            // position (empty ones included); the rings share the chunk positions.
            let channels = if algo == Algo::Ring {
                channels.max(1)
            } else {
                1
            };
            let parts: Vec<Vec<_>> = partition(count, channels)
                .iter()
                .map(|p| partition(p.len(), n))
                .collect();
            let positions = parts
                .iter()
                .map(|segs| chunks_needed(segs, chunk))
                .max()
                .unwrap_or(1);
            parts
                .iter()
                .enumerate()
                .map(|(c, segs)| {
                    let reversed = c % 2 == 1;
                    let v = if reversed { (n - rank) % n } else { rank };
                    let to = if reversed {
                        (rank + n - 1) % n
                    } else {
                        (rank + 1) % n
                    };
                    let len: usize = segs.iter().map(|s| s.len()).sum();
                    let partials = len - segs[v].len();
                    let results = len - segs[(v + 1) % n].len();
                    send(
                        to,
                        2 * (n - 1) * positions,
                        partials * acc_bytes + results * elem_bytes,
                    )
                })
                .collect()
        }
        Algo::Direct => {
            let positions = chunks_needed(std::slice::from_ref(&(0..count)), chunk);
            (1..n)
                .map(|k| send((rank + k) % n, positions, count * elem_bytes))
                .collect()
        }
        Algo::Tree => {
            // Per tree: the half goes up once (partials) and down to each child (results).
            let halves = partition(count, 2);
            let mut out = Vec::new();
            for (node, half) in tree::double_tree(n, rank).iter().zip(&halves) {
                let k = pieces(half.len());
                if let Some(p) = node.parent {
                    out.push(send(p, k, half.len() * acc_bytes));
                }
                for &ch in &node.children {
                    out.push(send(ch, k, half.len() * elem_bytes));
                }
            }
            out
        }
        Algo::Rhd => {
            let p = rhd::fold_size(n);
            if rank >= p {
                return vec![send(rank - p, pieces(count), count * acc_bytes)];
            }
            let mut out = Vec::new();
            let mut cur = 0..count;
            for k in 0..p.trailing_zeros() {
                let (keep, give) = rhd::halves(&cur, rank >> k & 1 == 1);
                // Halving gives `give` away as partials; doubling later sends `keep`, finished.
                out.push(send(
                    rank ^ (1 << k),
                    pieces(give.len()) + pieces(keep.len()),
                    give.len() * acc_bytes + keep.len() * elem_bytes,
                ));
                cur = keep;
            }
            if rank + p < n {
                out.push(send(rank + p, pieces(count), count * elem_bytes));
            }
            out
        }
    }
}

/// Link costs of a job spread over several hosts, in microseconds: one class between ranks of one
/// host, one between hosts.
///
/// # The model
///
/// Ranks of one host talk over their own links (shared memory); each host has one network link, shared
/// by every rank of the host that sends at the same time, so `s` bytes sent at once by `m` ranks of a
/// host take `α_x + m·s·β_x` to leave it. With `H` hosts, `S` ranks on the smallest host, `L` on the
/// largest, `n` ranks in all, `B` bytes and partials `f` times the data (`f = 2` for f16/bf16):
///
/// - **Flat ring**, ranks host by host ([`crate::hier::host_order`]): every step of the ring moves one
///   segment over every link at once, and exactly `H` of the `n` links cross hosts, one out of each
///   host. A step takes as long as its slowest link, `max(α_i + s·β_i, α_x + s·β_x)`, so with
///   `k = ⌈fB/n / chunk_bytes⌉` chunks per segment and steps of `s = B/(nk)` bytes (`fs` for
///   partials): `T = k(n−1)·[step(fs) + fs·γ + step(s)]`. Each host's link carries the whole
///   `(n−1)/n·B·(1+f)` that a ring rank sends (`2(n−1)/n·B` for `f = 1`).
/// - **Hierarchical** ([`crate::hier::all_reduce`]): pieces of `s = B/(SHP)` bytes, with
///   `P = ⌈fB/(SH) / chunk_bytes⌉` chunk positions. Per chunk position, each rank's host-local link
///   moves `H(L−1)` partial pieces (reduce-scatter) and `H(L−1)` result pieces (all-gather):
///   `t_i = H(L−1)·(2α_i + (1+f)s·β_i + fs·γ) + H·fs·γ` (the last term loads the owner's input into
///   scratch). The `S` owners of a host run their inter-host rings at once, through the one host link:
///   `t_x = (H−1)·(α_x + S·fs·β_x + fs·γ) + (H−1)·(α_x + S·s·β_x) + fs·γ`. The stages pipeline over
///   the chunk positions (the inter-host step of chunk `c` runs while chunk `c+1` is reduced and chunk
///   `c−1` gathered), so `T = t_i + t_x + (P−1)·max(t_i, t_x)`.
///
/// Over many chunks the flat ring's host link moves `(n−1)/n·B·(1+f)` at `β_x`, the hierarchical one's
/// `(H−1)/H·B·(1+f)` (the same total whether `S` streams or one share the link), and its inter-host
/// latency is `2(H−1)` steps per chunk position instead of `2(n−1)`: on a slow network, with `L ≥ 2`,
/// its time on the host link is `n(H−1)/(H(n−1))` of the flat ring's (`1/2·n/(n−1)` for two hosts),
/// and it pays far fewer inter-host latencies; the price is the host-local traffic of a reduce-scatter
/// and an all-gather on every host, on links that are faster and run alongside. Summed over
/// all host links, the flat ring crosses hosts with `H(n−1)/n·B·(1+f)` bytes, the hierarchical
/// schedule with `(H−1)·B·(1+f)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostLinks {
    /// Latency of one message between ranks of one host (`α_i`).
    pub intra_alpha_us: f64,
    /// Time per byte between ranks of one host (`β_i`).
    pub intra_beta_us_per_byte: f64,
    /// Latency of one message between hosts (`α_x`).
    pub inter_alpha_us: f64,
    /// Time per byte through a host's network link (`β_x`), shared by the host's ranks.
    pub inter_beta_us_per_byte: f64,
    /// Time per (accumulator) byte reduced (`γ`).
    pub gamma_us_per_byte: f64,
}

/// The modelled time, in microseconds, of a flat ring all-reduce of `bytes` bytes over hosts of
/// `host_sizes` ranks, the ranks ordered host by host (see [`HostLinks`] for the formula). Partials
/// weigh `acc_bytes_factor` times the data; a message carries at most `chunk_bytes` bytes of partials.
pub fn flat_ring_cost(
    host_sizes: &[usize],
    bytes: usize,
    acc_bytes_factor: f64,
    chunk_bytes: usize,
    links: &HostLinks,
) -> f64 {
    let n: usize = host_sizes.iter().sum();
    if n <= 1 {
        return 0.0;
    }
    let hosts = host_sizes.len();
    let (nf, b, f) = (n as f64, bytes as f64, acc_bytes_factor);
    let k = (b * f / nf / chunk_bytes.max(1) as f64).ceil().max(1.0);
    let step = |s: f64| {
        // Links within a host exist unless every host has one rank; links between hosts unless there
        // is one host.
        let intra = (n > hosts).then_some(links.intra_alpha_us + s * links.intra_beta_us_per_byte);
        let inter = (hosts > 1).then_some(links.inter_alpha_us + s * links.inter_beta_us_per_byte);
        intra.into_iter().chain(inter).fold(0.0, f64::max)
    };
    let (sp, sr) = (b * f / nf / k, b / nf / k);
    k * (nf - 1.0) * (step(sp) + sp * links.gamma_us_per_byte + step(sr))
}

/// The modelled time, in microseconds, of the hierarchical all-reduce of `bytes` bytes over hosts of
/// `host_sizes` ranks (see [`HostLinks`] for the formula). On one host, or with one rank per host, it
/// is the flat ring, as the schedule is.
pub fn hier_cost(
    host_sizes: &[usize],
    bytes: usize,
    acc_bytes_factor: f64,
    chunk_bytes: usize,
    links: &HostLinks,
) -> f64 {
    let hosts = host_sizes.len();
    let (smin, lmax) = (
        host_sizes.iter().copied().min().unwrap_or(0),
        host_sizes.iter().copied().max().unwrap_or(0),
    );
    if hosts <= 1 || lmax <= 1 || smin == 0 {
        return flat_ring_cost(host_sizes, bytes, acc_bytes_factor, chunk_bytes, links);
    }
    let (h, s_, l) = (hosts as f64, smin as f64, lmax as f64);
    let (b, f) = (bytes as f64, acc_bytes_factor);
    let HostLinks {
        intra_alpha_us: ai,
        intra_beta_us_per_byte: bi,
        inter_alpha_us: ax,
        inter_beta_us_per_byte: bx,
        gamma_us_per_byte: g,
    } = *links;
    let p = (b * f / (s_ * h) / chunk_bytes.max(1) as f64)
        .ceil()
        .max(1.0);
    let s = b / (s_ * h * p);
    let t_intra = h * (l - 1.0) * (2.0 * ai + (1.0 + f) * s * bi + f * s * g) + h * f * s * g;
    let t_inter =
        (h - 1.0) * (ax + s_ * f * s * bx + f * s * g) + (h - 1.0) * (ax + s_ * s * bx) + f * s * g;
    t_intra + t_inter + (p - 1.0) * t_intra.max(t_inter)
}

/// What one rank sends in a schedule: messages, payload bytes, and the part of those bytes that
/// leaves its host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Messages sent (empty ones included).
    pub messages: usize,
    /// Payload bytes sent.
    pub bytes: usize,
    /// Payload bytes sent to ranks on other hosts.
    pub inter_host_bytes: usize,
}

/// What rank `rank` sends in the flat ring all-reduce over the ranks host by host
/// (`ring::all_reduce_ordered(&hier::host_order(hosts), …)`) of `count` elements of `elem_bytes`
/// bytes (partials `acc_bytes`), `chunk` elements per message.
///
/// # Panics
///
/// As [`crate::hier::all_reduce`].
pub fn flat_ring_traffic(
    hosts: &[Vec<usize>],
    rank: usize,
    count: usize,
    elem_bytes: usize,
    acc_bytes: usize,
    chunk: usize,
) -> Traffic {
    let (h, _) = hier::locate(hosts, rank);
    let order = hier::host_order(hosts);
    let n = order.len();
    let v = order
        .iter()
        .position(|&r| r == rank)
        .expect("located above");
    // The ring's traffic depends only on the position on the ring.
    let (messages, bytes) =
        all_reduce_traffic(Algo::Ring, n, v, count, elem_bytes, acc_bytes, chunk);
    let next = order[(v + 1) % n];
    let crosses = n > 1 && hier::locate(hosts, next).0 != h;
    Traffic {
        messages,
        bytes,
        inter_host_bytes: if crosses { bytes } else { 0 },
    }
}

/// What rank `rank` sends in [`crate::hier::all_reduce`] of `count` elements of `elem_bytes` bytes
/// (partials `acc_bytes`), `chunk` elements per message. Empty pieces send nothing.
///
/// Local rank `i` of a host of `L_h ≥ 2` ranks passes on, in its host's reduce-scatter, the partial of
/// every shard but its own, and in the all-gather every shard but that of the next local rank
/// (`i+1 mod L_h`); an owner of shard `i` on host `h` of `H` sends, across hosts, the partials of every
/// segment of its shard but segment `h`, and the results of every segment but segment `h+1 mod H`.
///
/// # Panics
///
/// As [`crate::hier::all_reduce`].
pub fn hier_traffic(
    hosts: &[Vec<usize>],
    rank: usize,
    count: usize,
    elem_bytes: usize,
    acc_bytes: usize,
    chunk: usize,
) -> Traffic {
    let (h, i) = hier::locate(hosts, rank);
    assert!(chunk > 0, "chunk of zero elements");
    let nh = hosts.len();
    let lmax = hosts.iter().map(Vec::len).max().unwrap_or(1);
    if nh == 1 || lmax == 1 {
        return flat_ring_traffic(hosts, rank, count, elem_bytes, acc_bytes, chunk);
    }
    let s = hier::shards(hosts);
    let lh = hosts[h].len();
    let pieces = hier::Pieces::new(count, s, nh, chunk);
    let msgs = |r: &std::ops::Range<usize>| r.len().div_ceil(chunk);
    let shard_len = |j: usize| pieces.segs[j].iter().map(|r| r.len()).sum::<usize>();
    let shard_msgs = |j: usize| pieces.segs[j].iter().map(msgs).sum::<usize>();
    let mut t = Traffic::default();
    if lh > 1 {
        for j in (0..s).filter(|&j| j != i) {
            t.messages += shard_msgs(j);
            t.bytes += shard_len(j) * acc_bytes;
        }
        for j in (0..s).filter(|&j| j != (i + 1) % lh) {
            t.messages += shard_msgs(j);
            t.bytes += shard_len(j) * elem_bytes;
        }
    }
    if i < s {
        let segs = &pieces.segs[i];
        for (k, seg) in segs.iter().enumerate() {
            let sends = usize::from(k != h) + usize::from(k != (h + 1) % nh);
            t.messages += sends * msgs(seg);
            let b = seg.len() * (usize::from(k != h) * acc_bytes)
                + seg.len() * (usize::from(k != (h + 1) % nh) * elem_bytes);
            t.bytes += b;
            t.inter_host_bytes += b;
        }
    }
    t
}
