//! Engines: where reduce and copy kernels run.
//!
//! The executor never computes on memory itself; each step becomes a [`Kernel`] over [`Span`]s that an
//! [`Engine`] runs. [`CpuEngine`] runs kernels on the calling thread, on host memory only, and returns
//! them complete. A device engine (a CUDA stream) would queue them and hand back a [`Ticket`]; the executor
//! then defers the posts and releases that depend on the kernel until the ticket completes, so a slot is
//! returned to its sender only when nothing reads it any more.

use std::time::Instant;

use braid_core::reduce::{self, Src};
use braid_core::{DType, Error, ReduceOp};
use braid_transport::{MemKind, Span};

/// An operand of a kernel that may be the kernel's own destination (in place).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    /// Read from this span.
    Span(Span),
    /// Read the destination before it is overwritten.
    Dst,
}

/// One reduce or copy step. Destination and partials of `Combine`, `CombineAcc` and `FinishAcc` are in
/// the accumulator type of `dtype` (f32 for f16 and bf16); user data is in `dtype`.
#[derive(Clone, Copy, Debug)]
pub enum Kernel<'a> {
    /// `dst = src` (same length).
    Copy {
        /// Written.
        dst: Span,
        /// Read.
        src: Span,
    },
    /// `dst = to_acc(src)`.
    ToAcc {
        /// Element type of `src`.
        dtype: DType,
        /// Written (accumulator type).
        dst: Span,
        /// Read.
        src: Span,
    },
    /// `dst = partial op input`.
    Combine {
        /// Element type of `input`.
        dtype: DType,
        /// Reduction.
        op: ReduceOp,
        /// Written (accumulator type).
        dst: Span,
        /// Read (accumulator type).
        partial: Span,
        /// Read.
        input: Span,
    },
    /// `dst = finish(partial op own)`, divided by `nranks` for avg.
    Finalize {
        /// Element type.
        dtype: DType,
        /// Reduction.
        op: ReduceOp,
        /// Contributions in the chain.
        nranks: usize,
        /// Written.
        dst: Span,
        /// Read (accumulator type).
        partial: Span,
        /// This rank's contribution.
        own: Operand,
    },
    /// `acc = acc op partial`.
    CombineAcc {
        /// Element type.
        dtype: DType,
        /// Reduction.
        op: ReduceOp,
        /// Read and written (accumulator type).
        acc: Span,
        /// Read (accumulator type).
        partial: Span,
    },
    /// `dst = finish(acc)`.
    FinishAcc {
        /// Element type.
        dtype: DType,
        /// Reduction.
        op: ReduceOp,
        /// Contributions.
        nranks: usize,
        /// Written.
        dst: Span,
        /// Read (accumulator type).
        acc: Span,
    },
    /// `dst = finish(srcs[0] op srcs[1] op ...)` in order.
    ReduceOrdered {
        /// Element type.
        dtype: DType,
        /// Reduction.
        op: ReduceOp,
        /// Written.
        dst: Span,
        /// Read, at most one of them [`Operand::Dst`].
        srcs: &'a [Operand],
    },
}

impl Kernel<'_> {
    /// Every span the kernel touches.
    fn spans(&self, mut f: impl FnMut(&Span)) {
        let op = |o: &Operand, f: &mut dyn FnMut(&Span)| {
            if let Operand::Span(s) = o {
                f(s)
            }
        };
        match self {
            Kernel::Copy { dst, src } | Kernel::ToAcc { dst, src, .. } => {
                f(dst);
                f(src);
            }
            Kernel::Combine {
                dst,
                partial,
                input,
                ..
            } => {
                f(dst);
                f(partial);
                f(input);
            }
            Kernel::Finalize {
                dst, partial, own, ..
            } => {
                f(dst);
                f(partial);
                op(own, &mut f);
            }
            Kernel::CombineAcc { acc, partial, .. } => {
                f(acc);
                f(partial);
            }
            Kernel::FinishAcc { dst, acc, .. } => {
                f(dst);
                f(acc);
            }
            Kernel::ReduceOrdered { dst, srcs, .. } => {
                f(dst);
                for s in srcs.iter() {
                    op(s, &mut f);
                }
            }
        }
    }
}

/// A kernel an engine has queued and not yet finished. Tickets of one engine complete in issue order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket(pub u64);

/// Memory an engine allocated for an operation's partials; freed when dropped.
pub struct Scratch {
    span: Span,
    _keep: Box<dyn std::any::Any + Send>,
}

