//! One-step schedules: every rank sends to every other rank at once.
//!
//! Direct all-reduce costs one message latency instead of `2(n−1)`, at the price of each rank receiving
//! `(n−1)·bytes`. On one host, for small messages, latency is all that counts. Every rank reduces all `n`
//! contributions in rank order, so the results are bit-identical without a gather phase.

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
            range: r,
            nranks: world,
        });
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
