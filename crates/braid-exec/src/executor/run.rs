//! One op in flight: the op, the state of its run, and what a poll of it says (done, blocked on a
//! [`Wait`], or yielded).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use braid_core::{DType, Error, ReduceOp};
use braid_sched::Collective;
use braid_transport::{Event, RecvSlot, SendSlot, Span};

use super::plan::Plan;
use crate::engine::{Scratch, Ticket};
use crate::fingerprint::Fingerprint;

/// One collective call: what to run and on which memory. `count` is in the collective's NCCL
/// convention (all-reduce: elements per buffer; reduce-scatter: output elements; all-gather: input
/// elements; all-to-all: elements per peer).
#[derive(Clone, Copy, Debug)]
pub struct Op {
    /// The collective.
    pub collective: Collective,
    /// The root rank of broadcast and reduce (0 for the others).
    pub root: usize,
    /// Element type.
    pub dtype: DType,
    /// Reduction (ignored by collectives that do not reduce).
    pub redop: ReduceOp,
    /// Element count.
    pub count: usize,
    /// The input. In place it is the output itself, or (all-gather) this rank's block of it.
    pub send: Span,
    /// The output.
    pub recv: Span,
}

impl Op {
    /// The op as a fingerprint other ranks compare with theirs.
    pub fn fingerprint(&self, seq: u64) -> Fingerprint {
        Fingerprint {
            kind: self.collective.index() as u8,
            dtype: self.dtype as u8,
            redop: self.redop as u8,
            root: self.root as u32,
            seq,
            count: self.count as u64,
        }
    }
}

/// What a run waits for when a poll cannot go further.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// An event on the link: data from `peer` or a credit for a message to it, on `channel`.
    Link {
        /// The peer.
        peer: usize,
        /// The channel.
        channel: usize,
        /// Data or credit.
        event: Event,
    },
    /// A kernel the engine queued.
    Engine(Ticket),
    /// A flag that `peer` raises in memory both map: runs over shared buffers, which the communicator
    /// drives itself (this executor never returns it).
    Flag {
        /// The peer.
        peer: usize,
    },
}

/// Where a run stands after a poll.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The run is complete: its output is final and every slot it used is back with its owner.
    Done,
    /// The run cannot go further until this happens.
    Blocked(Wait),
    /// The run used up the poll's step budget; it can go on at once.
    Yielded,
}

/// A post or release that waits for a kernel.
pub(super) enum Deferred {
    Post(SendSlot, usize),
    Release(RecvSlot),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Exchanging fingerprints: `sent` and `recvd` peers so far.
    Check { sent: usize, recvd: usize },
    /// Walking the plan.
    Plan,
    /// Waiting for the engine to finish what the plan queued.
    Drain,
    /// Complete.
    Done,
}

/// One op in flight on one rank.
pub struct Run {
    pub(super) op: Op,
    pub(super) seq: u64,
    pub(super) tag: u32,
    pub(super) channel: usize,
    /// `None` only while the executor walks it.
    pub(super) plan: Option<Arc<Plan>>,
    pub(super) phase: Phase,
    pub(super) pc: usize,
    pub(super) stage: u8,
    pub(super) rx: Vec<Option<RecvSlot>>,
    pub(super) tx: Option<SendSlot>,
    pub(super) scratch: Option<Scratch>,
    pub(super) pending: Option<Ticket>,
    pub(super) deferred: VecDeque<(Ticket, Deferred)>,
    pub(super) fingerprint: Option<Box<[u8; Fingerprint::LEN]>>,
    /// The first fingerprint that disagreed (boxed: it is rare and an error is large).
    pub(super) mismatch: Option<Box<Error>>,
    pub(super) started: Instant,
    pub(super) deadline: Instant,
    pub(super) steps: u64,
    /// Whether a send went straight from the caller's buffer
    /// ([`Link::post_from`](braid_transport::Link::post_from)): the run ends only once the link has
    /// stopped reading it.
    pub(super) sent_from_caller: bool,
}

impl Run {
    /// The op.
    pub fn op(&self) -> &Op {
        &self.op
    }

    /// Its sequence number (its tag on the wire).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Its channel.
    pub fn channel(&self) -> usize {
        self.channel
    }

    /// When it fails with a timeout.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// When it started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// How many steps it has completed: grows whenever a poll gets anywhere.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The index of the action it is at.
    pub fn position(&self) -> usize {
        self.pc
    }

    /// Whether it is complete.
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }
}

pub(super) type Step = Result<Option<Wait>, Error>;
