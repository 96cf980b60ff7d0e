//! [`EmulatedDeviceEngine`]: a device engine for machines without a GPU.
//!
//! It computes on the memory of an [`EmulatedDevice`](braid_transport::EmulatedDevice) — host memory
//! that spans call `MemKind::Device { ordinal }` — with the CPU engine's kernels, and keeps what the
//! executor can see of a GPU's semantics: it accepts only its own device's memory (host memory and other
//! devices' are refused), and a kernel does not run when submitted but when its ticket completes, a
//! configurable number of polls later, in issue order. A schedule that posted a slot before the kernel
//! filling it had finished, or released one before the kernel reading it had, would send or lose data
//! here exactly as on a GPU.

use std::collections::VecDeque;
use std::time::Instant;

use braid_core::{DType, Error, ReduceOp};
use braid_transport::{MemKind, Span};

use crate::engine::{CpuEngine, Engine, Kernel, Operand, Scratch, Ticket};

/// A kernel waiting to run, its spans already translated to the host memory behind them.
enum Deferred {
    Fixed(Kernel<'static>),
    Ordered {
        dtype: DType,
        op: ReduceOp,
        dst: Span,
        srcs: Vec<Operand>,
    },
}

struct Queued {
    ticket: u64,
    /// Polls of `complete` left before it runs.
    polls: u32,
    kernel: Deferred,
}

/// The CPU engine over emulated device memory (see the module docs).
pub struct EmulatedDeviceEngine {
    ordinal: u32,
    lag: u32,
    cpu: CpuEngine,
    queue: VecDeque<Queued>,
    next: u64,
    completed: u64,
}

impl EmulatedDeviceEngine {
    /// An engine for emulated device `ordinal` whose kernels run `lag` polls of
    /// [`Engine::complete`] after they were submitted (0: at the first poll).
    pub fn new(ordinal: u32, lag: u32) -> EmulatedDeviceEngine {
        EmulatedDeviceEngine {
            ordinal,
            lag,
            cpu: CpuEngine::new(),
            queue: VecDeque::new(),
            next: 0,
            completed: 0,
        }
    }

    /// The host span behind an emulated device span.
    fn host(&self, s: Span) -> Result<Span, Error> {
        if s.is_empty() {
            return Ok(Span::EMPTY);
        }
        match s.kind() {
            MemKind::Device { ordinal } if ordinal == self.ordinal => {
                // SAFETY: emulated device memory is host memory mapped in this process at the span's
                // address; the submitter's contract covers its validity until the kernel completes.
                Ok(unsafe { Span::host(s.addr() as *mut u8, s.len()) })
            }
            k => Err(Error::Internal(format!(
                "the emulated engine of device {} was given {}",
                self.ordinal,
                k.describe()
            ))),
        }
    }

    fn operand(&self, o: Operand) -> Result<Operand, Error> {
        Ok(match o {
            Operand::Dst => Operand::Dst,
            Operand::Span(s) => Operand::Span(self.host(s)?),
        })
    }

    fn translate(&self, k: &Kernel<'_>) -> Result<Deferred, Error> {
        let h = |s: Span| self.host(s);
        Ok(Deferred::Fixed(match *k {
            Kernel::Copy { dst, src } => Kernel::Copy {
                dst: h(dst)?,
                src: h(src)?,
            },
            Kernel::ToAcc { dtype, dst, src } => Kernel::ToAcc {
                dtype,
                dst: h(dst)?,
                src: h(src)?,
            },
            Kernel::Combine {
                dtype,
                op,
                dst,
                partial,
                input,
            } => Kernel::Combine {
                dtype,
                op,
                dst: h(dst)?,
                partial: h(partial)?,
                input: h(input)?,
            },
            Kernel::Finalize {
                dtype,
                op,
                nranks,
                dst,
                partial,
                own,
            } => Kernel::Finalize {
                dtype,
                op,
                nranks,
                dst: h(dst)?,
                partial: h(partial)?,
                own: self.operand(own)?,
            },
            Kernel::CombineAcc {
                dtype,
                op,
                acc,
                partial,
            } => Kernel::CombineAcc {
                dtype,
                op,
                acc: h(acc)?,
                partial: h(partial)?,
            },
            Kernel::FinishAcc {
                dtype,
                op,
                nranks,
                dst,
                acc,
            } => Kernel::FinishAcc {
                dtype,
                op,
                nranks,
                dst: h(dst)?,
                acc: h(acc)?,
            },
            Kernel::ReduceOrdered {
                dtype,
                op,
                dst,
                srcs,
            } => {
                return Ok(Deferred::Ordered {
                    dtype,
                    op,
                    dst: h(dst)?,
                    srcs: srcs
                        .iter()
                        .map(|&o| self.operand(o))
                        .collect::<Result<_, _>>()?,
                })
            }
        }))
    }

    /// Runs the front kernel.
    fn run_front(&mut self) -> Result<(), Error> {
        let Some(q) = self.queue.pop_front() else {
            return Ok(());
        };
        // SAFETY: the spans were the submitter's, valid until this ticket completes (which is now),
        // translated to the same host bytes.
        let done = unsafe {
            match &q.kernel {
                Deferred::Fixed(k) => self.cpu.submit(k),
                Deferred::Ordered {
                    dtype,
                    op,
                    dst,
                    srcs,
                } => self.cpu.submit(&Kernel::ReduceOrdered {
                    dtype: *dtype,
                    op: *op,
                    dst: *dst,
                    srcs,
                }),
            }
        };
        self.completed = q.ticket;
        done.map(|_| ())
    }
}

impl Engine for EmulatedDeviceEngine {
    fn name(&self) -> &'static str {
        "emulated"
    }

    fn accepts(&self, kind: MemKind) -> bool {
        kind == (MemKind::Device {
            ordinal: self.ordinal,
        })
    }

    unsafe fn submit(&mut self, kernel: &Kernel<'_>) -> Result<Option<Ticket>, Error> {
        let kernel = self.translate(kernel)?;
        self.next += 1;
        self.queue.push_back(Queued {
            ticket: self.next,
            polls: self.lag,
            kernel,
        });
        Ok(Some(Ticket(self.next)))
    }

    fn complete(&mut self, ticket: Ticket) -> Result<bool, Error> {
        if let Some(front) = self.queue.front_mut() {
            if front.polls == 0 {
                self.run_front()?;
            } else {
                front.polls -= 1;
            }
        }
        Ok(ticket.0 <= self.completed)
    }

    fn wait(&mut self, ticket: Ticket, _until: Instant) -> Result<(), Error> {
        // A device finishes what it was given: everything up to `ticket` runs now.
        while self.completed < ticket.0 && !self.queue.is_empty() {
            self.run_front()?;
        }
        Ok(())
    }

    fn quiesce(&mut self, _until: Instant) -> Result<(), Error> {
        while !self.queue.is_empty() {
            self.run_front()?;
        }
        Ok(())
    }

    fn scratch(&mut self, bytes: usize) -> Result<Scratch, Error> {
        let host = self.cpu.scratch(bytes)?;
        let span = host.span();
        // SAFETY: the host scratch moves into the new scratch and lives as long as it; the span
        // describes its bytes as this emulated device's memory.
        unsafe {
            let dev = Span::device(span.addr() as u64, span.len(), self.ordinal);
            Ok(Scratch::new(dev, Box::new(host)))
        }
    }
}
