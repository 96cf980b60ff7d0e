//! One-step schedules: every rank sends to every other rank at once.
//!
//! Direct all-reduce costs one message latency instead of `2(n−1)`, at the price of each rank receiving
//! `(n−1)·bytes`. On one host, for small messages, latency is all that counts. Every rank reduces all `n`
//! contributions in rank order, so the results are bit-identical without a gather phase. Direct all-gather
//! likewise sends each rank's block to everyone in one step, and direct all-to-all each block to its one
//! destination.

use crate::{chunk_of, chunks_needed, Action, Buf};

/// Direct all-reduce of `count` elements, `chunk` elements per message.
pub fn all_reduce(world: usize, rank: usize, count: usize, chunk: usize) -> Vec<Action> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} out of range for world {world}"
    );
    if world == 1 {
        return vec![Action::Copy {
            src: 0..count,
            dst: 0..count,
        }];
    }
    let all = 0..count;
    let mut plan = Vec::new();
    for c in 0..chunks_needed(std::slice::from_ref(&all), chunk) {
        let r = chunk_of(&all, c, chunk);
        for k in 1..world {
            plan.push(Action::Send {
                to: (rank + k) % world,
                buf: Buf::Input,
                range: r.clone(),
            });
        }
        plan.push(Action::RecvReduceAll {
            input: r.clone(),
            output: r,
            nranks: world,
        });
    }
    plan
}

/// Direct all-gather: each rank contributes `send_count` elements and sends them straight to every other
/// rank; the output holds `world` blocks in rank order. `chunk` elements per message.
pub fn all_gather(world: usize, rank: usize, send_count: usize, chunk: usize) -> Vec<Action> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} out of range for world {world}"
    );
    let mine = 0..send_count;
    let block = |j: usize| j * send_count..(j + 1) * send_count;
    let mut plan = Vec::new();
    for c in 0..chunks_needed(std::slice::from_ref(&mine), chunk) {
        let r = chunk_of(&mine, c, chunk);
        let base = rank * send_count;
        plan.push(Action::Copy {
            src: r.clone(),
            dst: r.start + base..r.end + base,
        });
        for k in 1..world {
            plan.push(Action::Send {
                to: (rank + k) % world,
                buf: Buf::Input,
                range: r.clone(),
            });
        }
        for k in 1..world {
            let from = (rank + world - k) % world;
            plan.push(Action::RecvCopy {
                from,
                output: chunk_of(&block(from), c, chunk),
                forward: None,
            });
        }
    }
    plan
}

/// Direct reduce-scatter: the input holds `world` blocks of `recv_count`; each rank sends block `j`
/// straight to rank `j` and reduces the `world` contributions of its own block in rank order.
pub fn reduce_scatter(world: usize, rank: usize, recv_count: usize, chunk: usize) -> Vec<Action> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} out of range for world {world}"
    );
    assert!(chunk > 0, "chunk must hold at least one element");
    let block = |j: usize| j * recv_count..(j + 1) * recv_count;
    let all = 0..recv_count;
    let mut plan = Vec::new();
    for c in 0..chunks_needed(std::slice::from_ref(&all), chunk) {
        let out = chunk_of(&all, c, chunk);
        let at = |j: usize| block(j).start + out.start..block(j).start + out.end;
        if world == 1 {
            plan.push(Action::Copy {
                src: at(0),
                dst: out,
            });
            continue;
        }
        for k in 1..world {
            let to = (rank + k) % world;
            plan.push(Action::Send {
                to,
                buf: Buf::Input,
                range: at(to),
            });
        }
        plan.push(Action::RecvReduceAll {
            input: at(rank),
            output: out,
            nranks: world,
        });
    }
    plan
}

/// Direct all-to-all: the input and the output hold `world` blocks of `count_per_peer` elements; rank `r`
/// sends its input block `j` to rank `j`, which writes it into its output block `r`, and copies its own
/// block locally. `chunk` elements per message. Each chunk position sends one message to every peer before
/// receiving one from every peer, so a rank is never more than one position ahead of any peer: two slots
/// per channel suffice.
pub fn all_to_all(world: usize, rank: usize, count_per_peer: usize, chunk: usize) -> Vec<Action> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} out of range for world {world}"
    );
    assert!(chunk > 0, "chunk must hold at least one element");
    let block = |j: usize| j * count_per_peer..(j + 1) * count_per_peer;
    let mut plan = Vec::new();
    for c in 0..chunks_needed(std::slice::from_ref(&(0..count_per_peer)), chunk) {
        let own = chunk_of(&block(rank), c, chunk);
        plan.push(Action::Copy {
            src: own.clone(),
            dst: own,
        });
        for k in 1..world {
            let to = (rank + k) % world;
            plan.push(Action::Send {
                to,
                buf: Buf::Input,
                range: chunk_of(&block(to), c, chunk),
            });
        }
        for k in 1..world {
            let from = (rank + world - k) % world;
            plan.push(Action::RecvCopy {
                from,
                output: chunk_of(&block(from), c, chunk),
                forward: None,
            });
        }
    }
    plan
}

/// Barrier: an empty message to every peer, then one from every peer.
pub fn barrier(world: usize, rank: usize) -> Vec<Action> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} out of range for world {world}"
    );
    let peers = (1..world).map(|k| (rank + k) % world);
    let sends = peers.clone().map(|to| Action::Send {
        to,
        buf: Buf::Input,
        range: 0..0,
    });
    let recvs = peers.map(|from| Action::RecvCopy {
        from,
        output: 0..0,
        forward: None,
    });
    sends.chain(recvs).collect()
}
