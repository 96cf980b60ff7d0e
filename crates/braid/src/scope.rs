//! Streams from the caller's side: priorities, events between streams, asynchronous collectives on a
//! chosen stream, and zero-copy asynchronous collectives on borrowed buffers ([`Communicator::scope`]).
//!
//! Owned buffers (`Vec<T>`) move into the work and come back from [`Work::wait`]; borrowed ones live in
//! a scope, like `std::thread::scope`: every collective started in it has completed when the scope
//! returns, so the borrow checker guarantees what NCCL leaves to the caller (buffers stay alive and
//! untouched until the work is done).

use std::marker::PhantomData;
use std::ops::Range;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use braid_core::{DType, Element, Error, ReduceOp};
use parking_lot::Mutex;
use tracing::error;

use crate::call::{Blocks, Call, Kind};
use crate::comm::Communicator;
use crate::streams::{Priority, StreamEvent, Task, Work};

impl Communicator {
    /// Number of streams (`BRAID_STREAMS`). Stream 0 carries the blocking calls and the `*_async`
    /// calls without a stream.
    pub fn streams(&self) -> usize {
        self.inner.streams.count()
    }

    /// Sets the priority of `stream`: a high-priority stream's ready work is advanced first.
    pub fn set_stream_priority(&self, stream: usize, priority: Priority) -> Result<(), Error> {
        self.inner.streams.set_priority(stream, priority)
    }

    /// The priority of `stream`.
    pub fn stream_priority(&self, stream: usize) -> Result<Priority, Error> {
        self.inner.streams.priority(stream)
    }

    /// An event marking everything issued on `stream` so far.
    pub fn record_event(&self, stream: usize) -> Result<StreamEvent, Error> {
        self.inner.streams.record(stream)
    }

    /// Makes the ops issued on `stream` from now on start only after everything before `event` (on
    /// its stream) has completed.
    pub fn wait_event(&self, stream: usize, event: &StreamEvent) -> Result<(), Error> {
        self.inner.streams.wait_event(stream, event)
    }

    /// Enqueues an in-place all-reduce of an owned buffer on `stream`.
    pub fn all_reduce_async_on<T: Element>(
        &self,
        stream: usize,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Work<Vec<T>>, Error> {
        self.submit_owned_on(stream, Kind::AllReduce, op, buf)
    }

    /// Enqueues a barrier on `stream`.
    pub fn barrier_async_on(&self, stream: usize) -> Result<Work<()>, Error> {
        self.submit_on(stream, Call::barrier(), Box::new(()))
    }

    /// Queues a collective on the caller's raw buffers on `stream` (the `*_raw_async` calls' tail).
    ///
    /// # Safety
    /// As [`Call::new`]: the buffers stay valid, and untouched by anyone else, until the work completes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn submit_raw(
        &self,
        stream: usize,
        kind: Kind,
        dtype: DType,
        redop: ReduceOp,
        count: usize,
        send: *const u8,
        send_len: usize,
        recv: *mut u8,
        recv_len: usize,
    ) -> Result<Work<()>, Error> {
        // SAFETY: the caller's contract is the op's.
        let op = unsafe { Call::new(kind, dtype, redop, count, send, send_len, recv, recv_len) };
        self.submit_on(stream, op, Box::new(()))
    }

