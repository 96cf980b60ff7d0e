//! Ring and chain schedules, pipelined in chunks.
//!
//! All-reduce is a reduce-scatter followed by an all-gather around the ring `0 → 1 → … → n−1 → 0`. The
//! buffer is split into `n` segments and each segment into chunks; the outer loop runs over chunk
//! positions, so chunk `c+1` of every segment is on the wire while chunk `c` is being reduced. Each
//! segment's reduction is computed once, by its owner, and then copied to everyone: results are
//! bit-identical on every rank by construction.
//!
//! Each rank moves `2(n−1)/n` of the buffer (partials of f16/bf16 travel as f32) in `2(n−1)` messages per
//! chunk position: the alpha-beta cost is `2(n−1)·α + 2(n−1)/n·bytes·β`.

use crate::{chunk_of, chunks_needed, partition, Action, Buf};

/// Ring all-reduce of `count` elements on rank `rank` of `world`, `chunk` elements per message.
pub fn all_reduce(world: usize, rank: usize, count: usize, chunk: usize) -> Vec<Action> {
    check(world, rank);
    if world == 1 {
        return vec![Action::Copy {
            src: 0..count,
            dst: 0..count,
        }];
    }
    let segs = partition(count, world);
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let seg = |k: usize, c: usize| chunk_of(&segs[k % world], c, chunk);
    let mut plan = Vec::with_capacity(chunks_needed(&segs, chunk) * 2 * (world - 1));
    for c in 0..chunks_needed(&segs, chunk) {
        plan.push(Action::SendAcc {
            to: next,
            range: seg(rank + world - 1, c),
        });
        for s in 1..world - 1 {
            plan.push(Action::RecvReduceSend {
                from: prev,
                to: next,
                range: seg(rank + 2 * world - s - 1, c),
            });
        }
        let own = seg(rank, c);
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
                output: seg(rank + world - t, c),
                forward,
            });
        }
    }
    plan
}

/// Ring reduce-scatter: the input holds `world · recv_count` elements, rank `r` ends with block `r`.
pub fn reduce_scatter(world: usize, rank: usize, recv_count: usize, chunk: usize) -> Vec<Action> {
    check(world, rank);
    if world == 1 {
        return vec![Action::Copy {
            src: 0..recv_count,
            dst: 0..recv_count,
        }];
    }
    let blocks: Vec<_> = (0..world)
        .map(|j| j * recv_count..(j + 1) * recv_count)
        .collect();
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let seg = |k: usize, c: usize| chunk_of(&blocks[k % world], c, chunk);
    let mut plan = Vec::new();
    for c in 0..chunks_needed(&blocks, chunk) {
        plan.push(Action::SendAcc {
            to: next,
            range: seg(rank + world - 1, c),
        });
        for s in 1..world - 1 {
            plan.push(Action::RecvReduceSend {
                from: prev,
                to: next,
                range: seg(rank + 2 * world - s - 1, c),
            });
        }
        let own = seg(rank, c);
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
    let blocks: Vec<_> = (0..world)
        .map(|j| j * send_count..(j + 1) * send_count)
        .collect();
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
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
            let output = chunk_of(&blocks[(rank + world - t) % world], c, chunk);
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