impl Scratch {
    /// Scratch memory over `keep`, which owns the bytes `span` describes.
    ///
    /// # Safety
    /// `span` must stay valid for reads and writes while `keep` lives, and nothing else may use it.
    pub unsafe fn new(span: Span, keep: Box<dyn std::any::Any + Send>) -> Scratch {
        Scratch { span, _keep: keep }
    }

    /// The memory.
    pub fn span(&self) -> Span {
        self.span
    }
}

/// Where kernels run.
pub trait Engine: Send {
    /// A short name for errors and logs.
    fn name(&self) -> &'static str;

    /// Whether this engine can compute on memory of `kind`.
    fn accepts(&self, kind: MemKind) -> bool;

    /// Runs `kernel` or queues it. `Ok(None)`: it is complete; `Ok(Some(t))`: it completes with `t`.
    ///
    /// # Safety
    /// Every span must be valid as its creator promised until the kernel completes; destinations must not
    /// overlap any other operand (in place is expressed by [`Operand::Dst`]), and nothing else may write
    /// the operands or touch the destination meanwhile.
    unsafe fn submit(&mut self, kernel: &Kernel<'_>) -> Result<Option<Ticket>, Error>;

    /// Whether every kernel completes when [`Engine::submit`] returns (never a ticket): then a blocking
    /// all-reduce of one message per peer runs in one straight pass.
    fn synchronous(&self) -> bool {
        false
    }

    /// Whether `ticket` has completed (every ticket issued before it has too).
    fn complete(&mut self, ticket: Ticket) -> Result<bool, Error>;

    /// Waits until `ticket` completes or `until` passes (`Ok` either way).
    fn wait(&mut self, ticket: Ticket, until: Instant) -> Result<(), Error>;

    /// At least `bytes` of zeroed scratch memory this engine can compute on. Fails with
    /// [`Error::OutOfMemory`] when it cannot be had.
    fn scratch(&mut self, bytes: usize) -> Result<Scratch, Error>;

    /// Waits until every kernel queued so far has finished, or fails once `until` passes (after an
    /// error, so that nothing still writes memory the caller gets back). Engines that complete kernels
    /// when they are submitted have nothing to wait for.
    fn quiesce(&mut self, _until: Instant) -> Result<(), Error> {
        Ok(())
    }
}

/// Checks that `engine` may compute on every span of `kernel`.
pub(crate) fn check_kinds<E: Engine + ?Sized>(
    engine: &E,
    kernel: &Kernel<'_>,
) -> Result<(), Error> {
    let mut bad = None;
    kernel.spans(|s| {
        if !s.is_empty() && !engine.accepts(s.kind()) {
            bad.get_or_insert(s.kind());
        }
    });
    match bad {
        None => Ok(()),
        Some(k) => Err(Error::Internal(format!(
            "the {} engine cannot compute on {}",
            engine.name(),
            k.describe()
        ))),
    }
}

/// Runs kernels on the calling thread with braid-core's vectorised reduce loops. Host memory only.
#[derive(Debug, Default)]
pub struct CpuEngine;

impl CpuEngine {
    /// The engine.
    pub fn new() -> CpuEngine {
        CpuEngine
    }
}

/// # Safety
/// As [`Span::as_slice`].
unsafe fn read<'a>(s: &Span) -> Result<&'a [u8], Error> {
    match s.kind() {
        // SAFETY: host memory, valid and unwritten while the kernel runs (the caller's contract).
        MemKind::Host => Ok(unsafe { s.as_slice() }),
        k => Err(Error::Internal(format!(
            "the cpu engine was given {}",
            k.describe()
        ))),
    }
}

/// # Safety
/// As [`Span::as_mut_slice`].
unsafe fn write<'a>(s: &Span) -> Result<&'a mut [u8], Error> {
    match s.kind() {
        // SAFETY: host memory, exclusively the kernel's while it runs (the caller's contract).
        MemKind::Host => Ok(unsafe { s.as_mut_slice() }),
        k => Err(Error::Internal(format!(
            "the cpu engine was given {}",
            k.describe()
        ))),
    }
}

fn same_len(what: &str, a: usize, b: usize) -> Result<(), Error> {
    if a == b {
        Ok(())
    } else {
        Err(Error::Internal(format!(
            "{what}: operands of {a} and {b} bytes"
        )))
    }
}

impl Engine for CpuEngine {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn accepts(&self, kind: MemKind) -> bool {
        kind == MemKind::Host
    }

    fn synchronous(&self) -> bool {
        true
    }