    /// Enqueues an all-reduce of `len` bytes of `dtype` elements from `send` into `recv` (which may be
    /// `send`) on `stream`, without copying: the work reads and writes the caller's memory.
    ///
    /// # Safety
    /// `send` must be valid for reads and `recv` for reads and writes of `len` bytes until the work has
    /// completed ([`Work::test`] true or [`Work::wait`] returned), and nothing else may write them (or
    /// read `recv`) meanwhile; the buffers are the same or do not overlap.
    pub unsafe fn all_reduce_raw_async(
        &self,
        stream: usize,
        send: *const u8,
        recv: *mut u8,
        len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work<()>, Error> {
        let count = self.elems(len, dtype, "receive")?;
        // SAFETY: the caller's contract is the op's.
        unsafe {
            self.submit_raw(
                stream,
                Kind::AllReduce,
                dtype,
                op,
                count,
                send,
                len,
                recv,
                len,
            )
        }
    }

    /// Enqueues an all-gather of `len` bytes per rank into `recv` (`world × len` bytes; `send` may be
    /// this rank's block of it) on `stream`, without copying.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_raw_async`], with `recv` valid for `world × len` bytes.
    pub unsafe fn all_gather_raw_async(
        &self,
        stream: usize,
        send: *const u8,
        recv: *mut u8,
        len: usize,
        dtype: DType,
    ) -> Result<Work<()>, Error> {
        let count = self.elems(len, dtype, "send")?;
        let total = len
            .checked_mul(self.inner.world)
            .ok_or_else(|| Error::invalid("all_gather: world × send length overflows"))?;
        // SAFETY: the caller's contract is the op's.
        unsafe {
            self.submit_raw(
                stream,
                Kind::AllGather,
                dtype,
                ReduceOp::Sum,
                count,
                send,
                len,
                recv,
                total,
            )
        }
    }

    /// Enqueues a broadcast of `len` bytes from `root` (read from `send` there) into every rank's
    /// `recv` on `stream`, without copying.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_raw_async`].
    pub unsafe fn broadcast_raw_async(
        &self,
        stream: usize,
        send: *const u8,
        recv: *mut u8,
        len: usize,
        dtype: DType,
        root: usize,
    ) -> Result<Work<()>, Error> {
        let count = self.elems(len, dtype, "receive")?;
        if root >= self.inner.world {
            return Err(Error::invalid(format!(
                "root {root} is not a rank of this communicator of {}",
                self.inner.world
            )));
        }
        // SAFETY: the caller's contract is the op's.
        unsafe {
            self.submit_raw(
                stream,
                Kind::Broadcast { root },
                dtype,
                ReduceOp::Sum,
                count,
                send,
                len,
                recv,
                len,
            )
        }
    }

    /// Enqueues a reduce-scatter on `stream`, without copying: `send` holds `world` blocks of `len`
    /// bytes and rank `r`'s `recv` (`len` bytes) gets the reduction of block `r`. In place when `recv`
    /// is this rank's block of `send`.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_raw_async`], with `send` valid for `world × len` bytes and `recv`
    /// for `len`; `recv` is this rank's block of `send` or apart from it.
    pub unsafe fn reduce_scatter_raw_async(
        &self,
        stream: usize,
        send: *const u8,
        recv: *mut u8,
        len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<Work<()>, Error> {
        let count = self.elems(len, dtype, "receive")?;
        let total = len
            .checked_mul(self.inner.world)
            .ok_or_else(|| Error::invalid("reduce_scatter: world × receive length overflows"))?;
        // SAFETY: the caller's contract is the op's.
        unsafe {
            self.submit_raw(
                stream,
                Kind::ReduceScatter,
                dtype,
                op,
                count,
                send,
                total,
                recv,
                len,
            )
        }
    }

    /// Enqueues a reduce of `len` bytes from every rank's `send` into `root`'s `recv` on `stream`,
    /// without copying. Off the root `recv` is not touched (pass `None`).
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_raw_async`]; on the root `recv` is `Some`, valid for `len` bytes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_raw_async(
        &self,
        stream: usize,
        send: *const u8,
        recv: Option<*mut u8>,
        len: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<Work<()>, Error> {
        self.check_root(root)?;
        let count = self.elems(len, dtype, "send")?;
        let (recv, recv_len) = match recv {
            Some(r) if self.inner.rank == root => (r, len),
            None if self.inner.rank != root => (send as *mut u8, 0),
            _ => {
                return Err(Error::invalid(format!(
                    "reduce: a receive buffer is given on the root {root} only (this is rank {})",
                    self.inner.rank
                )))
            }
        };
        // SAFETY: the caller's contract is the op's; off the root the send buffer is only read.
        unsafe {
            self.submit_raw(
                stream,
                Kind::Reduce { root },
                dtype,
                op,
                count,
                send,
                len,
                recv,
                recv_len,
            )
        }
    }

    /// Enqueues an all-to-all on `stream`, without copying: `send` and `recv` each hold `world` blocks
    /// of `block` bytes; this rank's send block `j` goes to rank `j`, and receive block `p` is what rank
    /// `p` sent here.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_raw_async`], with both buffers valid for `world × block` bytes
    /// and apart.
    pub unsafe fn all_to_all_raw_async(
        &self,
        stream: usize,
        send: *const u8,
        recv: *mut u8,
        block: usize,
        dtype: DType,
    ) -> Result<Work<()>, Error> {
        let count = self.elems(block, dtype, "block")?;
        let total = block
            .checked_mul(self.inner.world)
            .ok_or_else(|| Error::invalid("all_to_all: world × block length overflows"))?;
        // SAFETY: the caller's contract is the op's.
        unsafe {
            self.submit_raw(
                stream,
                Kind::AllToAll,
                dtype,
                ReduceOp::Sum,
                count,
                send,
                total,
                recv,
                total,
            )
        }
    }

    /// Enqueues an all-to-all whose blocks differ in size on `stream`, without copying: `send[j]` (a
    /// range of elements of `send_buf`) goes to rank `j`, and what rank `p` sends here lands in
    /// `recv[p]` of `recv_buf`. The sizes must agree pairwise (this rank's `send[j]` is as long as rank
    /// `j`'s `recv[me]`): a rank receiving a block of another non-zero size fails with a mismatch (its
    /// peers at their next collective); an empty block on one side only is noticed by a later collective
    /// or the timeout. This rank's own block is copied, so `send[me]` and `recv[me]` have the same length.
    ///
    /// # Safety
    /// As [`Communicator::all_reduce_raw_async`], with `send_buf` valid for `send_len` bytes, `recv_buf`
    /// for `recv_len`, and the two apart.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_to_all_v_raw_async(
        &self,
        stream: usize,
        send_buf: *const u8,
        send_len: usize,
        send: Vec<Range<usize>>,
        recv_buf: *mut u8,
        recv_len: usize,
        recv: Vec<Range<usize>>,
        dtype: DType,
    ) -> Result<Work<()>, Error> {
        let (world, me) = (self.inner.world, self.inner.rank);
        let send_elems = self.elems(send_len, dtype, "send")?;
        let recv_elems = self.elems(recv_len, dtype, "receive")?;
        if send.len() != world || recv.len() != world {
            return Err(Error::invalid(format!(
                "all_to_all_v: {} send and {} receive blocks for {world} ranks (one each per rank)",
                send.len(),
                recv.len()
            )));
        }
        let outside = |blocks: &[Range<usize>], len: usize| {
            blocks.iter().position(|r| r.start > r.end || r.end > len)
        };
        if let Some(j) = outside(&send, send_elems) {
            return Err(Error::invalid(format!(
                "all_to_all_v: send block {j} ({:?}) does not lie within the send buffer's {send_elems} elements",
                send[j]
            )));
        }
        if let Some(p) = outside(&recv, recv_elems) {
            return Err(Error::invalid(format!(
                "all_to_all_v: receive block {p} ({:?}) does not lie within the receive buffer's {recv_elems} elements",
                recv[p]
            )));
        }
        if send[me].len() != recv[me].len() {
            return Err(Error::invalid(format!(
                "all_to_all_v: this rank's own block is {} elements to send and {} to receive",
                send[me].len(),
                recv[me].len()
            )));
        }
        // The ranks' totals differ: the op's count (compared across ranks by the debug checks) is 0,
        // and every message's length is checked on arrival instead.
        // SAFETY: the caller's contract is the op's; every block lies within its buffer (checked).
        let op = unsafe {
            Call::new(
                Kind::AllToAll,
                dtype,
                ReduceOp::Sum,
                0,
                send_buf,
                send_len,
                recv_buf,
                recv_len,
            )
            .with_blocks(Blocks { send, recv })
        };
        self.submit_on(stream, op, Box::new(()))
    }

