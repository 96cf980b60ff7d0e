//! One-step schedules: every rank sends to every other rank at once.
//!
//! Direct all-reduce costs one message latency instead of `2(n−1)`, at the price of each rank receiving
//! `(n−1)·bytes`. On one host, for small messages, latency is all that counts. Every rank reduces all `n`
//! contributions in rank order, so the results are bit-identical without a gather phase. Direct all-gather
//! likewise sends each rank's block to everyone in one step, and direct all-to-all each block to its one
//! destination. [`all_to_all_v`] and [`all_gather_v`] do the same with blocks whose sizes differ per
//! rank (agreed by an exchange of counts first): the sparse reduce-scatter of [`crate::sparse`].

use std::ops::Range;

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

/// Direct all-to-all of blocks of any size: `send[j]` is the input range this rank sends to rank `j`,
/// and `recv[i]` the output range where rank `i`'s block lands (its own block, `send[rank]`, is copied
/// to `recv[rank]`). Both sides must agree on every size beforehand (rank `i`'s `send[j].len()` is rank
/// `j`'s `recv[i].len()`), as after an exchange of counts: a receiver that expects another size fails
/// with a mismatch naming the sender. An empty block sends no message. `chunk` elements per message.
///
/// Chunk position `c` sends chunk `c` of every block that has one, then receives chunk `c` of every
/// incoming block that has one. A rank at the lowest position can always go on (each peer at the same
/// or a later position has taken its earlier messages, or sent what it waits for), so one slot per
/// channel suffices, whatever the sizes.
pub fn all_to_all_v(
    world: usize,
    rank: usize,
    send: &[Range<usize>],
    recv: &[Range<usize>],
    chunk: usize,
) -> Vec<Action> {
    assert!(
        world > 0 && rank < world,
        "rank {rank} out of range for world {world}"
    );
    assert!(
        send.len() == world && recv.len() == world,
        "all_to_all_v needs one send and one receive range per rank"
    );
    assert!(
        send[rank].len() == recv[rank].len(),
        "a rank's own block is copied: its send and receive ranges must have the same length"
    );
    assert!(chunk > 0, "chunk must hold at least one element");
    let chunks = |r: &Range<usize>| r.len().div_ceil(chunk);
    let mut plan = Vec::new();
    if !send[rank].is_empty() {
        plan.push(Action::Copy {
            src: send[rank].clone(),
            dst: recv[rank].clone(),
        });
    }
    let peers = || (1..world).map(|k| (rank + k) % world);
    let positions = peers()
        .map(|p| chunks(&send[p]).max(chunks(&recv[p])))
        .max()
        .unwrap_or(0);
    for c in 0..positions {
        for to in peers().filter(|&p| c < chunks(&send[p])) {
            plan.push(Action::Send {
                to,
                buf: Buf::Input,
                range: chunk_of(&send[to], c, chunk),
            });
        }
        for k in 1..world {
            let from = (rank + world - k) % world;
            if c < chunks(&recv[from]) {
                plan.push(Action::RecvCopy {
                    from,
                    output: chunk_of(&recv[from], c, chunk),
                    forward: None,
                });
            }
        }
    }
    plan
}

/// Direct all-gather of blocks of any size: this rank's input `0..blocks[rank].len()` goes to every
/// peer, and rank `i`'s block lands in output `blocks[i]` on every rank (sizes agreed beforehand, as for
/// [`all_to_all_v`], which this is with the same send range for every peer).
pub fn all_gather_v(
    world: usize,
    rank: usize,
    blocks: &[Range<usize>],
    chunk: usize,
) -> Vec<Action> {
    assert!(
        world > 0 && rank < world && blocks.len() == world,
        "all_gather_v needs rank {rank} < world {world} and one block per rank"
    );
    let mine = 0..blocks[rank].len();
    all_to_all_v(world, rank, &vec![mine; world], blocks, chunk)
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
