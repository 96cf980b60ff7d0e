//! The communicator: its accessors, abort and sticky errors, and the asynchronous calls of stream 0.
//! Its type and state are in `state.rs`, creating one in `init.rs`, the blocking collectives and their
//! argument checks in `collectives.rs`; ops run on streams (`../streams.rs`), and calls on chosen
//! streams and borrowed buffers are in `../scope.rs`.
//!
//! Every collective becomes a [`Call`]; blocking calls and the `*_async` calls without a stream run on
//! stream 0, in the order they were issued.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use braid_core::{Config, Element, Error, ReduceOp};

use crate::call::{Call, Kind};
use crate::streams::{Task, Work};
use crate::tune::{Algo, Collective};

mod collectives;
mod init;
mod register;
mod state;

pub use register::Registration;
pub use state::Communicator;

impl Communicator {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world
    }

    /// How this rank reaches each rank: `"self"`, `"shm"` or `"tcp"`, indexed by rank.
    pub fn peer_transports(&self) -> &[&'static str] {
        &self.inner.routes
    }

    /// The ranks of each host, as the communicator groups them (hosts in order of their first rank).
    pub fn hosts(&self) -> &[Vec<usize>] {
        &self.inner.hosts
    }

    /// The topology in use: from `BRAID_TOPO_FILE`, from probing (`BRAID_TOPO_PROBE`), or from the host
    /// identities exchanged at bootstrap.
    pub fn topology(&self) -> &braid_topo::Topology {
        &self.inner.topology
    }

    /// A one-line summary of the transports in use, e.g. `shm+tcp, 2 hosts`.
    pub fn transports_summary(&self) -> String {
        let mut kinds: Vec<&str> = self
            .inner
            .routes
            .iter()
            .copied()
            .filter(|r| *r != "self")
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        let kinds = if kinds.is_empty() {
            "nothing (one rank)".to_string()
        } else {
            kinds.join("+")
        };
        match self.inner.hosts.len() {
            1 => format!("{kinds}, 1 host"),
            h => format!("{kinds}, {h} hosts"),
        }
    }

    /// The configuration in effect.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The algorithm braid would use for `c` at `bytes` bytes, and why (`forced`, `table`, `model`,
    /// `rule`).
    pub fn algorithm(&self, c: Collective, bytes: usize) -> (Algo, &'static str) {
        self.inner
            .streams
            .sched
            .lock()
            .exec
            .tuner
            .pick_with_reason(c, bytes)
    }

    /// Forces the algorithm of `c` on this rank from the next call on (`None` returns the choice to
    /// braid). Every rank must make the same call at the same point in its sequence of collectives.
    pub fn set_algorithm(&self, c: Collective, algo: Option<Algo>) -> Result<(), Error> {
        self.inner.streams.sched.lock().exec.tuner.force(c, algo)
    }

    /// The last collectives of this communicator (up to 64), oldest first: what ran, with which
    /// algorithm, for how long, and how it ended. Readable while a collective is blocked.
    pub fn flight_record(&self) -> Vec<crate::FlightRecord> {
        self.inner.recorder.snapshot()
    }

    /// The first error that made this communicator unusable, if any.
    pub fn async_error(&self) -> Option<Error> {
        self.inner.streams.sticky()
    }

    /// Aborts: every blocked or later call on this communicator returns an error promptly, and peers
    /// waiting on this rank learn that it failed. Safe to call from any thread.
    pub fn abort(&self) {
        let inner = &self.inner;
        inner.abort.store(true, Ordering::SeqCst);
        inner.streams.abort(Error::Aborted {
            rank: inner.rank,
            during: String::new(),
        });
    }

    // ---- asynchronous collectives -----------------------------------------------------------------

    /// Enqueues an in-place all-reduce of an owned buffer; [`Work::wait`] gives it back reduced.
    pub fn all_reduce_async<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.submit_owned(Kind::AllReduce, op, buf)
    }

    /// Enqueues an in-place broadcast of an owned buffer from `root`.
    pub fn broadcast_async<T: Element>(
        &self,
        buf: Vec<T>,
        root: usize,
    ) -> Result<Work<Vec<T>>, Error> {
        self.check_root(root)?;
        Ok(self.submit_owned(Kind::Broadcast { root }, ReduceOp::Sum, buf))
    }

    /// Enqueues an all-gather; [`Work::wait`] returns the gathered buffer (`world × send.len()`).
    pub fn all_gather_async<T: Element>(&self, send: Vec<T>) -> Work<Vec<T>> {
        let world = self.inner.world;
        let count = send.len();
        let total = match count.checked_mul(world) {
            Some(n) => braid_core::alloc::filled(T::zeroed(), n, "the all-gather's output"),
            None => Err(Error::invalid(format!(
                "all_gather_async: {count} elements × {world} ranks overflows"
            ))),
        };
        let mut out = match total {
            Ok(v) => v,
            Err(e) => return self.failed_work(e),
        };
        out[self.inner.rank * count..(self.inner.rank + 1) * count].copy_from_slice(&send);
        drop(send);
        let mut boxed = Box::new(out);
        let base = boxed.as_mut_ptr() as *mut u8;
        // SAFETY: the vector (`world × count` elements) is owned by the task until it completes and is
        // not touched by anyone else meanwhile (moving the box does not move its heap buffer).
        let op =
            unsafe { Call::all_gather_in_place(T::DTYPE, count, self.inner.rank, world, base) };
        self.submit(op, boxed)
    }

    /// Enqueues a barrier.
    pub fn barrier_async(&self) -> Work<()> {
        self.submit(Call::barrier(), Box::new(()))
    }

    fn submit_owned<T: Element>(&self, kind: Kind, redop: ReduceOp, buf: Vec<T>) -> Work<Vec<T>> {
        self.submit_owned_on(0, kind, redop, buf)
            .unwrap_or_else(|e| self.failed_work(e))
    }

    /// Queues `kind` in place on an owned buffer on `stream`.
    pub(crate) fn submit_owned_on<T: Element>(
        &self,
        stream: usize,
        kind: Kind,
        redop: ReduceOp,
        buf: Vec<T>,
    ) -> Result<Work<Vec<T>>, Error> {
        let mut boxed = Box::new(buf);
        let len = boxed.len() * T::DTYPE.size();
        let count = boxed.len();
        let ptr = boxed.as_mut_ptr() as *mut u8;
        // SAFETY: the vector's heap buffer is owned by the task until it completes (moving the box does
        // not move the heap buffer) and nobody else touches it meanwhile.
        let op = unsafe { Call::new(kind, T::DTYPE, redop, count, ptr, len, ptr, len) };
        self.submit_on(stream, op, boxed)
    }

    fn submit<R: Send + 'static>(&self, op: Call, keep: Box<R>) -> Work<R> {
        self.submit_on(0, op, keep)
            .unwrap_or_else(|e| self.failed_work(e))
    }

    pub(crate) fn submit_on<R: Send + 'static>(
        &self,
        stream: usize,
        op: Call,
        keep: Box<R>,
    ) -> Result<Work<R>, Error> {
        let inner = &self.inner;
        let task = inner.streams.task(op, Some(keep));
        inner.streams.submit(task.clone(), stream)?;
        Ok(Work::new(
            task,
            inner.rank,
            inner.streams_limit(),
            Some(Arc::downgrade(&inner.streams)),
        ))
    }

    /// A second handle on this communicator, for a helper thread of braid's own; the communicator
    /// shuts down when the last handle is dropped.
    pub(crate) fn handle(&self) -> Communicator {
        Communicator {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Queues an in-place `kind` of `bytes` bytes of `dtype` elements at the start of an owned buffer
    /// (aligned for `dtype`) on `stream`; [`Work::wait`] gives the buffer back.
    pub(crate) fn submit_buffer_on<B: OwnedBytes>(
        &self,
        stream: usize,
        kind: Kind,
        dtype: braid_core::DType,
        redop: ReduceOp,
        buffer: B,
        bytes: usize,
    ) -> Result<Work<B>, Error> {
        let mut boxed = Box::new(buffer);
        let all = boxed.bytes_mut();
        if bytes > all.len()
            || bytes % dtype.size() != 0
            || all.as_ptr() as usize % dtype.size() != 0
        {
            return Err(Error::Internal(format!(
                "{bytes} bytes of {dtype} in a buffer of {} bytes",
                all.len()
            )));
        }
        let ptr = all.as_mut_ptr();
        // SAFETY: the first `bytes` bytes of the buffer (checked above) are owned by the task until it
        // completes; they do not move with the box (`OwnedBytes`), and nobody else touches them
        // meanwhile.
        let op = unsafe {
            Call::new(
                kind,
                dtype,
                redop,
                bytes / dtype.size(),
                ptr,
                bytes,
                ptr,
                bytes,
            )
        };
        self.submit_on(stream, op, boxed)
    }

    /// A work handle that already holds `e` (a submission that could not be queued).
    fn failed_work<R: Send + 'static>(&self, e: Error) -> Work<R> {
        let task = Task::new(Call::barrier(), None, 0);
        task.fail_now(e);
        Work::new(task, self.inner.rank, Duration::ZERO, None)
    }
}

/// A buffer a work item owns while it runs: its bytes live outside the value (on the heap, in a
/// mapping), so moving the value does not move them.
pub(crate) trait OwnedBytes: Send + 'static {
    /// The bytes.
    fn bytes_mut(&mut self) -> &mut [u8];
}

impl OwnedBytes for Vec<u64> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(self)
    }
}