    /// Runs `f` with a [`Scope`] in which collectives work on borrowed buffers without copying; every
    /// one of them has completed when `scope` returns (it waits for them, also when `f` panics).
    ///
    /// A collective that does not complete within twice the timeout makes the scope abort the
    /// communicator, after which it completes promptly with an error; the scope never returns while one
    /// could still touch a borrowed buffer.
    pub fn scope<'env, F, R>(&'env self, f: F) -> R
    where
        F: for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> R,
    {
        let scope = Scope {
            comm: self,
            tasks: Mutex::new(Vec::new()),
            _scope: PhantomData,
            _env: PhantomData,
        };
        let r = catch_unwind(AssertUnwindSafe(|| f(&scope)));
        scope.wait_all();
        match r {
            Ok(r) => r,
            Err(p) => resume_unwind(p),
        }
    }
}

/// Collectives on borrowed buffers; see [`Communicator::scope`].
pub struct Scope<'scope, 'env: 'scope> {
    comm: &'env Communicator,
    tasks: Mutex<Vec<Arc<Task>>>,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

/// A collective started in a [`Scope`].
#[must_use = "a collective's result is only known after wait()"]
pub struct ScopedWork<'scope> {
    work: Work<()>,
    _scope: PhantomData<&'scope ()>,
}

