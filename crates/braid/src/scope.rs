//! Streams from the caller's side: priorities, events between streams, asynchronous collectives on a
//! chosen stream, and zero-copy asynchronous collectives on borrowed buffers ([`Communicator::scope`]).
//!
//! Owned buffers (`Vec<T>`) move into the work and come back from [`Work::wait`]; borrowed ones live in
//! a scope, like `std::thread::scope`: every collective started in it has completed when the scope
//! returns, so the borrow checker guarantees what NCCL leaves to the caller (buffers stay alive and
//! untouched until the work is done).

use std::marker::PhantomData;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use braid_core::{DType, Element, Error, ReduceOp};
use parking_lot::Mutex;
use tracing::error;

use crate::comm::Communicator;
use crate::exec::{Kind, Op};
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
        self.submit_on(stream, Op::barrier(), Box::new(()))
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
        let op = unsafe { Op::new(Kind::AllReduce, dtype, op, count, send, len, recv, len) };
        self.submit_on(stream, op, Box::new(()))
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
        let op = unsafe {
            Op::new(
                Kind::AllGather,
                dtype,
                ReduceOp::Sum,
                count,
                send,
                len,
                recv,
                total,
            )
        };
        self.submit_on(stream, op, Box::new(()))
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
        let op = unsafe {
            Op::new(
                Kind::Broadcast { root },
                dtype,
                ReduceOp::Sum,
                count,
                send,
                len,
                recv,
                len,
            )
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

    fn start(&'scope self, stream: usize, op: Op) -> Result<ScopedWork<'scope>, Error> {
        let inner = &self.comm.inner;
        let task = Task::new(op, Some(Box::new(())));
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
            Op::new(
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
        let op = unsafe { Op::new(kind, T::DTYPE, op, buf.len(), p, len, p, len) };
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
        self.start(stream, Op::barrier())
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
