//! The eager path: a blocking all-reduce that goes in one message per peer (the direct schedule of one
//! chunk: send the input to every peer, then reduce every rank's contribution in rank order) runs
//! its plan's actions in one straight pass, without the resumable run around them.
//!
//! It is the same plan, the same link calls, the same kernels and the same errors as the walk of
//! [`Executor::run_blocking`]; what it leaves out is what only a run that can stop halfway needs (a
//! `Run` built and torn down per call, a step result per action, posts held back for a queued kernel),
//! which on an 8-byte all-reduce is a good part of the time. It is taken only where nothing of that is
//! needed: an engine that completes every kernel when submitted, no fingerprint exchange, messages of
//! fewer than [`DIRECT_MIN_BYTES`] (where the walk, too, copies into the slot rather than sending from
//! the caller's buffer). Receives are checked in the walk's order: every message is taken (and its tag
//! checked) in rank order before any length is, so the same fault gives the same error.

use std::sync::atomic::Ordering;
use std::time::Instant;

use braid_core::Error;
use braid_sched::Action;
use braid_transport::{Event, Link, RecvSlot, WaitCtx};

use super::plan::Plan;
use super::run::Op;
use super::state::Executor;
use super::step::{accept, check_len, view, DIRECT_MIN_BYTES};
use crate::engine::{Engine, Kernel, Operand};

impl<E: Engine + ?Sized> Executor<E> {
    /// Whether `op` with `plan` can take the eager path.
    pub(super) fn eager_fits(&self, op: &Op, plan: &Plan) -> bool {
        plan.eager
            && self.link.is_some()
            && !self.settings.debug_checks
            && self.engine.synchronous()
            && match plan.actions.last() {
                Some(Action::RecvReduceAll { input, nranks, .. }) => {
                    // Below the size from which the walk would send from the caller's buffer.
                    *nranks == self.world && input.len() * op.dtype.size() < DIRECT_MIN_BYTES
                }
                _ => false,
            }
    }

    /// Runs the first cached plan, an eager one (see [`Executor::eager_fits`]), to the end on this
    /// thread. The op has been checked ([`Executor::check_op`]).
    pub(super) fn run_eager(
        &mut self,
        op: &Op,
        channel: usize,
        seq: u64,
        started: Instant,
    ) -> Result<(), Error> {
        let (Some(link), Some((_, plan))) = (self.link.as_deref(), self.plans.first()) else {
            return Err(Error::Internal("an eager plan without a link".into()));
        };
        let ctx = WaitCtx {
            rank: self.rank,
            collective: op.collective.name(),
            seq,
            deadline: started + self.settings.timeout,
            started,
            abort: &self.abort,
        };
        let rx = &mut self.eager_rx;
        if rx.len() != self.world {
            rx.clear();
            rx.resize_with(self.world, || None);
        }
        let r = eager(
            link,
            &mut *self.engine,
            &ctx,
            op,
            plan,
            channel,
            rx,
            &mut self.srcs,
        );
        if r.is_err() {
            // A failed pass may hold received slots: they go back so that the ring stays consistent.
            for s in rx.iter_mut().filter_map(Option::take) {
                let _ = link.release(s);
            }
        }
        r
    }
}

/// Waits on `link` for `event` from `peer`, failing first if the communicator was aborted (as a
/// blocked poll does; the blocking walk leaves the flag to the link's wait, which looks at it once it
/// sleeps: an abort is seen here a little sooner, never later).
fn block(
    link: &dyn Link,
    ctx: &WaitCtx<'_>,
    peer: usize,
    channel: usize,
    event: Event,
) -> Result<(), Error> {
    if ctx.abort.load(Ordering::Relaxed) {
        return Err(Error::Aborted {
            rank: ctx.rank,
            during: format!(" during {} #{}", ctx.collective, ctx.seq),
        });
    }
    link.wait(peer, channel, event, ctx, ctx.deadline)
}

