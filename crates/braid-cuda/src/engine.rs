//! The device engine: the executor's kernels queued on a CUDA stream.
//!
//! Each [`Kernel`] becomes a reduce-copy launch (or an async copy) on the engine's stream, followed by
//! an event; the [`Ticket`] it returns completes when that event does, so the executor releases a slot
//! or posts a message only once the kernel that reads or writes it has finished. The host never blocks
//! on the GPU: `complete` queries events, and `wait` polls them until its deadline.
//!
//! An ordered reduction of a number of sources the catalogue has no kernel for (see
//! [`ORDERED_SOURCES`]) runs as a chain in the accumulator type — to_acc, combine, ..., finalize —
//! which reduces in the same order and rounds once, so its result is the CPU's bit for bit.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::{DType, Error, ReduceOp};
use braid_exec::{Engine, Kernel, Operand, Scratch, Ticket};
use braid_transport::{MemKind, Span};

use crate::driver::{DeviceBuffer, Event, Gpu, Priority, Stream};
use crate::launch::ReduceCopyKernels;
use crate::{Shape, ORDERED_SOURCES};

/// A kernel queued and not yet known to have finished.
struct Pending {
    ticket: u64,
    event: Event,
    /// Device memory the kernel uses that must outlive it (a replaced accumulator buffer).
    keep: Vec<DeviceBuffer>,
}

/// Runs the executor's kernels on one device, in issue order on one stream.
pub struct CudaEngine {
    kernels: Arc<ReduceCopyKernels>,
    stream: Stream,
    pending: VecDeque<Pending>,
    spare_events: Vec<Event>,
    next: u64,
    completed: u64,
    /// The accumulator of chained ordered reductions; reused in stream order, grown when needed.
    acc: Option<DeviceBuffer>,
    retired: Vec<DeviceBuffer>,
}

impl CudaEngine {
    /// An engine over `kernels` with its own stream of `priority`.
    pub fn new(kernels: Arc<ReduceCopyKernels>, priority: Priority) -> Result<CudaEngine, Error> {
        let stream = Stream::new(kernels.gpu(), priority)?;
        Ok(CudaEngine::on_stream(kernels, stream))
    }

    /// An engine that queues on `stream` (e.g. one the caller made, or borrowed from a framework).
    pub fn on_stream(kernels: Arc<ReduceCopyKernels>, stream: Stream) -> CudaEngine {
        CudaEngine {
            kernels,
            stream,
            pending: VecDeque::new(),
            spare_events: Vec::new(),
            next: 0,
            completed: 0,
            acc: None,
            retired: Vec::new(),
        }
    }

