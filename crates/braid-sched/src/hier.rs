//! Hierarchical (two-level) all-reduce: reduce within each host, all-reduce across hosts, gather
//! within each host.
//!
//! A flat ring over `n = H·L` ranks pays the slow inter-host link on every one of its `2(n−1)` steps.
//! Here the inter-host links carry only `H`-rank rings, and each host's link carries `2(H−1)/H` of the
//! buffer instead of the flat ring's `2(n−1)/n` (see [`crate::cost`] for the whole model).
//!
//! # The algorithm
//!
//! `hosts[h]` lists the global ranks of host `h`; local rank `i` of host `h` is `hosts[h][i]`. The
//! buffer is split into `S` shards, `S` the size of the smallest host, and local rank `j < S` of every
//! host owns shard `j`. Each shard is split into `H` segments (host `u` finishes segment `u`), and each
//! segment into chunks of at most `chunk` elements: the pieces `(shard j, segment k, chunk c)`.
//!
//! 1. **Intra-host reduce-scatter.** On each host, a ring over its local ranks carries every shard's
//!    partial through all of the host's ranks (a chain starting at the rank after its owner), each rank
//!    combining its input into it; the owner loads its input into scratch and combines the partial
//!    there (accumulator type).
//! 2. **Inter-host all-reduce.** The owners of shard `j` (local rank `j` of every host) run a ring
//!    all-reduce over the hosts on their scratch: partials go `H−1` steps around the ring, host `u`'s
//!    owner finishes segment `u` into its output, and the result goes `H−1` steps around again. All `S`
//!    shards' rings run at once.
//! 3. **Intra-host all-gather.** Each owner passes its finished shard around its host's ring.
//!
//! Every element is finished by exactly one rank and copied everywhere else, so all ranks end
//! bit-identical. Hosts may differ in size: ranks beyond the smallest host's size own no shard but take
//! part in their host's chains, so a host of `L_h` ranks still reduces over all of them. (Uneven hosts
//! leave the larger hosts' extra ranks out of the inter-host phase; that phase's volume per host is the
//! same either way.) One host, or one rank per host, is a plain ring over the ranks host by host
//! ([`host_order`]), which is what this function returns then.
//!
//! # Pipelining and deadlock freedom
//!
//! Every action gets a time slot, and each rank runs its actions in slot order. With `σ = L_max − 1`
//! and rounds of `R = 2Hσ` slots, round `c` holds: the intra-host reduce-scatter of chunk `c`
//! (segment `k`'s `L_h − 1` ring steps from slot `cR + k(L_h−1)`), the inter-host all-reduce of chunk
//! `c − 1` (its `2(H−1)` steps `σ` slots apart, from slot `cR`), and the intra-host all-gather of chunk
//! `c − 2` (segment `k` from slot `cR + Hσ + k(L_h−1)`). So while one chunk crosses hosts, the next is
//! being reduced and the previous gathered on the host's own links, and the inter-host link is busy all
//! round. Intra-host messages are received one slot after they are sent, inter-host ones `σ` slots
//! after, and no channel carries more than one message in flight when the next is sent.
//!
//! That makes channels of depth 2 enough, whatever the timing: take the pending action with the
//! earliest slot `t` among all ranks. Every action of an earlier slot has run, so the message it waits
//! for (sent in an earlier slot) is there, and the channel it sends on holds at most the one message
//! sent before it and not yet received (received in slot `t` or later). So some rank can always run.
//! Empty pieces (a count smaller than the number of shards or segments) send nothing.

use std::ops::Range;

use crate::{chunk_of, chunks_needed, partition, ring, Action, Buf};