/// The eager pass itself; received slots are left in `rx` (the caller releases what an error left).
#[allow(clippy::too_many_arguments)]
fn eager<E: Engine + ?Sized>(
    link: &dyn Link,
    engine: &mut E,
    ctx: &WaitCtx<'_>,
    op: &Op,
    plan: &Plan,
    channel: usize,
    rx: &mut [Option<RecvSlot>],
    srcs: &mut Vec<Operand>,
) -> Result<(), Error> {
    let Some((
        Action::RecvReduceAll {
            input: ir,
            output: or,
            ..
        },
        sends,
    )) = plan.actions.split_last()
    else {
        return Err(Error::Internal(
            "an eager plan without its reduction".into(),
        ));
    };
    let (dtype, es, tag) = (op.dtype, op.dtype.size(), ctx.seq as u32);
    let src = view(&op.send, "input", ir, es)?;
    for a in sends {
        let Action::Send { to, .. } = a else {
            return Err(Error::Internal(format!("an eager plan with {a:?}")));
        };
        let slot = loop {
            match link.try_reserve(*to, channel, ctx)? {
                Some(s) => break s,
                None => block(link, ctx, *to, channel, Event::Credit)?,
            }
        };
        if !engine.accepts(slot.span().kind()) {
            return Err(Error::Internal(format!(
                "a slot at rank {to} is {}, which the {} engine cannot write",
                slot.span().kind().describe(),
                engine.name()
            )));
        }
        let dst = slot.span().prefix(src.len()).ok_or_else(|| {
            Error::Internal(format!(
                "a message of {} bytes does not fit a slot of {}",
                src.len(),
                slot.span().len()
            ))
        })?;
        submit(engine, &Kernel::Copy { dst, src })?;
        link.post(slot, src.len(), tag, ctx)?;
    }
    let me = ctx.rank;
    for (p, held) in rx.iter_mut().enumerate().filter(|(p, _)| *p != me) {
        let slot = loop {
            match link.try_recv(p, channel, ctx)? {
                Some(s) => break s,
                None => block(link, ctx, p, channel, Event::Data)?,
            }
        };
        let slot = held.insert(slot);
        accept(&*engine, slot, Some(tag), me, op, ctx.seq)?;
    }
    for slot in rx.iter().flatten() {
        check_len(slot, src.len(), me, op, ctx.seq)?;
    }
    let dst = view(&op.recv, "output", or, es)?;
    // In place (the output is the input itself): the own contribution is the destination.
    let own = if op.send.kind() == op.recv.kind() && src.addr() == dst.addr() {
        Operand::Dst
    } else {
        Operand::Span(src)
    };
    srcs.clear();
    for (p, held) in rx.iter().enumerate() {
        match held {
            Some(slot) => srcs.push(Operand::Span(slot.span())),
            None if p == me => srcs.push(own),
            None => return Err(Error::Internal(format!("no message held from rank {p}"))),
        }
    }
    let k = Kernel::ReduceOrdered {
        dtype,
        op: op.redop,
        dst,
        srcs,
    };
    submit(engine, &k)?;
    for slot in rx.iter_mut().filter_map(Option::take) {
        link.release(slot)?;
    }
    Ok(())
}

/// Runs a kernel on an engine that completes it at once.
fn submit<E: Engine + ?Sized>(engine: &mut E, k: &Kernel<'_>) -> Result<(), Error> {
    debug_assert!(crate::engine::check_kinds(engine, k).is_ok(), "{k:?}");
    // SAFETY: the op's spans are valid until the op completes (their creator's promise), and it
    // completes before this call returns; slot spans are valid while the pass holds the slot, which it
    // does until the kernel below has completed (the engine is synchronous, so at once). Destinations
    // never overlap operands: the own contribution in place is `Operand::Dst`, slots are the link's.
    match unsafe { engine.submit(k)? } {
        None => Ok(()),
        Some(_) => Err(Error::Internal(format!(
            "the {} engine queued a kernel on the eager path",
            engine.name()
        ))),
    }
}