    /// The stream the kernels run on (for events that order other streams after them).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    fn gpu(&self) -> &Gpu {
        self.kernels.gpu()
    }

    fn addr(&self, span: &Span, what: &str) -> Result<u64, Error> {
        if span.is_empty() {
            return Ok(0);
        }
        match span.kind() {
            MemKind::Device { ordinal } if ordinal == self.gpu().ordinal() => {
                Ok(span.addr() as u64)
            }
            k => Err(Error::Internal(format!(
                "the cuda engine of device {} was given {} as the {what}",
                self.gpu().ordinal(),
                k.describe()
            ))),
        }
    }

    fn operand(&self, o: &Operand, dst: u64, what: &str) -> Result<u64, Error> {
        match o {
            Operand::Dst => Ok(dst),
            Operand::Span(s) => self.addr(s, what),
        }
    }

    /// An accumulator of at least `bytes`, valid in stream order from now on.
    fn acc(&mut self, bytes: usize) -> Result<u64, Error> {
        if self.acc.as_ref().is_none_or(|b| b.len() < bytes) {
            let fresh = DeviceBuffer::alloc(self.gpu(), bytes.next_power_of_two())?;
            // Kernels queued before may still use the old one: it lives until the next ticket completes.
            if let Some(old) = self.acc.replace(fresh) {
                self.retired.push(old);
            }
        }
        Ok(self.acc.as_ref().map_or(0, |b| b.addr()))
    }

    /// # Safety
    /// As [`ReduceCopyKernels::launch`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &self,
        shape: Shape,
        dtype: DType,
        op: ReduceOp,
        srcs: &[u64],
        dsts: &[u64],
        count: usize,
        nranks: usize,
    ) -> Result<(), Error> {
        // SAFETY: the caller's contract.
        unsafe {
            self.kernels
                .launch(&self.stream, shape, dtype, op, srcs, dsts, count, nranks)
        }
    }

    /// Queues `kernel` on the stream, without the event.
    ///
    /// # Safety
    /// [`Engine::submit`]'s contract.
    unsafe fn queue(&mut self, kernel: &Kernel<'_>) -> Result<(), Error> {
        let len_err = |what: &str, a: usize, b: usize| {
            Err(Error::Internal(format!(
                "{what}: operands of {a} and {b} bytes"
            )))
        };
        let elems = |dtype: DType, bytes: usize| bytes / dtype.size();
        let ratio = |dtype: DType| dtype.accumulator().size() / dtype.size();
        // SAFETY (every launch and copy below): the executor's contract makes every span valid memory
        // of this device until the ticket completes, destinations exclusively the kernel's.
        match *kernel {
            Kernel::Copy { dst, src } => {
                if dst.len() != src.len() {
                    return len_err("copy", dst.len(), src.len());
                }
                let (d, s) = (self.addr(&dst, "destination")?, self.addr(&src, "source")?);
                // SAFETY: see above.
                unsafe { self.stream.copy(d, s, dst.len()) }
            }
            Kernel::ToAcc { dtype, dst, src } => {
                if dst.len() != src.len() * ratio(dtype) {
                    return len_err("to_acc", dst.len(), src.len());
                }
                let (d, s) = (self.addr(&dst, "destination")?, self.addr(&src, "source")?);
                // SAFETY: see above.
                unsafe {
                    self.run(
                        Shape::ToAcc,
                        dtype,
                        ReduceOp::Sum,
                        &[s],
                        &[d],
                        elems(dtype, src.len()),
                        1,
                    )
                }
            }
            Kernel::Combine {
                dtype,
                op,
                dst,
                partial,
                input,
            } => {
                if dst.len() != partial.len() || dst.len() != input.len() * ratio(dtype) {
                    return len_err("combine", dst.len(), input.len());
                }
                let d = self.addr(&dst, "destination")?;
                let p = self.addr(&partial, "partial")?;
                let i = self.addr(&input, "input")?;
                // SAFETY: see above.
                unsafe {
                    self.run(
                        Shape::Combine,
                        dtype,
                        op,
                        &[p, i],
                        &[d],
                        elems(dtype, input.len()),
                        1,
                    )
                }
            }
            Kernel::Finalize {
                dtype,
                op,
                nranks,
                dst,
                partial,
                own,
            } => {
                if dst.len() * ratio(dtype) != partial.len() {
                    return len_err("finalize", dst.len(), partial.len());
                }
                if let Operand::Span(s) = own {
                    if s.len() != dst.len() {
                        return len_err("finalize", dst.len(), s.len());
                    }
                }
                let d = self.addr(&dst, "destination")?;
                let p = self.addr(&partial, "partial")?;
                let o = self.operand(&own, d, "own input")?;
                // SAFETY: see above.
                unsafe {
                    self.run(
                        Shape::Finalize,
                        dtype,
                        op,
                        &[p, o],
                        &[d],
                        elems(dtype, dst.len()),
                        nranks,
                    )
                }
            }
            Kernel::CombineAcc {
                dtype,
                op,
                acc,
                partial,
            } => {
                if acc.len() != partial.len() {
                    return len_err("combine_acc", acc.len(), partial.len());
                }
                let a = self.addr(&acc, "accumulator")?;
                let p = self.addr(&partial, "partial")?;
                let count = acc.len() / dtype.accumulator().size();
                // SAFETY: see above; the accumulator is source 0 and the destination, exactly.
                unsafe { self.run(Shape::CombineAcc, dtype, op, &[a, p], &[a], count, 1) }
            }
            Kernel::FinishAcc {
                dtype,
                op,
                nranks,
                dst,
                acc,
            } => {
                if dst.len() * ratio(dtype) != acc.len() {
                    return len_err("finish_acc", dst.len(), acc.len());
                }
                let d = self.addr(&dst, "destination")?;
                let a = self.addr(&acc, "accumulator")?;
                // SAFETY: see above.
                unsafe {
                    self.run(
                        Shape::FinishAcc,
                        dtype,
                        op,
                        &[a],
                        &[d],
                        elems(dtype, dst.len()),
                        nranks,
                    )
                }
            }
            Kernel::ReduceOrdered {
                dtype,
                op,
                dst,
                srcs,
            } => {
                if srcs.is_empty() {
                    return Err(Error::Internal("reduce_ordered without sources".into()));
                }
                for s in srcs {
                    if let Operand::Span(s) = s {
                        if s.len() != dst.len() {
                            return len_err("reduce_ordered", dst.len(), s.len());
                        }
                    }
                }
                let d = self.addr(&dst, "destination")?;
                let addrs = srcs
                    .iter()
                    .map(|o| self.operand(o, d, "source"))
                    .collect::<Result<Vec<u64>, Error>>()?;
                let count = elems(dtype, dst.len());
                let n = addrs.len();
                if ORDERED_SOURCES.contains(&n) {
                    // SAFETY: see above.
                    return unsafe {
                        self.run(Shape::Ordered(n), dtype, op, &addrs, &[d], count, n)
                    };
                }
                // A chain in the accumulator type: same order, one rounding.
                let acc = self.acc(count * dtype.accumulator().size())?;
                // SAFETY: see above; `acc` is the engine's, used in stream order only.
                unsafe {
                    self.run(Shape::ToAcc, dtype, op, &addrs[..1], &[acc], count, 1)?;
                    if n == 1 {
                        return self.run(Shape::FinishAcc, dtype, op, &[acc], &[d], count, 1);
                    }
                    for &s in &addrs[1..n - 1] {
                        self.run(Shape::Combine, dtype, op, &[acc, s], &[acc], count, 1)?;
                    }
                    self.run(
                        Shape::Finalize,
                        dtype,
                        op,
                        &[acc, addrs[n - 1]],
                        &[d],
                        count,
                        n,
                    )
                }
            }
        }
    }

    /// Drops what finished kernels held; returns whether the queue is empty.
    fn reap(&mut self) -> Result<bool, Error> {
        while let Some(front) = self.pending.front() {
            if !front.event.is_done()? {
                return Ok(false);
            }
            if let Some(done) = self.pending.pop_front() {
                self.completed = done.ticket;
                self.spare_events.push(done.event);
            }
        }
        Ok(true)
    }
}

