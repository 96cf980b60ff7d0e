//! Recursive halving-doubling all-reduce (Rabenseifner).
//!
//! With `p` the largest power of two `≤ n`: the `n − p` extra ranks `p + i` first send their whole input
//! as partials to rank `i`, which combines it into its scratch. The `p` ranks then reduce-scatter by
//! recursive halving: in step `k` a rank splits its current range in two, sends one half (its scratch,
//! or its input converted in the first step) to the rank at distance `2^k` and combines the other half
//! received from it, keeping the half named by bit `k` of its rank. After `log2 p` steps each rank
//! finishes the block it kept, and the steps run backwards as an all-gather by recursive doubling:
//! each rank sends everything it has finished and receives its partner's. Finally rank `i` sends the full
//! result to rank `p + i`. Every element is finished at exactly one rank, so all ranks end bit-identical.
//!
//! Ranges longer than `chunk` go in pieces, and a pairwise exchange alternates "send piece `j`, receive
//! piece `j`", so two partners never both wait on a full channel. Each rank of the `p` sends
//! `(p−1)/p` of the buffer as partials and as much again as results, in `2·log2 p` steps (`+2` for the
//! fold): `2·log2 p·α + 2(p−1)/p·bytes·β`, the latency of a tree with the traffic of a ring.

use std::ops::Range;

use crate::{chunk_of, Action, Buf};

/// Recursive halving-doubling all-reduce of `count` elements on rank `rank` of `world`, `chunk`
/// elements per message.
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
    assert!(chunk > 0, "chunk of zero elements");
    let p = fold_size(world);
    let all = 0..count;
    let mut plan = Vec::new();
    if rank >= p {
        let partner = rank - p;
        plan.extend(pieces(&all, chunk).map(|range| Action::SendAcc { to: partner, range }));
        plan.extend(pieces(&all, chunk).map(|output| Action::RecvCopy {
            from: partner,
            output,
            forward: None,
        }));
        return plan;
    }
    let extra = (rank + p < world).then_some(rank + p);
    let mut loaded = false;
    if let Some(from) = extra {
        if count > 0 {
            plan.push(Action::LoadAcc { range: all.clone() });
        }
        plan.extend(pieces(&all, chunk).map(|range| Action::RecvCombine { from, range }));
        loaded = true;
    }
    let steps = p.trailing_zeros() as usize;
    let mut path = Vec::with_capacity(steps);
    let mut cur = all.clone();
    for k in 0..steps {
        let partner = rank ^ (1 << k);
        let (keep, give) = halves(&cur, rank >> k & 1 == 1);
        if !loaded && !keep.is_empty() {
            plan.push(Action::LoadAcc {
                range: keep.clone(),
            });
        }
        let first = !loaded;
        exchange(
            &mut plan,
            &give,
            &keep,
            chunk,
            |range| {
                if first {
                    Action::SendAcc { to: partner, range }
                } else {
                    Action::SendScratch { to: partner, range }
                }
            },
            |range| Action::RecvCombine {
                from: partner,
                range,
            },
        );
        loaded = true;
        path.push(std::mem::replace(&mut cur, keep));
    }
    if !cur.is_empty() {
        plan.push(Action::FinishScratch {
            range: cur.clone(),
            nranks: world,
        });
    }
    for k in (0..steps).rev() {
        let partner = rank ^ (1 << k);
        let (mine, theirs) = halves(&path[k], rank >> k & 1 == 1);
        exchange(
            &mut plan,
            &mine,
            &theirs,
            chunk,
            |range| Action::Send {
                to: partner,
                buf: Buf::Output,
                range,
            },
            |output| Action::RecvCopy {
                from: partner,
                output,
                forward: None,
            },
        );
    }
    if let Some(to) = extra {
        plan.extend(pieces(&all, chunk).map(|range| Action::Send {
            to,
            buf: Buf::Output,
            range,
        }));
    }
    plan
}

/// The largest power of two `≤ world` (the ranks that run the halving and doubling).
pub fn fold_size(world: usize) -> usize {
    assert!(world > 0, "empty world");
    1 << (usize::BITS - 1 - world.leading_zeros())
}

/// Splits `r` into (the half a rank keeps, the half it gives away): the upper half when `upper`.
pub(crate) fn halves(r: &Range<usize>, upper: bool) -> (Range<usize>, Range<usize>) {
    let mid = r.start + r.len() / 2;
    let (lo, hi) = (r.start..mid, mid..r.end);
    if upper {
        (hi, lo)
    } else {
        (lo, hi)
    }
}

/// `r` in messages of at most `chunk` elements (none for an empty range).
fn pieces(r: &Range<usize>, chunk: usize) -> impl Iterator<Item = Range<usize>> + '_ {
    (0..r.len().div_ceil(chunk)).map(move |c| chunk_of(r, c, chunk))
}

/// Sends `out` and receives `inc` in pieces, alternating one of each.
fn exchange(
    plan: &mut Vec<Action>,
    out: &Range<usize>,
    inc: &Range<usize>,
    chunk: usize,
    send: impl Fn(Range<usize>) -> Action,
    recv: impl Fn(Range<usize>) -> Action,
) {
    let (n_out, n_in) = (out.len().div_ceil(chunk), inc.len().div_ceil(chunk));
    for j in 0..n_out.max(n_in) {
        if j < n_out {
            plan.push(send(chunk_of(out, j, chunk)));
        }
        if j < n_in {
            plan.push(recv(chunk_of(inc, j, chunk)));
        }
    }
}
