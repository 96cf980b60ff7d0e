//! Ring and chain schedules, pipelined in chunks.
//!
//! All-reduce is a reduce-scatter followed by an all-gather around a ring. The buffer is split into `n`
//! segments and each segment into chunks; the outer loop runs over chunk positions, so chunk `c+1` of
//! every segment is on the wire while chunk `c` is being reduced. Each segment's reduction is computed
//! once, by its owner, and then copied to everyone: results are bit-identical on every rank by
//! construction.
//!
//! The ring may visit the ranks in any order (the `*_ordered` variants): `order[i]` sends to
//! `order[i+1]`, and the rank at position `i` owns segment `i`. A host-contiguous order makes the ring
//! cross each host boundary once, so only `H` of its `n` links are inter-host links. The plain functions
//! are the identity order `0 → 1 → … → n−1 → 0`.
//!
//! Each rank moves `2(n−1)/n` of the buffer (partials of f16/bf16 travel as f32) in `2(n−1)` messages per
//! chunk position: the alpha-beta cost is `2(n−1)·α + 2(n−1)/n·bytes·β`.

use std::ops::Range;

use crate::{chunk_of, chunks_needed, partition, Action, Buf};

/// Ring all-reduce of `count` elements on rank `rank` of `world`, `chunk` elements per message.
pub fn all_reduce(world: usize, rank: usize, count: usize, chunk: usize) -> Vec<Action> {
    all_reduce_channels(world, rank, count, chunk, 1)
}

/// Ring all-reduce over the ring `order[0] → order[1] → … → order[n−1] → order[0]`, where `order` is a
/// permutation of the ranks `0..n`; `all_reduce` is the identity order.
///
/// # Panics
///
/// If `order` is not a permutation of `0..order.len()` or `rank` is not in it.
pub fn all_reduce_ordered(order: &[usize], rank: usize, count: usize, chunk: usize) -> Vec<Action> {
    all_reduce_rings(order, rank, count, chunk, 1)
}

/// Ring all-reduce split over `channels` rings: channel `c` carries the `c`-th part of the buffer, and
/// odd channels run the ring in the opposite direction, so every link carries data both ways. The
/// channels' chunks are interleaved, so all rings progress together.
pub fn all_reduce_channels(
    world: usize,
    rank: usize,
    count: usize,
    chunk: usize,
    channels: usize,
) -> Vec<Action> {
    check(world, rank);
    let order: Vec<usize> = (0..world).collect();
    all_reduce_rings(&order, rank, count, chunk, channels)
}

/// The ring all-reduce over `order`, split over `channels` rings (odd ones reversed).
fn all_reduce_rings(
    order: &[usize],
    rank: usize,
    count: usize,
    chunk: usize,
    channels: usize,
) -> Vec<Action> {
    let world = order.len();
    let pos = positions(order, rank);
    if world == 1 {
        return vec![Action::Copy {
            src: 0..count,
            dst: 0..count,
        }];
    }
    let rings: Vec<Ring> = partition(count, channels.max(1))
        .into_iter()
        .enumerate()
        .map(|(c, part)| Ring::new(order, pos[rank], c % 2 == 1, part))
        .collect();
    let positions = rings
        .iter()
        .map(|r| chunks_needed(&r.segs, chunk))
        .max()
        .unwrap_or(1);
    let mut plan = Vec::with_capacity(positions * rings.len() * 2 * (world - 1));
    for c in 0..positions {
        for ring in &rings {
            ring.push_position(&mut plan, c, chunk);
        }
    }
    plan
}

/// One ring of an all-reduce, seen from one rank: its virtual position, neighbours and segments.
struct Ring {
    world: usize,
    /// This rank's position on the ring (it owns segment `v`).
    v: usize,
    next: usize,
    prev: usize,
    segs: Vec<Range<usize>>,
}