/// Hierarchical all-reduce of `count` elements on rank `rank`, `chunk` elements per message, where
/// `hosts[h]` lists the global ranks of host `h` (every rank `0..n` exactly once, in any numbering).
///
/// # Panics
///
/// If `hosts` is empty, has an empty host, does not list every rank `0..n` exactly once, or does not
/// list `rank`; or if `chunk` is zero.
pub fn all_reduce(hosts: &[Vec<usize>], rank: usize, count: usize, chunk: usize) -> Vec<Action> {
    let (h, i) = locate(hosts, rank);
    assert!(chunk > 0, "chunk of zero elements");
    let nh = hosts.len();
    let lmax = hosts.iter().map(Vec::len).max().unwrap_or(1);
    if nh == 1 || lmax == 1 {
        return ring::all_reduce_ordered(&host_order(hosts), rank, count, chunk);
    }
    let world: usize = hosts.iter().map(Vec::len).sum();
    let s = shards(hosts);
    let pieces = Pieces::new(count, s, nh, chunk);
    let host = &hosts[h];
    let lh = host.len();
    let (next, prev) = (host[(i + 1) % lh], host[(i + lh - 1) % lh]);
    let sigma = lmax - 1;
    let round = 2 * nh * sigma;

    // (slot, phase, order within the phase and slot)
    let mut keyed: Vec<((usize, usize, usize), Action)> = Vec::new();
    let mut push = |key: (usize, usize, usize), a: Action| keyed.push((key, a));
    for c in 0..pieces.positions {
        // 1. Intra-host reduce-scatter of chunk c, in round c.
        for k in 0..nh {
            let a = c * round + k * (lh - 1);
            for st in 0..lh - 1 {
                let j = (i + 2 * lh - 1 - st) % lh;
                let Some(range) = pieces.get(j, k, c) else {
                    continue;
                };
                let act = if st == 0 {
                    Action::SendAcc { to: next, range }
                } else {
                    Action::RecvReduceSend {
                        from: prev,
                        to: next,
                        range,
                    }
                };
                push((a + st, 0, 1), act);
            }
            if let Some(range) = pieces.get(i, k, c) {
                let at = a + lh - 1;
                push(
                    (at, 0, 0),
                    Action::LoadAcc {
                        range: range.clone(),
                    },
                );
                if lh > 1 {
                    push((at, 0, 0), Action::RecvCombine { from: prev, range });
                }
            }
        }

        // 2. Inter-host ring all-reduce of chunk c among the owners of shard i, in round c + 1.
        if i < s {
            let (onext, oprev) = (hosts[(h + 1) % nh][i], hosts[(h + nh - 1) % nh][i]);
            let seg = |k: usize| pieces.get(i, k % nh, c);
            let b = (c + 1) * round;
            for m in 0..=2 * (nh - 1) {
                let at = b + m * sigma;
                if m < nh - 1 {
                    let Some(range) = seg(h + 2 * nh - 1 - m) else {
                        continue;
                    };
                    if m > 0 {
                        let range = range.clone();
                        push((at, 1, 0), Action::RecvCombine { from: oprev, range });
                    }
                    push((at, 1, 1), Action::SendScratch { to: onext, range });
                } else if m == nh - 1 {
                    let Some(range) = seg(h) else {
                        continue;
                    };
                    let r = range.clone();
                    push(
                        (at, 1, 0),
                        Action::RecvCombine {
                            from: oprev,
                            range: r,
                        },
                    );
                    let r = range.clone();
                    push(
                        (at, 1, 1),
                        Action::FinishScratch {
                            range: r,
                            nranks: world,
                        },
                    );
                    push(
                        (at, 1, 2),
                        Action::Send {
                            to: onext,
                            buf: Buf::Output,
                            range,
                        },
                    );
                } else {
                    let t = m - (nh - 1);
                    let Some(output) = seg(h + nh - t) else {
                        continue;
                    };
                    let forward = (t < nh - 1).then_some(onext);
                    push(
                        (at, 1, 0),
                        Action::RecvCopy {
                            from: oprev,
                            output,
                            forward,
                        },
                    );
                }
            }
        }

        // 3. Intra-host all-gather of chunk c, in the second half of round c + 2.
        for k in (0..nh).filter(|_| lh > 1) {
            let e = (c + 2) * round + nh * sigma + k * (lh - 1);
            if let Some(range) = pieces.get(i, k, c) {
                push(
                    (e, 2, 0),
                    Action::Send {
                        to: next,
                        buf: Buf::Output,
                        range,
                    },
                );
            }
            for t in 1..lh {
                let j = (i + lh - t) % lh;
                if let Some(output) = pieces.get(j, k, c) {
                    let forward = (t < lh - 1).then_some(next);
                    push(
                        (e + t, 2, 0),
                        Action::RecvCopy {
                            from: prev,
                            output,
                            forward,
                        },
                    );
                }
            }
        }
    }
    // A stable sort keeps the pushing order among equal keys.
    keyed.sort_by_key(|(k, _)| *k);
    keyed.into_iter().map(|(_, a)| a).collect()
}

