//! The steps of a run: each action of a schedule as slots to acquire, kernels to submit and posts and
//! releases to settle, resumable at every point where it must wait.

use std::ops::Range;
use std::sync::atomic::AtomicBool;

use braid_core::Error;
use braid_sched::{Action, Buf};
use braid_transport::{Event, Link, RecvSlot, Span, WaitCtx};

use super::run::{Deferred, Op, Phase, Run, Step, Wait};
use super::state::Cx;
use crate::engine::{check_kinds, Engine, Kernel, Operand, Scratch};
use crate::fingerprint::Fingerprint;

/// Byte range of element range `r` at `size` bytes per element.
fn bytes(r: &Range<usize>, size: usize) -> (usize, usize) {
    (r.start * size, r.end * size)
}

#[cold]
fn out_of_bounds(what: &str, r: &Range<usize>, es: usize, len: usize) -> Error {
    Error::Internal(format!(
        "the schedule reaches {what} elements {r:?} ({es} bytes each) beyond its {len} bytes"
    ))
}

/// Elements `r` of `span` at `size` bytes each.
#[inline]
pub(super) fn view(span: &Span, what: &str, r: &Range<usize>, size: usize) -> Result<Span, Error> {
    let (a, b) = bytes(r, size);
    span.sub(a, b)
        .ok_or_else(|| out_of_bounds(what, r, size, span.len()))
}

fn input(run: &Run, r: &Range<usize>) -> Result<Span, Error> {
    view(&run.op.send, "input", r, run.op.dtype.size())
}

fn output(run: &Run, r: &Range<usize>) -> Result<Span, Error> {
    view(&run.op.recv, "output", r, run.op.dtype.size())
}

fn scratch(run: &Run, r: &Range<usize>) -> Result<Span, Error> {
    let s = run
        .scratch
        .as_ref()
        .map(Scratch::span)
        .ok_or_else(|| Error::Internal("a schedule used scratch it did not ask for".into()))?;
    view(&s, "scratch", r, run.op.dtype.accumulator().size())
}

/// Whether `input[i]` and `output[o]` are the same bytes (in place).
fn same(run: &Run, i: &Range<usize>, o: &Range<usize>) -> bool {
    let es = run.op.dtype.size();
    run.op.send.kind() == run.op.recv.kind()
        && run.op.send.addr() + i.start * es == run.op.recv.addr() + o.start * es
}

fn submit<E: Engine + ?Sized>(engine: &mut E, run: &mut Run, k: &Kernel<'_>) -> Result<(), Error> {
    // Every span was checked where it entered the run: the op's buffers at start, slots when reserved
    // or received, scratch from the engine itself.
    debug_assert!(check_kinds(engine, k).is_ok(), "{k:?}");
    // SAFETY: the op's spans are valid until the run completes (their creator's promise); slot spans
    // are valid while the run holds the slot, which it does until the kernel completes (posts and
    // releases wait for it); scratch is the run's own. Destinations never overlap operands: the
    // executor passes in-place operands as `Operand::Dst` and skips copies onto themselves.
    if let Some(t) = unsafe { engine.submit(k)? } {
        run.pending = Some(t);
    }
    Ok(())
}

pub(super) fn local_step<E: Engine + ?Sized>(engine: &mut E, run: &mut Run, a: &Action) -> Step {
    match a {
        Action::Copy { src, dst } => {
            if !same(run, src, dst) {
                let k = Kernel::Copy {
                    dst: output(run, dst)?,
                    src: input(run, src)?,
                };
                submit(engine, run, &k)?;
            }
            Ok(None)
        }
        other => Err(Error::Internal(format!(
            "a one-rank schedule only copies, got {other:?}"
        ))),
    }
}

/// Refuses a received message the engine cannot read or (with `tag`) that belongs to another
/// collective; the caller releases it.
#[inline]
pub(super) fn accept<E: Engine + ?Sized>(
    engine: &E,
    slot: &RecvSlot,
    tag: Option<u32>,
    rank: usize,
    op: &Op,
    seq: u64,
) -> Result<(), Error> {
    let readable = slot.is_empty() || engine.accepts(slot.span().kind());
    if readable && tag.is_none_or(|t| t == slot.tag()) {
        return Ok(());
    }
    refuse(engine, slot, tag, rank, op, seq)
}

