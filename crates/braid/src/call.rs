//! One collective call, validated, as the communicator hands it to the executor: which collective,
//! over which buffers.

use std::ops::Range;

use braid_core::{DType, Error, ReduceOp};
use braid_transport::Span;

use crate::tune::Collective;

/// Which collective an op runs, with the root of those that have one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast { root: usize },
    Reduce { root: usize },
    Barrier,
    AllToAll,
}

impl Kind {
    /// The collective.
    pub(crate) fn collective(self) -> Collective {
        match self {
            Kind::AllReduce => Collective::AllReduce,
            Kind::ReduceScatter => Collective::ReduceScatter,
            Kind::AllGather => Collective::AllGather,
            Kind::Broadcast { .. } => Collective::Broadcast,
            Kind::Reduce { .. } => Collective::Reduce,
            Kind::Barrier => Collective::Barrier,
            Kind::AllToAll => Collective::AllToAll,
        }
    }

    /// The root rank (0 where there is none).
    pub(crate) fn root(self) -> usize {
        match self {
            Kind::Broadcast { root } | Kind::Reduce { root } => root,
            _ => 0,
        }
    }

    /// [`Collective::name`].
    pub(crate) fn name(self) -> &'static str {
        self.collective().name()
    }
}

/// The blocks of an all-to-all whose sizes differ per peer (in elements): `send[j]` of the input goes
/// to rank `j`, rank `i`'s block lands in `recv[i]` of the output ([`braid_sched::direct::all_to_all_v`]).
pub(crate) struct Blocks {
    pub send: Vec<Range<usize>>,
    pub recv: Vec<Range<usize>>,
}

/// One collective call, validated, over host memory.
pub(crate) struct Call {
    pub kind: Kind,
    pub dtype: DType,
    pub count: usize,
    pub(crate) spec: braid_exec::Op,
    /// An all-to-all of blocks of any size instead of the planner's schedule for `kind`.
    pub(crate) blocks: Option<Box<Blocks>>,
}

impl Call {
    /// # Safety
    /// `send` must be valid for reads of `send_len` bytes and `recv` for reads and writes of `recv_len`
    /// bytes until the op has run; nothing else may access them meanwhile. The buffers are identical, or
    /// `send` is the rank's own block inside `recv` (in-place all-gather), or they do not overlap. The
    /// lengths must be those the collective needs (checked by the communicator).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn new(
        kind: Kind,
        dtype: DType,
        redop: ReduceOp,
        count: usize,
        send: *const u8,
        send_len: usize,
        recv: *mut u8,
        recv_len: usize,
    ) -> Call {
        // SAFETY: the caller's contract is the spans' contract.
        let (send, recv) = unsafe {
            (
                Span::host(send as *mut u8, send_len),
                Span::host(recv, recv_len),
            )
        };
        Call {
            kind,
            dtype,
            count,
            spec: braid_exec::Op {
                collective: kind.collective(),
                root: kind.root(),
                dtype,
                redop,
                count,
                send,
                recv,
            },
            blocks: None,
        }
    }

    /// Whether the op's reduction applies to its dtype (a bitwise reduction of floats does not): checked
    /// before an op is issued, so that a refused one changes nothing.
    pub(crate) fn check(&self) -> Result<(), Error> {
        match self.kind {
            Kind::AllReduce | Kind::ReduceScatter | Kind::Reduce { .. } => {
                self.spec.redop.check_dtype(self.dtype)
            }
            _ => Ok(()),
        }
    }

    /// Whether it runs an all-to-all of blocks of any size.
    pub(crate) fn has_blocks(&self) -> bool {
        self.blocks.is_some()
    }

    /// Its input and output.
    pub(crate) fn spans(&self) -> (Span, Span) {
        (self.spec.send, self.spec.recv)
    }

    /// Its reduction.
    pub(crate) fn redop(&self) -> ReduceOp {
        self.spec.redop
    }

    /// The op runs an all-to-all of `blocks` (direct, each block its own size) instead of its kind's
    /// schedule; `count` stays what the ranks compare under debug checks, so it must be the same on
    /// every rank (the total over all blocks of all ranks).
    ///
    /// # Safety
    /// Every range of `blocks` must lie within the op's buffers (input for `send`, output for `recv`).
    pub(crate) unsafe fn with_blocks(mut self, blocks: Blocks) -> Call {
        self.blocks = Some(Box::new(blocks));
        self
    }
}

impl Call {
    /// An in-place all-gather of `count` elements per rank over the `world × count` elements at
    /// `base`; this rank's block (`rank`) is the input.
    ///
    /// # Safety
    /// `base` must be valid for reads and writes of `world × count` elements of `dtype` until the op
    /// has run, and nothing else may access them meanwhile.
    pub(crate) unsafe fn all_gather_in_place(
        dtype: DType,
        count: usize,
        rank: usize,
        world: usize,
        base: *mut u8,
    ) -> Call {
        let es = dtype.size();
        // SAFETY: the caller's contract; the input is this rank's block inside the output, which the
        // all-gather schedule only reads (and never writes to another block's range).
        unsafe {
            Call::new(
                Kind::AllGather,
                dtype,
                ReduceOp::Sum,
                count,
                base.add(rank * count * es),
                count * es,
                base,
                world * count * es,
            )
        }
    }

    /// A barrier: no buffers.
    pub(crate) fn barrier() -> Call {
        // SAFETY: no memory at all (null with zero lengths).
        unsafe {
            Call::new(
                Kind::Barrier,
                DType::U8,
                ReduceOp::Sum,
                0,
                std::ptr::null(),
                0,
                std::ptr::null_mut(),
                0,
            )
        }
    }
}

// SAFETY: a `Call` is a description of buffers whose validity its creator guarantees until the op
// completes, whichever thread runs it (see `Call::new`).
unsafe impl Send for Call {}
// SAFETY: sharing a `Call` shares only addresses; the memory behind them is touched solely by the
// executor, which runs one op at a time under the communicator's executor lock.
unsafe impl Sync for Call {}
