//! braid-sched: collective algorithms as schedules, free of I/O.
//!
//! A schedule is a plain `Vec<Action>` per rank: send this range to that peer, receive a partial and
//! reduce it into the next peer's slot, and so on. It knows nothing of transports or threads. braid-exec's
//! executor walks these actions over shared memory, sockets or an in-memory network; its simulator runs
//! every algorithm on 1..64 ranks that way and checks results bit for bit.
//!
//! Topology-aware schedules take the hosts into account: [`ring::all_reduce_ordered`] runs the ring in
//! any rank order (host by host, it crosses each host boundary once), and [`hier`] reduces within each
//! host, all-reduces across hosts and gathers within each host; [`cost`] models both with one link class
//! within hosts and one between them.
//!
//! [`sparse`] holds the index side of top-k's sparse all-reduce: the balanced partition of the index
//! space, the routing of pairs to it, the choice between gathering and reduce-scattering pairs, and
//! the exact bytes of each way; [`direct::all_to_all_v`] and [`direct::all_gather_v`] move its blocks.
//!
//! [`plan`] is the one entry point from a [`Collective`], an [`Algo`] and the hosts to a rank's schedule;
//! [`cost::traffic`] counts what that schedule sends.
//!
//! Actions are fused the way the data moves: "receive a partial, combine it with my input, put the result
//! in the next peer's slot" is one action, so an executor can read each byte once.
//!
//! ```
//! use braid_sched::{ring, Action};
//! // Rank 0 of a 3-rank ring all-reduce of 5 elements in chunks of 2: it starts by sending a partial.
//! let plan = ring::all_reduce(3, 0, 5, 2);
//! assert!(matches!(plan[0], Action::SendAcc { to: 1, .. }));
//! ```
#![forbid(unsafe_code)]

mod algo;
pub mod cost;
pub mod direct;
pub mod hier;
mod plan;
pub mod rhd;
pub mod ring;
pub mod shared;
pub mod sparse;
pub mod tree;

pub use algo::{Algo, Collective};
pub use plan::{plan, PlanSpec};

use std::ops::Range;

/// Which user buffer an action reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// The send (input) buffer.
    Input,
    /// The receive (output) buffer.
    Output,
}

/// One step of a rank's schedule. Ranges are in elements of the user buffers. Data sent with `Send`,
/// `RecvCopy` and the forward of `RecvReduceFinal` travels in the buffer's dtype; partials (`SendAcc`,
/// `RecvReduceSend`) travel in the accumulator type (f32 for f16/bf16).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Copy `input[src]` to `output[dst]` locally.
    Copy {
        /// Input range.
        src: Range<usize>,
        /// Output range, same length.
        dst: Range<usize>,
    },
    /// Send `buf[range]` to `to` unchanged. An empty range is a pure signal.
    Send {
        /// Receiving rank.
        to: usize,
        /// Buffer read.
        buf: Buf,
        /// Elements sent.
        range: Range<usize>,
    },
    /// Send `input[range]` converted to the accumulator type: the first link of a reduction chain.
    SendAcc {
        /// Receiving rank.
        to: usize,
        /// Elements sent.
        range: Range<usize>,
    },
    /// Receive a partial from `from`, combine `input[range]` into it, send the new partial to `to`.
    RecvReduceSend {
        /// Sending rank.
        from: usize,
        /// Next rank of the chain.
        to: usize,
        /// Input elements combined.
        range: Range<usize>,
    },
    /// Receive a partial from `from`, combine `input[input]` and finalise (round, divide for avg over
    /// `nranks`) into `output[output]`; then send that result to `forward`, if any.
    RecvReduceFinal {
        /// Sending rank.
        from: usize,
        /// Input elements combined.
        input: Range<usize>,
        /// Output elements written.
        output: Range<usize>,
        /// Rank to pass the final result to.
        forward: Option<usize>,
        /// Contributions in the chain.
        nranks: usize,
    },
    /// Receive data from `from` into `output[output]`, then send it on to `forward`, if any. An empty
    /// range waits for a pure signal.
    RecvCopy {
        /// Sending rank.
        from: usize,
        /// Output elements written.
        output: Range<usize>,
        /// Rank to pass the data to.
        forward: Option<usize>,
    },
    /// Receive a counterpart of `input[input]` from every other rank and write the reduction of all
    /// `nranks` contributions, in rank order (this rank's own from `input[input]`), to `output[output]`.
    RecvReduceAll {
        /// Own contribution (input elements).
        input: Range<usize>,
        /// Output elements written (same length).
        output: Range<usize>,
        /// Number of ranks.
        nranks: usize,
    },
    /// `scratch[range] = to_acc(input[range])`: start a partial in the rank's scratch buffer (accumulator
    /// type, indexed like the input). Algorithms that combine several partials at one rank (trees,
    /// recursive halving) accumulate there.
    LoadAcc {
        /// Elements loaded.
        range: Range<usize>,
    },
    /// Receive a partial (accumulator type) from `from` and combine it into `scratch[range]`
    /// (`scratch = scratch op partial`).
    RecvCombine {
        /// Sending rank.
        from: usize,
        /// Elements combined.
        range: Range<usize>,
    },
    /// Send `scratch[range]` (accumulator type) to `to`.
    SendScratch {
        /// Receiving rank.
        to: usize,
        /// Elements sent.
        range: Range<usize>,
    },
    /// `output[range] = finish(scratch[range])`: round to the dtype and divide for avg over `nranks`.
    FinishScratch {
        /// Elements finished.
        range: Range<usize>,
        /// Contributions in the reduction.
        nranks: usize,
    },
}

/// Splits `count` elements into `parts` contiguous ranges whose lengths differ by at most one.
pub fn partition(count: usize, parts: usize) -> Vec<Range<usize>> {
    assert!(parts > 0, "partition into zero parts");
    let (base, extra) = (count / parts, count % parts);
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// The `c`-th chunk of `seg` when chunks hold `chunk` elements (possibly empty past the end).
pub fn chunk_of(seg: &Range<usize>, c: usize, chunk: usize) -> Range<usize> {
    let start = (seg.start + c * chunk).min(seg.end);
    start..(start + chunk).min(seg.end)
}

/// Number of chunks needed for the longest of `segs`, at least one.
pub fn chunks_needed(segs: &[Range<usize>], chunk: usize) -> usize {
    let longest = segs.iter().map(|s| s.len()).max().unwrap_or(0);
    longest.div_ceil(chunk.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn partition_covers_exactly(count in 0usize..10_000, parts in 1usize..70) {
            let p = partition(count, parts);
            prop_assert_eq!(p.len(), parts);
            prop_assert_eq!(p[0].start, 0);
            prop_assert_eq!(p[parts - 1].end, count);
            for w in p.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
                prop_assert!(w[0].len() >= w[1].len() && w[0].len() - w[1].len() <= 1);
            }
        }

        #[test]
        fn chunks_tile_segment(start in 0usize..100, len in 0usize..1000, chunk in 1usize..64) {
            let seg = start..start + len;
            let n = chunks_needed(std::slice::from_ref(&seg), chunk);
            let mut next = seg.start;
            for c in 0..n {
                let r = chunk_of(&seg, c, chunk);
                prop_assert_eq!(r.start, next);
                prop_assert!(r.len() <= chunk);
                next = r.end;
            }
            prop_assert_eq!(next, seg.end);
        }
    }
}