impl ScopedWork<'_> {
    /// Whether the op has finished.
    pub fn test(&self) -> bool {
        self.work.test()
    }

    /// Calls `f` with the op's result once it completes (see [`Work::on_complete`]).
    pub fn on_complete(&self, f: impl FnOnce(&Result<(), Error>) + Send + 'static) {
        self.work.on_complete(f)
    }

    /// Waits for the op.
    pub fn wait(self) -> Result<(), Error> {
        self.work.wait()
    }
}

impl<'scope, 'env> Scope<'scope, 'env> {
    /// The communicator.
    pub fn communicator(&self) -> &'env Communicator {
        self.comm
    }

    fn start(&'scope self, stream: usize, op: Call) -> Result<ScopedWork<'scope>, Error> {
        let inner = &self.comm.inner;
        let task = inner.streams.task(op, Some(Box::new(())));
        inner.streams.submit(task.clone(), stream)?;
        self.tasks.lock().push(task.clone());
        Ok(ScopedWork {
            work: Work::new(
                task,
                inner.rank,
                inner.streams_limit(),
                Some(Arc::downgrade(&inner.streams)),
            ),
            _scope: PhantomData,
        })
    }

    /// All-reduce `send` into `recv` (same length) on `stream`.
    pub fn all_reduce<T: Element>(
        &'scope self,
        stream: usize,
        send: &'env [T],
        recv: &'env mut [T],
        op: ReduceOp,
    ) -> Result<ScopedWork<'scope>, Error> {
        if send.len() != recv.len() {
            return Err(Error::invalid(format!(
                "all_reduce: send buffer has {} elements, receive buffer {}",
                send.len(),
                recv.len()
            )));
        }
        let len = std::mem::size_of_val(recv);
        // SAFETY: both borrows last for 'env, which outlives the scope, and the scope waits for the op
        // before it returns; the borrow checker keeps them unaliased.
        let op = unsafe {
            Call::new(
                Kind::AllReduce,
                T::DTYPE,
                op,
                recv.len(),
                send.as_ptr() as *const u8,
                len,
                recv.as_mut_ptr() as *mut u8,
                len,
            )
        };
        self.start(stream, op)
    }

    /// Starts `kind` in place on `buf`.
    fn in_place<T: Element>(
        &'scope self,
        stream: usize,
        kind: Kind,
        buf: &'env mut [T],
        op: ReduceOp,
    ) -> Result<ScopedWork<'scope>, Error> {
        let len = std::mem::size_of_val(buf);
        let p = buf.as_mut_ptr() as *mut u8;
        // SAFETY: as in `all_reduce`, with one buffer.
        let op = unsafe { Call::new(kind, T::DTYPE, op, buf.len(), p, len, p, len) };
        self.start(stream, op)
    }

    /// All-reduce `buf` in place on `stream`.
    pub fn all_reduce_in_place<T: Element>(
        &'scope self,
        stream: usize,
        buf: &'env mut [T],
        op: ReduceOp,
    ) -> Result<ScopedWork<'scope>, Error> {
        self.in_place(stream, Kind::AllReduce, buf, op)
    }

    /// Broadcast `buf` from `root` in place on `stream`.
    pub fn broadcast_in_place<T: Element>(
        &'scope self,
        stream: usize,
        buf: &'env mut [T],
        root: usize,
    ) -> Result<ScopedWork<'scope>, Error> {
        if root >= self.comm.inner.world {
            return Err(Error::invalid(format!(
                "root {root} is not a rank of this communicator of {}",
                self.comm.inner.world
            )));
        }
        self.in_place(stream, Kind::Broadcast { root }, buf, ReduceOp::Sum)
    }

    /// A barrier on `stream`.
    pub fn barrier(&'scope self, stream: usize) -> Result<ScopedWork<'scope>, Error> {
        self.start(stream, Call::barrier())
    }

    /// Waits for every collective of the scope; see [`Communicator::scope`].
    fn wait_all(&self) {
        let tasks = std::mem::take(&mut *self.tasks.lock());
        let limit = self.comm.inner.streams_limit();
        for t in tasks {
            let mut deadline = Instant::now() + limit;
            let mut aborted = false;
            while t.wait_result(deadline).is_none() {
                if !aborted {
                    error!(
                        "rank {}: {} in a scope did not complete within {limit:?}; aborting",
                        self.comm.rank(),
                        t.op.kind.name()
                    );
                    self.comm.abort();
                    aborted = true;
                }
                deadline = Instant::now() + limit;
            }
        }
    }
}