impl Ring {
    /// The ring over `order` (reversed: `order[0], order[n−1], …, order[1]`) seen from the rank at
    /// position `p` of `order`, carrying `part` of the buffer.
    fn new(order: &[usize], p: usize, reversed: bool, part: Range<usize>) -> Ring {
        let world = order.len();
        // Position v of the reversed ring is order[(n - v) mod n].
        let flip = |v: usize| if reversed { (world - v) % world } else { v };
        let to_rank = |v: usize| order[flip(v)];
        let v = flip(p);
        let segs = partition(part.len(), world)
            .into_iter()
            .map(|s| s.start + part.start..s.end + part.start)
            .collect();
        Ring {
            world,
            v,
            next: to_rank((v + 1) % world),
            prev: to_rank((v + world - 1) % world),
            segs,
        }
    }

    /// The actions of chunk position `c`: reduce-scatter then all-gather of that chunk of every segment.
    fn push_position(&self, plan: &mut Vec<Action>, c: usize, chunk: usize) {
        let (world, v, next, prev) = (self.world, self.v, self.next, self.prev);
        let seg = |k: usize| chunk_of(&self.segs[k % world], c, chunk);
        plan.push(Action::SendAcc {
            to: next,
            range: seg(v + world - 1),
        });
        for s in 1..world - 1 {
            plan.push(Action::RecvReduceSend {
                from: prev,
                to: next,
                range: seg(v + 2 * world - s - 1),
            });
        }
        let own = seg(v);
        plan.push(Action::RecvReduceFinal {
            from: prev,
            input: own.clone(),
            output: own,
            forward: Some(next),
            nranks: world,
        });
        for t in 1..world {
            let forward = (t < world - 1).then_some(next);
            plan.push(Action::RecvCopy {
                from: prev,
                output: seg(v + world - t),
                forward,
            });
        }
    }
}

/// Ring reduce-scatter: the input holds `world · recv_count` elements, rank `r` ends with block `r`.
pub fn reduce_scatter(world: usize, rank: usize, recv_count: usize, chunk: usize) -> Vec<Action> {
    check(world, rank);
    let order: Vec<usize> = (0..world).collect();
    reduce_scatter_ordered(&order, rank, recv_count, chunk)
}

/// Ring reduce-scatter over the ring `order[0] → order[1] → … → order[0]` (a permutation of the
/// ranks): the input holds `n · recv_count` elements and rank `r` still ends with block `r`, whatever
/// its position on the ring.
///
/// # Panics
///
/// If `order` is not a permutation of `0..order.len()` or `rank` is not in it.
pub fn reduce_scatter_ordered(
    order: &[usize],
    rank: usize,
    recv_count: usize,
    chunk: usize,
) -> Vec<Action> {
    let world = order.len();
    let pos = positions(order, rank);
    if world == 1 {
        return vec![Action::Copy {
            src: 0..recv_count,
            dst: 0..recv_count,
        }];
    }
    let v = pos[rank];
    // Position k's block is the block of the rank standing there.
    let blocks: Vec<_> = order
        .iter()
        .map(|&j| j * recv_count..(j + 1) * recv_count)
        .collect();
    let (next, prev) = (order[(v + 1) % world], order[(v + world - 1) % world]);
    let seg = |k: usize, c: usize| chunk_of(&blocks[k % world], c, chunk);
    let mut plan = Vec::new();
    for c in 0..chunks_needed(&blocks, chunk) {
        plan.push(Action::SendAcc {
            to: next,
            range: seg(v + world - 1, c),
        });
        for s in 1..world - 1 {
            plan.push(Action::RecvReduceSend {
                from: prev,
                to: next,
                range: seg(v + 2 * world - s - 1, c),
            });
        }
        let own = seg(v, c);
        let base = rank * recv_count;
        plan.push(Action::RecvReduceFinal {
            from: prev,
            output: own.start - base..own.end - base,
            input: own,
            forward: None,
            nranks: world,
        });
    }
    plan
}

/// Ring all-gather: each rank contributes `send_count` elements; the output holds `world` blocks in rank
/// order. (In place, the input is the rank's own block of the output.)
pub fn all_gather(world: usize, rank: usize, send_count: usize, chunk: usize) -> Vec<Action> {
    check(world, rank);
    let order: Vec<usize> = (0..world).collect();
    all_gather_ordered(&order, rank, send_count, chunk)
}