#[cold]
#[inline(never)]
fn refuse<E: Engine + ?Sized>(
    engine: &E,
    slot: &RecvSlot,
    tag: Option<u32>,
    rank: usize,
    op: &Op,
    seq: u64,
) -> Result<(), Error> {
    if !slot.is_empty() && !engine.accepts(slot.span().kind()) {
        return Err(Error::Internal(format!(
            "a message from rank {} arrived in {}, which the {} engine cannot read",
            slot.peer(),
            slot.span().kind().describe(),
            engine.name()
        )));
    }
    match tag {
        Some(want) if slot.tag() != want => Err(Error::Mismatch {
            rank,
            peer: slot.peer(),
            collective: op.collective.name().to_string(),
            seq,
            detail: format!(
                "message belongs to collective #{}, this rank is at #{want}",
                slot.tag()
            ),
        }),
        _ => Ok(()),
    }
}

/// Refuses a received message of another length than `want` bytes.
#[inline]
pub(super) fn check_len(
    slot: &RecvSlot,
    want: usize,
    rank: usize,
    op: &Op,
    seq: u64,
) -> Result<(), Error> {
    if slot.len() == want {
        return Ok(());
    }
    Err(wrong_len(slot, want, rank, op, seq))
}

#[cold]
#[inline(never)]
fn wrong_len(slot: &RecvSlot, want: usize, rank: usize, op: &Op, seq: u64) -> Error {
    Error::Mismatch {
        rank,
        peer: slot.peer(),
        collective: op.collective.name().to_string(),
        seq,
        detail: format!(
            "received {} bytes where {want} were expected (different counts or dtypes?)",
            slot.len()
        ),
    }
}

/// Does every deferred post and release whose kernel has completed.
pub(super) fn flush<E: Engine + ?Sized>(
    engine: &mut E,
    link: &dyn Link,
    rank: usize,
    abort: &AtomicBool,
    run: &mut Run,
) -> Result<(), Error> {
    while let Some((t, _)) = run.deferred.front() {
        if !engine.complete(*t)? {
            return Ok(());
        }
        let Some((_, d)) = run.deferred.pop_front() else {
            break;
        };
        let ctx = run_ctx(rank, abort, run);
        do_deferred(link, &ctx, run.tag, d)?;
    }
    if run.deferred.is_empty() {
        if let Some(t) = run.pending {
            if engine.complete(t)? {
                run.pending = None;
            }
        }
    }
    Ok(())
}

fn do_deferred(link: &dyn Link, ctx: &WaitCtx<'_>, tag: u32, d: Deferred) -> Result<(), Error> {
    match d {
        Deferred::Post(slot, len) => link.post(slot, len, tag, ctx),
        Deferred::Release(slot) => link.release(slot),
    }
}

/// The context a run's link calls name in their errors.
pub(super) fn run_ctx<'a>(rank: usize, abort: &'a AtomicBool, run: &Run) -> WaitCtx<'a> {
    WaitCtx {
        rank,
        collective: run.op.collective.name(),
        seq: run.seq,
        deadline: run.deadline,
        started: run.started,
        abort,
    }
}