impl Engine for CudaEngine {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn accepts(&self, kind: MemKind) -> bool {
        kind == (MemKind::Device {
            ordinal: self.gpu().ordinal(),
        })
    }

    unsafe fn submit(&mut self, kernel: &Kernel<'_>) -> Result<Option<Ticket>, Error> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.queue(kernel)? };
        let event = match self.spare_events.pop() {
            Some(e) => e,
            None => Event::new(self.gpu(), false)?,
        };
        event.record(&self.stream)?;
        self.next += 1;
        self.pending.push_back(Pending {
            ticket: self.next,
            event,
            keep: std::mem::take(&mut self.retired),
        });
        Ok(Some(Ticket(self.next)))
    }

    fn complete(&mut self, ticket: Ticket) -> Result<bool, Error> {
        if ticket.0 <= self.completed {
            return Ok(true);
        }
        self.reap()?;
        Ok(ticket.0 <= self.completed)
    }

    fn wait(&mut self, ticket: Ticket, until: Instant) -> Result<(), Error> {
        let mut spins = 0u32;
        while !self.complete(ticket)? {
            let now = Instant::now();
            if now >= until {
                return Ok(());
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50).min(until - now));
            }
        }
        Ok(())
    }

    fn quiesce(&mut self, until: Instant) -> Result<(), Error> {
        self.stream.synchronize(until)?;
        self.reap().map(|_| ())
    }

    fn scratch(&mut self, bytes: usize) -> Result<Scratch, Error> {
        let buffer = DeviceBuffer::alloc(self.gpu(), bytes)?;
        // SAFETY: the buffer is this engine's and only kernels queued after this fill (on the same
        // stream) will use it.
        unsafe { self.stream.fill(buffer.addr(), 0, bytes)? };
        let span = buffer.span();
        // SAFETY: the span is the buffer's, which moves into the scratch and lives as long as it.
        Ok(unsafe { Scratch::new(span, Box::new(buffer)) })
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        // Memory a queued kernel uses must not be freed under it: wait (bounded) for the stream, and if
        // it does not finish, leak the buffers rather than free memory in use.
        if let Err(e) = self
            .stream
            .synchronize(Instant::now() + Duration::from_secs(10))
        {
            tracing::warn!(
                "dropping the cuda engine with kernels still running ({e}); its buffers are leaked"
            );
            for p in self.pending.drain(..) {
                std::mem::forget(p.keep);
            }
            std::mem::forget(self.acc.take());
            std::mem::forget(std::mem::take(&mut self.retired));
        }
    }
}