    unsafe fn submit(&mut self, kernel: &Kernel<'_>) -> Result<Option<Ticket>, Error> {
        // SAFETY (every block below): the caller's contract makes each span valid host memory (checked
        // by `read`/`write`), the destination exclusively ours and no operand aliasing it.
        match *kernel {
            Kernel::Copy { dst, src } => {
                same_len("copy", dst.len(), src.len())?;
                if !dst.is_empty() {
                    // SAFETY: as for every kernel here (see the top of `submit`).
                    unsafe { write(&dst)?.copy_from_slice(read(&src)?) };
                }
            }
            Kernel::ToAcc { dtype, dst, src } => {
                let acc = dtype.accumulator().size() / dtype.size();
                same_len("to_acc", dst.len(), src.len() * acc)?;
                // SAFETY: as for every kernel here (see the top of `submit`).
                unsafe { reduce::to_acc(dtype, write(&dst)?, read(&src)?) };
            }
            Kernel::Combine {
                dtype,
                op,
                dst,
                partial,
                input,
            } => {
                let acc = dtype.accumulator().size() / dtype.size();
                same_len("combine", dst.len(), partial.len())?;
                same_len("combine", dst.len(), input.len() * acc)?;
                // SAFETY: as for every kernel here (see the top of `submit`).
                unsafe { reduce::combine(dtype, op, write(&dst)?, read(&partial)?, read(&input)?) };
            }
            Kernel::Finalize {
                dtype,
                op,
                nranks,
                dst,
                partial,
                own,
            } => {
                let acc = dtype.accumulator().size() / dtype.size();
                same_len("finalize", dst.len() * acc, partial.len())?;
                let own = match own {
                    Operand::Dst => Src::Dst,
                    Operand::Span(s) => {
                        same_len("finalize", dst.len(), s.len())?;
                        // SAFETY: as for every kernel here (see the top of `submit`).
                        Src::Buf(unsafe { read(&s)? })
                    }
                };
                // SAFETY: as for every kernel here (see the top of `submit`).
                unsafe { reduce::finalize(dtype, op, nranks, write(&dst)?, read(&partial)?, own) };
            }
            Kernel::CombineAcc {
                dtype,
                op,
                acc,
                partial,
            } => {
                same_len("combine_acc", acc.len(), partial.len())?;
                // SAFETY: as for every kernel here (see the top of `submit`).
                unsafe { reduce::combine_acc(dtype, op, write(&acc)?, read(&partial)?) };
            }
            Kernel::FinishAcc {
                dtype,
                op,
                nranks,
                dst,
                acc,
            } => {
                let a = dtype.accumulator().size() / dtype.size();
                same_len("finish_acc", dst.len() * a, acc.len())?;
                // SAFETY: as for every kernel here (see the top of `submit`).
                unsafe { reduce::finish_acc(dtype, op, nranks, write(&dst)?, read(&acc)?) };
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
                let mut small = [Src::Dst; 8];
                let mut large = Vec::new();
                let view: &mut [Src<'_>] = if srcs.len() <= small.len() {
                    &mut small[..srcs.len()]
                } else {
                    large.resize(srcs.len(), Src::Dst);
                    &mut large
                };
                for (v, s) in view.iter_mut().zip(srcs) {
                    if let Operand::Span(s) = s {
                        same_len("reduce_ordered", dst.len(), s.len())?;
                        // SAFETY: as for every kernel here (see the top of `submit`).
                        *v = Src::Buf(unsafe { read(s)? });
                    }
                }
                // SAFETY: as for every kernel here (see the top of `submit`).
                unsafe { reduce::reduce_ordered(dtype, op, write(&dst)?, view) };
            }
        }
        Ok(None)
    }

    fn complete(&mut self, _ticket: Ticket) -> Result<bool, Error> {
        Ok(true)
    }

    fn wait(&mut self, _ticket: Ticket, _until: Instant) -> Result<(), Error> {
        Ok(())
    }

    fn scratch(&mut self, bytes: usize) -> Result<Scratch, Error> {
        let words = bytes.div_ceil(8);
        let mut v: Vec<u64> = Vec::new();
        v.try_reserve_exact(words)
            .map_err(|_| Error::OutOfMemory(format!("{bytes} bytes of scratch")))?;
        v.resize(words, 0);
        let mut b = v.into_boxed_slice();
        // SAFETY: the box owns `words * 8 >= bytes` bytes and moves into the scratch with the span; a
        // boxed slice's heap buffer does not move when the box does.
        // SAFETY: as for every kernel here (see the top of `submit`).
        unsafe {
            let span = Span::host(b.as_mut_ptr() as *mut u8, words * 8);
            Ok(Scratch::new(span, Box::new(b)))
        }
    }
}