/// Ring all-gather over the ring `order[0] → order[1] → … → order[0]` (a permutation of the ranks);
/// the output still holds the blocks in rank order.
///
/// # Panics
///
/// If `order` is not a permutation of `0..order.len()` or `rank` is not in it.
pub fn all_gather_ordered(
    order: &[usize],
    rank: usize,
    send_count: usize,
    chunk: usize,
) -> Vec<Action> {
    let world = order.len();
    let pos = positions(order, rank);
    let v = pos[rank];
    let blocks: Vec<_> = order
        .iter()
        .map(|&j| j * send_count..(j + 1) * send_count)
        .collect();
    let (next, prev) = (order[(v + 1) % world], order[(v + world - 1) % world]);
    let mut plan = Vec::new();
    for c in 0..chunks_needed(&blocks, chunk) {
        let mine = chunk_of(&(0..send_count), c, chunk);
        let base = rank * send_count;
        plan.push(Action::Copy {
            src: mine.clone(),
            dst: mine.start + base..mine.end + base,
        });
        if world == 1 {
            continue;
        }
        plan.push(Action::Send {
            to: next,
            buf: Buf::Input,
            range: mine,
        });
        for t in 1..world {
            let forward = (t < world - 1).then_some(next);
            let output = chunk_of(&blocks[(v + world - t) % world], c, chunk);
            plan.push(Action::RecvCopy {
                from: prev,
                output,
                forward,
            });
        }
    }
    plan
}

/// Pipelined chain broadcast from `root` along `root → root+1 → …`.
pub fn broadcast(
    world: usize,
    rank: usize,
    root: usize,
    count: usize,
    chunk: usize,
) -> Vec<Action> {
    check(world, rank);
    assert!(root < world, "root {root} out of range");
    let pos = (rank + world - root) % world;
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let all = 0..count;
    let mut plan = Vec::new();
    for c in 0..chunks_needed(std::slice::from_ref(&all), chunk) {
        let r = chunk_of(&all, c, chunk);
        if pos == 0 {
            plan.push(Action::Copy {
                src: r.clone(),
                dst: r.clone(),
            });
            if world > 1 {
                plan.push(Action::Send {
                    to: next,
                    buf: Buf::Input,
                    range: r,
                });
            }
        } else {
            let forward = (pos < world - 1).then_some(next);
            plan.push(Action::RecvCopy {
                from: prev,
                output: r,
                forward,
            });
        }
    }
    plan
}

/// Pipelined chain reduction to `root` along `root+1 → root+2 → … → root`. Only the root writes output.
pub fn reduce(world: usize, rank: usize, root: usize, count: usize, chunk: usize) -> Vec<Action> {
    check(world, rank);
    assert!(root < world, "root {root} out of range");
    if world == 1 {
        return vec![Action::Copy {
            src: 0..count,
            dst: 0..count,
        }];
    }
    let pos = (rank + world - root - 1) % world;
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let all = 0..count;
    let mut plan = Vec::new();
    for c in 0..chunks_needed(std::slice::from_ref(&all), chunk) {
        let r = chunk_of(&all, c, chunk);
        plan.push(if pos == 0 {
            Action::SendAcc { to: next, range: r }
        } else if pos < world - 1 {
            Action::RecvReduceSend {
                from: prev,
                to: next,
                range: r,
            }
        } else {
            Action::RecvReduceFinal {
                from: prev,
                input: r.clone(),
                output: r,
                forward: None,
                nranks: world,
            }
        });
    }
    plan
}

fn check(world: usize, rank: usize) {
    assert!(
        world > 0 && rank < world,
        "rank {rank} out of range for world {world}"
    );
}

/// The position of every rank in `order` (`pos[order[i]] == i`), after checking that `order` is a
/// permutation of `0..order.len()` that contains `rank`.
pub(crate) fn positions(order: &[usize], rank: usize) -> Vec<usize> {
    let world = order.len();
    check(world, rank);
    let mut pos = vec![usize::MAX; world];
    for (i, &r) in order.iter().enumerate() {
        assert!(
            r < world && pos[r] == usize::MAX,
            "ring order {order:?} is not a permutation of 0..{world}"
        );
        pos[r] = i;
    }
    pos
}