/// The ranks host by host (`hosts[0]` first, each host's ranks in the listed order): the ring order
/// under which a flat ring crosses each host boundary once, and what [`all_reduce`] runs on one host
/// or with one rank per host.
pub fn host_order(hosts: &[Vec<usize>]) -> Vec<usize> {
    hosts.concat()
}

/// The number of shards the hierarchical all-reduce splits the buffer into: the size of the smallest
/// host (local ranks `0..shards` of every host own one each).
pub fn shards(hosts: &[Vec<usize>]) -> usize {
    hosts.iter().map(Vec::len).min().unwrap_or(0)
}

/// `(host, local rank)` of `rank`, after checking that `hosts` lists every rank exactly once.
///
/// # Panics
///
/// As [`all_reduce`].
pub fn locate(hosts: &[Vec<usize>], rank: usize) -> (usize, usize) {
    assert!(!hosts.is_empty(), "no hosts");
    assert!(
        hosts.iter().all(|h| !h.is_empty()),
        "an empty host in {hosts:?}"
    );
    let world: usize = hosts.iter().map(Vec::len).sum();
    let mut seen = vec![false; world];
    let mut found = None;
    for (h, host) in hosts.iter().enumerate() {
        for (i, &r) in host.iter().enumerate() {
            assert!(
                r < world && !seen[r],
                "hosts {hosts:?} do not list each rank 0..{world} exactly once"
            );
            seen[r] = true;
            if r == rank {
                found = Some((h, i));
            }
        }
    }
    found.unwrap_or_else(|| panic!("rank {rank} out of range for world {world}"))
}

/// The pieces `(shard, segment, chunk)` of a buffer, and how many chunk positions there are.
pub(crate) struct Pieces {
    /// `segs[j][k]`: segment `k` of shard `j`.
    pub(crate) segs: Vec<Vec<Range<usize>>>,
    /// Chunk positions: chunks in the longest segment (at least one).
    pub(crate) positions: usize,
    chunk: usize,
}

impl Pieces {
    pub(crate) fn new(count: usize, shards: usize, hosts: usize, chunk: usize) -> Pieces {
        let segs: Vec<Vec<Range<usize>>> = partition(count, shards)
            .into_iter()
            .map(|sh| {
                partition(sh.len(), hosts)
                    .into_iter()
                    .map(|s| sh.start + s.start..sh.start + s.end)
                    .collect()
            })
            .collect();
        let positions = segs
            .iter()
            .map(|s| chunks_needed(s, chunk))
            .max()
            .unwrap_or(1);
        Pieces {
            segs,
            positions,
            chunk,
        }
    }

    /// Chunk `c` of segment `k` of shard `j`, if that shard exists and the piece is not empty.
    pub(crate) fn get(&self, j: usize, k: usize, c: usize) -> Option<Range<usize>> {
        let r = chunk_of(self.segs.get(j)?.get(k)?, c, self.chunk);
        (!r.is_empty()).then_some(r)
    }
}