impl<E: Engine + ?Sized> Cx<'_, E> {
    fn ctx(&self, run: &Run) -> WaitCtx<'_> {
        run_ctx(self.rank, self.abort, run)
    }

    /// Takes the next message from `peer` into `run.rx[idx]` unless one is held there; `false` when
    /// none has arrived. With `tagged`, the message must carry the run's tag.
    fn recv(
        &mut self,
        run: &mut Run,
        idx: usize,
        peer: usize,
        tagged: bool,
    ) -> Result<bool, Error> {
        if run.rx.get(idx).is_some_and(Option::is_some) {
            return Ok(true);
        }
        if idx >= run.rx.len() {
            return Err(Error::Internal(format!(
                "a schedule receives from rank {peer} of {}",
                self.world
            )));
        }
        let Some(slot) = self.link.try_recv(peer, run.channel, &self.ctx(run))? else {
            return Ok(false);
        };
        let tag = tagged.then_some(run.tag);
        if let Err(e) = accept(&*self.engine, &slot, tag, self.rank, &run.op, run.seq) {
            let _ = self.link.release(slot);
            return Err(e);
        }
        run.rx[idx] = Some(slot);
        Ok(true)
    }

    /// Reserves a slot at `peer` into `run.tx` unless one is held; `false` when there is no credit.
    fn reserve(&mut self, run: &mut Run, peer: usize) -> Result<bool, Error> {
        if run.tx.is_some() {
            return Ok(true);
        }
        match self.link.try_reserve(peer, run.channel, &self.ctx(run))? {
            Some(s) if !self.engine.accepts(s.span().kind()) => Err(Error::Internal(format!(
                "a slot at rank {peer} is {}, which the {} engine cannot write",
                s.span().kind().describe(),
                self.engine.name()
            ))),
            Some(s) => {
                run.tx = Some(s);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The held receive slot `idx`, of exactly `want` bytes.
    fn held(&self, run: &Run, idx: usize, want: usize) -> Result<Span, Error> {
        let Some(slot) = run.rx.get(idx).and_then(Option::as_ref) else {
            return Err(Error::Internal("no message held".into()));
        };
        check_len(slot, want, self.rank, &run.op, run.seq)?;
        Ok(slot.span())
    }

    /// The first `len` bytes of the held send slot.
    fn out_slot(&self, run: &Run, len: usize) -> Result<Span, Error> {
        let Some(slot) = run.tx.as_ref() else {
            return Err(Error::Internal("no send slot held".into()));
        };
        slot.span().prefix(len).ok_or_else(|| {
            Error::Internal(format!(
                "a message of {len} bytes does not fit a slot of {}",
                slot.span().len()
            ))
        })
    }

    fn kernel(&mut self, run: &mut Run, k: &Kernel<'_>) -> Result<(), Error> {
        submit(&mut *self.engine, run, k)
    }

    /// Posts the held send slot once the kernels before it have completed.
    fn post(&mut self, run: &mut Run, len: usize) -> Result<(), Error> {
        let Some(slot) = run.tx.take() else {
            return Err(Error::Internal("post without a slot".into()));
        };
        self.settle(run, Deferred::Post(slot, len))
    }

    /// Releases held receive slot `idx` once the kernels before it have completed.
    fn release(&mut self, run: &mut Run, idx: usize) -> Result<(), Error> {
        let Some(slot) = run.rx.get_mut(idx).and_then(Option::take) else {
            return Err(Error::Internal("release without a slot".into()));
        };
        self.settle(run, Deferred::Release(slot))
    }

    fn settle(&mut self, run: &mut Run, d: Deferred) -> Result<(), Error> {
        if run.pending.is_none() && run.deferred.is_empty() {
            // Every kernel so far has completed (the CPU engine's always have).
            return do_deferred(self.link, &run_ctx(self.rank, self.abort, run), run.tag, d);
        }
        if let Some(t) = run.pending {
            if !self.engine.complete(t)? {
                run.deferred.push_back((t, d));
                return Ok(());
            }
            run.pending = None;
        }
        flush(&mut *self.engine, self.link, self.rank, self.abort, run)?;
        if let Some((t, _)) = run.deferred.back() {
            let t = *t;
            run.deferred.push_back((t, d));
            return Ok(());
        }
        do_deferred(self.link, &run_ctx(self.rank, self.abort, run), run.tag, d)
    }

    /// The fingerprint exchange: send ours to every peer, compare theirs.
    pub(super) fn check(&mut self, run: &mut Run) -> Step {
        let Phase::Check {
            mut sent,
            mut recvd,
        } = run.phase
        else {
            return Ok(None);
        };
        let n = self.world;
        let r = loop {
            if sent < n - 1 {
                let to = (self.rank + 1 + sent) % n;
                if !self.reserve(run, to)? {
                    break Some(credit(to, run));
                }
                let Some(fp) = run.fingerprint.as_ref() else {
                    return Err(Error::Internal("fingerprint missing".into()));
                };
                // SAFETY: the boxed bytes live in the run until it ends, so past any kernel reading them.
                let src = unsafe { Span::host(fp.as_ptr() as *mut u8, fp.len()) };
                let k = Kernel::Copy {
                    dst: self.out_slot(run, Fingerprint::LEN)?,
                    src,
                };
                self.kernel(run, &k)?;
                self.post(run, Fingerprint::LEN)?;
                sent += 1;
                run.steps += 1;
            } else if recvd < n - 1 {
                let from = (self.rank + n - 1 - recvd) % n;
                if !self.recv(run, 0, from, false)? {
                    break Some(data(from, run));
                }
                let theirs = match run.rx[0].as_ref().map(RecvSlot::host_bytes) {
                    Some(Some(b)) => Fingerprint::decode(b),
                    _ => Err("a fingerprint that is not in host memory".to_string()),
                };
                self.release(run, 0)?;
                let mine = run.op.fingerprint(run.seq);
                let detail = match theirs {
                    Ok(f) if f == mine => None,
                    Ok(f) => Some(format!(
                        "rank {} runs {mine}; rank {from} runs {f}",
                        self.rank
                    )),
                    Err(e) => Some(format!("rank {from} sent a malformed fingerprint: {e}")),
                };
                if let (Some(detail), None) = (detail, &run.mismatch) {
                    run.mismatch = Some(Box::new(Error::Mismatch {
                        rank: self.rank,
                        peer: from,
                        collective: run.op.collective.name().to_string(),
                        seq: run.seq,
                        detail,
                    }));
                }
                recvd += 1;
                run.steps += 1;
            } else {
                break None;
            }
        };
        run.phase = Phase::Check { sent, recvd };
        Ok(r)
    }

    /// Executes `a`, or the rest of it, as far as it goes.
    pub(super) fn step(&mut self, run: &mut Run, a: &Action) -> Step {
        let (dtype, redop) = (run.op.dtype, run.op.redop);
        let (es, acc) = (dtype.size(), dtype.accumulator().size());
        match a {
            Action::Copy { .. } => local_step(&mut *self.engine, run, a),
            Action::Send { to, buf, range } => {
                let src = match buf {
                    Buf::Input => input(run, range)?,
                    Buf::Output => output(run, range)?,
                };
                // The caller's input of an out-of-place op is read only: a link may send from it.
                let direct = *buf == Buf::Input && !overlap(&run.op.send, &run.op.recv);
                self.send(run, *to, src, direct)
            }
            Action::SendAcc { to, range } => {
                if !self.reserve(run, *to)? {
                    return Ok(Some(credit(*to, run)));
                }
                let len = range.len() * acc;
                let k = Kernel::ToAcc {
                    dtype,
                    dst: self.out_slot(run, len)?,
                    src: input(run, range)?,
                };
                self.kernel(run, &k)?;
                self.post(run, len)?;
                Ok(None)
            }
            Action::RecvReduceSend { from, to, range } => {
                if !self.recv(run, 0, *from, true)? {
                    return Ok(Some(data(*from, run)));
                }
                let len = range.len() * acc;
                let partial = self.held(run, 0, len)?;
                if !self.reserve(run, *to)? {
                    return Ok(Some(credit(*to, run)));
                }
                let k = Kernel::Combine {
                    dtype,
                    op: redop,
                    dst: self.out_slot(run, len)?,
                    partial,
                    input: input(run, range)?,
                };
                self.kernel(run, &k)?;
                self.post(run, len)?;
                self.release(run, 0)?;
                Ok(None)
            }
            Action::RecvReduceFinal {
                from,
                input: ir,
                output: or,
                forward,
                nranks,
            } => {
                if run.stage == 0 {
                    if !self.recv(run, 0, *from, true)? {
                        return Ok(Some(data(*from, run)));
                    }
                    let partial = self.held(run, 0, ir.len() * acc)?;
                    let own = if same(run, ir, or) {
                        Operand::Dst
                    } else {
                        Operand::Span(input(run, ir)?)
                    };
                    let k = Kernel::Finalize {
                        dtype,
                        op: redop,
                        nranks: *nranks,
                        dst: output(run, or)?,
                        partial,
                        own,
                    };
                    self.kernel(run, &k)?;
                    self.release(run, 0)?;
                    run.stage = 1;
                    run.steps += 1;
                }
                self.forward(run, *forward, or)
            }
            Action::RecvCopy {
                from,
                output: or,
                forward,
            } => {
                if run.stage == 0 {
                    if !self.recv(run, 0, *from, true)? {
                        return Ok(Some(data(*from, run)));
                    }
                    let src = self.held(run, 0, or.len() * es)?;
                    let k = Kernel::Copy {
                        dst: output(run, or)?,
                        src,
                    };
                    self.kernel(run, &k)?;
                    self.release(run, 0)?;
                    run.stage = 1;
                    run.steps += 1;
                }
                self.forward(run, *forward, or)
            }
            Action::LoadAcc { range } => {
                let k = Kernel::ToAcc {
                    dtype,
                    dst: scratch(run, range)?,
                    src: input(run, range)?,
                };
                self.kernel(run, &k)?;
                Ok(None)
            }
            Action::RecvCombine { from, range } => {
                if !self.recv(run, 0, *from, true)? {
                    return Ok(Some(data(*from, run)));
                }
                let partial = self.held(run, 0, range.len() * acc)?;
                let k = Kernel::CombineAcc {
                    dtype,
                    op: redop,
                    acc: scratch(run, range)?,
                    partial,
                };
                self.kernel(run, &k)?;
                self.release(run, 0)?;
                Ok(None)
            }
            Action::SendScratch { to, range } => {
                let src = scratch(run, range)?;
                self.send(run, *to, src, false)
            }
            Action::FinishScratch { range, nranks } => {
                let k = Kernel::FinishAcc {
                    dtype,
                    op: redop,
                    nranks: *nranks,
                    dst: output(run, range)?,
                    acc: scratch(run, range)?,
                };
                self.kernel(run, &k)?;
                Ok(None)
            }
            Action::RecvReduceAll {
                input: ir,
                output: or,
                nranks,
            } => {
                if *nranks != self.world {
                    return Err(Error::Internal(format!(
                        "a reduction of {nranks} contributions on {} ranks",
                        self.world
                    )));
                }
                let me = self.rank;
                for p in (0..self.world).filter(|p| *p != me) {
                    if !self.recv(run, p, p, true)? {
                        return Ok(Some(data(p, run)));
                    }
                }
                let own = if same(run, ir, or) {
                    Operand::Dst
                } else {
                    Operand::Span(input(run, ir)?)
                };
                let mut srcs = std::mem::take(self.srcs);
                srcs.clear();
                for p in 0..self.world {
                    srcs.push(if p == self.rank {
                        own
                    } else {
                        Operand::Span(self.held(run, p, ir.len() * es)?)
                    });
                }
                let k = Kernel::ReduceOrdered {
                    dtype,
                    op: redop,
                    dst: output(run, or)?,
                    srcs: &srcs,
                };
                let r = self.kernel(run, &k);
                *self.srcs = srcs;
                r?;
                for p in (0..self.world).filter(|p| *p != me) {
                    self.release(run, p)?;
                }
                Ok(None)
            }
        }
    }

    /// Sends `output[or]` on to `forward`, if any (the second stage of a receive-and-forward).
    fn forward(&mut self, run: &mut Run, forward: Option<usize>, or: &Range<usize>) -> Step {
        match forward {
            Some(to) => {
                let src = output(run, or)?;
                self.send(run, to, src, false)
            }
            None => Ok(None),
        }
    }

    /// Sends `src` to `to` (once there is a credit): from `src` itself where `direct` allows it and
    /// the link can (registered memory, nothing queued before it), else as a copy into the slot.
    fn send(&mut self, run: &mut Run, to: usize, src: Span, direct: bool) -> Step {
        if !self.reserve(run, to)? {
            return Ok(Some(credit(to, run)));
        }
        if direct
            && src.len() >= DIRECT_MIN_BYTES
            && run.pending.is_none()
            && run.deferred.is_empty()
        {
            if let Some(slot) = run.tx.take() {
                let ctx = run_ctx(self.rank, self.abort, run);
                match self.link.post_from(slot, src, run.tag, &ctx)? {
                    None => {
                        run.sent_from_caller = true;
                        return Ok(None);
                    }
                    Some(slot) => run.tx = Some(slot),
                }
            }
        }
        let k = Kernel::Copy {
            dst: self.out_slot(run, src.len())?,
            src,
        };
        self.kernel(run, &k)?;
        self.post(run, src.len())?;
        Ok(None)
    }
}

/// Below this many bytes a send is copied into the slot without asking the link: the copy is as cheap
/// as the question.
pub(super) const DIRECT_MIN_BYTES: usize = 4096;

/// Whether two spans share a byte.
fn overlap(a: &Span, b: &Span) -> bool {
    !a.is_empty() && !b.is_empty() && a.addr() < b.addr() + b.len() && b.addr() < a.addr() + a.len()
}

fn data(peer: usize, run: &Run) -> Wait {
    Wait::Link {
        peer,
        channel: run.channel,
        event: Event::Data,
    }
}

fn credit(peer: usize, run: &Run) -> Wait {
    Wait::Link {
        peer,
        channel: run.channel,
        event: Event::Credit,
    }
}
