//! The executor: walks a schedule from `braid-sched` over the transport, one action at a time.
//!
//! It is the only place where user buffers are touched through raw pointers. The pointers come from
//! [`Op`], whose constructor's contract (lengths checked, buffers live and unaliased for the call) the
//! communicator upholds; each action makes slices only for the ranges it touches, and never a shared and a
//! mutable slice of the same bytes (in place, the destination is its own source: `Src::Dst`).

use std::ops::Range;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use braid_core::reduce::{self, Src};
use braid_core::{Config, DType, Error, ReduceOp};
use braid_sched::{Action, Buf, PlanSpec};
use braid_transport::{Event, Link, RecvSlot, Router, SendSlot, WaitCtx};
use tracing::{error, trace};

use crate::recorder::Recorder;
use crate::tune::{Algo, Collective, Tuner};
use crate::wire::Fingerprint;

/// The channel every blocking collective uses.
const CHANNEL: usize = 0;

/// One op's view of the links: its channel and tag.
struct Chan<'a> {
    link: &'a dyn Link,
    tag: u32,
}

impl<'a> Chan<'a> {
    fn new(link: &'a dyn Link, seq: u64) -> Chan<'a> {
        Chan {
            link,
            tag: seq as u32,
        }
    }

    /// Waits for room for a message to `to` and hands out where to write it.
    fn send_slot(&self, to: usize, ctx: &WaitCtx<'_>) -> Result<Out<'a>, Error> {
        loop {
            if let Some(slot) = self.link.try_reserve(to, CHANNEL, ctx)? {
                return Ok(Out {
                    link: self.link,
                    tag: self.tag,
                    slot,
                });
            }
            self.link
                .wait(to, CHANNEL, Event::Credit, ctx, ctx.deadline)?;
        }
    }

    /// Waits for the next message from `from`, whatever its tag.
    fn recv_any_tag(&self, from: usize, ctx: &WaitCtx<'_>) -> Result<In<'a>, Error> {
        loop {
            if let Some(slot) = self.link.try_recv(from, CHANNEL, ctx)? {
                if slot.host_bytes().is_none() {
                    let _ = self.link.release(slot);
                    return Err(Error::Internal(
                        "a host collective received a message in device memory".into(),
                    ));
                }
                return Ok(In {
                    link: self.link,
                    slot: Some(slot),
                });
            }
            self.link
                .wait(from, CHANNEL, Event::Data, ctx, ctx.deadline)?;
        }
    }

    /// Waits for the next message from `from`, which must carry this op's tag.
    fn recv(&self, from: usize, ctx: &WaitCtx<'_>) -> Result<In<'a>, Error> {
        let m = self.recv_any_tag(from, ctx)?;
        let tag = m.slot.as_ref().map_or(self.tag, RecvSlot::tag);
        if tag != self.tag {
            return Err(Error::Mismatch {
                rank: ctx.rank,
                peer: from,
                collective: ctx.collective.to_string(),
                seq: ctx.seq,
                detail: format!(
                    "message belongs to collective #{tag}, this rank is at #{}",
                    self.tag
                ),
            });
        }
        Ok(m)
    }
}

/// A reserved slot being written.
struct Out<'a> {
    link: &'a dyn Link,
    tag: u32,
    slot: SendSlot,
}

impl Out<'_> {
    fn data(&mut self) -> &mut [u8] {
        let span = self.slot.span();
        match span.host_ptr() {
            // SAFETY: the reserved slot is ours to write until posted (which consumes `self`), and the
            // link, borrowed for `'a`, keeps its memory alive.
            Some(_) => unsafe { span.as_mut_slice() },
            None => &mut [],
        }
    }

    fn post(self, len: usize, ctx: &WaitCtx<'_>) -> Result<(), Error> {
        self.link.post(self.slot, len, self.tag, ctx)
    }
}

/// A received message; released when dropped.
struct In<'a> {
    link: &'a dyn Link,
    slot: Option<RecvSlot>,
}

impl In<'_> {
    fn data(&self) -> &[u8] {
        self.slot
            .as_ref()
            .and_then(RecvSlot::host_bytes)
            .unwrap_or_default()
    }

    fn done(mut self) -> Result<(), Error> {
        match self.slot.take() {
            Some(s) => self.link.release(s),
            None => Ok(()),
        }
    }
}

impl Drop for In<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.slot.take() {
            // A release can only fail for a token the link did not make; this one it did.
            let _ = self.link.release(s);
        }
    }
}

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

/// One collective call, validated: `count` is in the collective's NCCL convention (all-reduce: elements
/// per buffer; reduce-scatter: output elements; all-gather: input elements; all-to-all: elements per peer).
pub(crate) struct Op {
    pub kind: Kind,
    pub dtype: DType,
    pub redop: ReduceOp,
    pub count: usize,
    send: *const u8,
    recv: *mut u8,
    send_len: usize,
    recv_len: usize,
}

// SAFETY: an `Op` is a set of pointers whose validity the creator guarantees until the op completes,
// whichever thread runs it (see `Op::new`).
unsafe impl Send for Op {}
// SAFETY: sharing an `Op` shares only pointer values; the memory behind them is touched solely by the
// executor, which runs one op at a time under the communicator's executor lock.
unsafe impl Sync for Op {}

impl Op {
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
    ) -> Op {
        Op {
            kind,
            dtype,
            redop,
            count,
            send,
            recv,
            send_len,
            recv_len,
        }
    }
}

/// Typed access to the op's buffers by element range.
struct Bufs<'a> {
    op: &'a Op,
    es: usize,
    scratch: std::cell::RefCell<&'a mut [u8]>,
}

impl Bufs<'_> {
    fn bytes(&self, r: &Range<usize>) -> Range<usize> {
        r.start * self.es..r.end * self.es
    }
    fn input(&self, r: &Range<usize>) -> &[u8] {
        let b = self.bytes(r);
        assert!(
            b.end <= self.op.send_len,
            "input range {b:?} beyond {} bytes",
            self.op.send_len
        );
        if b.is_empty() {
            return &[];
        }
        // SAFETY: in bounds of the send buffer (checked), which `Op::new`'s contract keeps valid; no
        // mutable slice of these bytes is alive while this one is (see the module doc).
        unsafe { std::slice::from_raw_parts(self.op.send.add(b.start), b.len()) }
    }
    #[allow(clippy::mut_from_ref)]
    fn output(&self, r: &Range<usize>) -> &mut [u8] {
        let b = self.bytes(r);
        assert!(
            b.end <= self.op.recv_len,
            "output range {b:?} beyond {} bytes",
            self.op.recv_len
        );
        if b.is_empty() {
            return &mut [];
        }
        // SAFETY: in bounds of the receive buffer (checked), valid and exclusively ours by `Op::new`'s
        // contract; each action holds at most one slice of these bytes at a time.
        unsafe { std::slice::from_raw_parts_mut(self.op.recv.add(b.start), b.len()) }
    }
    /// Whether `input[i]` and `output[o]` are the same bytes (in-place operation).
    fn same(&self, i: &Range<usize>, o: &Range<usize>) -> bool {
        std::ptr::eq(
            self.op.send.wrapping_add(i.start * self.es),
            self.op.recv.wrapping_add(o.start * self.es),
        )
    }
}

/// Runs ops in order on one rank.
pub(crate) struct Executor {
    pub rank: usize,
    pub world: usize,
    config: Config,
    pub tuner: Tuner,
    transport: Option<Router>,
    abort: Arc<AtomicBool>,
    seq: u64,
    pub recorder: Recorder,
    /// The last plan, and whether it accumulates in scratch.
    cache: Option<(PlanKey, Vec<Action>, bool)>,
    /// Ranks of each host, when there is more than one host (rings then visit hosts in turn).
    hosts: Vec<Vec<usize>>,
    /// Accumulator-typed scratch for schedules that merge several partials at one rank (u64 words, so
    /// it is aligned for every accumulator type).
    scratch: Vec<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct PlanKey {
    kind: Kind,
    algo: Algo,
    count: usize,
    chunk: usize,
}

impl Executor {
    pub(crate) fn new(
        rank: usize,
        world: usize,
        config: Config,
        tuner: Tuner,
        transport: Option<Router>,
        abort: Arc<AtomicBool>,
    ) -> Executor {
        Executor {
            rank,
            world,
            config,
            tuner,
            transport,
            abort,
            seq: 0,
            recorder: Recorder::default(),
            cache: None,
            hosts: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Sets the ranks of each host (called once, after the bootstrap).
    pub(crate) fn set_hosts(&mut self, hosts: Vec<Vec<usize>>) {
        self.tuner.set_hosts(hosts.iter().map(Vec::len).collect());
        self.hosts = if hosts.len() > 1 { hosts } else { Vec::new() };
        self.cache = None;
    }

    /// The sequence number the next op will get.
    pub(crate) fn next_seq(&self) -> u64 {
        self.seq
    }

    /// The plan for `key` and whether it needs the scratch buffer (reused from the last op when equal).
    fn plan(&mut self, key: PlanKey) -> (Vec<Action>, bool) {
        if let Some((k, p, scratch)) = self.cache.take() {
            if k == key {
                return (p, scratch);
            }
        }
        let plan = self.build_plan(key);
        let scratch = plan.iter().any(|a| matches!(a, Action::LoadAcc { .. }));
        (plan, scratch)
    }

    fn build_plan(&self, key: PlanKey) -> Vec<Action> {
        braid_sched::plan(&PlanSpec {
            collective: key.kind.collective(),
            root: key.kind.root(),
            algo: key.algo,
            world: self.world,
            rank: self.rank,
            count: key.count,
            chunk: key.chunk,
            hosts: &self.hosts,
            channels: self.config.channels,
        })
    }

    /// Runs one op to completion.
    pub(crate) fn run(&mut self, op: &Op) -> Result<(), Error> {
        let seq = self.seq;
        self.seq += 1;
        let es = op.dtype.size();
        let algo = self.tuner.pick_cached(op.kind.collective(), op.count * es);
        let started = Instant::now();
        self.recorder.start(seq, op, algo, started);
        let result = self.run_plan(op, seq, algo, started);
        self.recorder.finish(seq, &result, started.elapsed());
        if let Err(e) = &result {
            if self.config.dump_on_timeout && !e.is_invalid_argument() {
                error!("rank {} {}", self.rank, self.recorder.dump());
            }
        }
        result
    }

    fn run_plan(&mut self, op: &Op, seq: u64, algo: Algo, started: Instant) -> Result<(), Error> {
        let es = op.dtype.size();
        let abort = self.abort.clone();
        let ctx = WaitCtx {
            rank: self.rank,
            collective: op.kind.name(),
            seq,
            deadline: started + self.config.timeout,
            started,
            abort: &abort,
        };
        if let (Some(t), true) = (&self.transport, self.config.debug_checks) {
            let t = Chan::new(t, seq);
            check_fingerprints(&t, &ctx, self.world, op, seq)?;
        }
        if op.count == 0 && op.kind != Kind::Barrier {
            return Ok(());
        }
        let chunk = match &self.transport {
            Some(t) => t.slot_bytes() / op.dtype.accumulator().size(),
            None => usize::MAX,
        };
        let key = PlanKey {
            kind: op.kind,
            algo,
            count: op.count,
            chunk,
        };
        let (plan, needs_scratch) = self.plan(key);
        trace!(rank = self.rank, seq, op = op.kind.name(), count = op.count, dtype = %op.dtype, algo = algo.name(), "run");
        let acc_bytes = (op.send_len / es).saturating_mul(op.dtype.accumulator().size());
        if needs_scratch && self.scratch.len() * 8 < acc_bytes {
            self.scratch.resize(acc_bytes.div_ceil(8), 0);
        }
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch[..]);
        let bufs = Bufs {
            op,
            es,
            scratch: std::cell::RefCell::new(scratch),
        };
        let result = match &self.transport {
            Some(t) => {
                let t = Chan::new(t, seq);
                plan.iter().try_for_each(|a| step(&t, &ctx, &bufs, a))
            }
            None => plan.iter().try_for_each(|a| local_step(&bufs, a)),
        };
        self.cache = Some((key, plan, needs_scratch));
        result
    }
}

/// The op as a fingerprint other ranks can compare with theirs.
fn fingerprint(op: &Op, seq: u64) -> Fingerprint {
    Fingerprint {
        kind: op.kind.collective().index() as u8,
        dtype: op.dtype as u8,
        redop: op.redop as u8,
        root: op.kind.root() as u32,
        seq,
        count: op.count as u64,
    }
}

/// Sends this rank's fingerprint to every peer and compares theirs with it (`BRAID_DEBUG_CHECKS`).
fn check_fingerprints(
    t: &Chan<'_>,
    ctx: &WaitCtx<'_>,
    world: usize,
    op: &Op,
    seq: u64,
) -> Result<(), Error> {
    let mine = fingerprint(op, seq);
    let bytes = mine.encode();
    for k in 1..world {
        let mut s = t.send_slot((ctx.rank + k) % world, ctx)?;
        s.data()[..bytes.len()].copy_from_slice(&bytes);
        s.post(bytes.len(), ctx)?;
    }
    let mut first_err = None;
    for k in 1..world {
        let p = (ctx.rank + world - k) % world;
        let m = t.recv_any_tag(p, ctx)?;
        let theirs = Fingerprint::decode(m.data());
        m.done()?;
        let detail = match theirs {
            Ok(f) if f == mine => continue,
            Ok(f) => format!("rank {} runs {mine}; rank {p} runs {f}", ctx.rank),
            Err(e) => format!("rank {p} sent a malformed fingerprint: {e}"),
        };
        first_err.get_or_insert(Error::Mismatch {
            rank: ctx.rank,
            peer: p,
            collective: ctx.collective.to_string(),
            seq,
            detail,
        });
    }
    first_err.map_or(Ok(()), Err)
}

fn local_step(bufs: &Bufs<'_>, a: &Action) -> Result<(), Error> {
    match a {
        Action::Copy { src, dst } => {
            if !bufs.same(src, dst) {
                bufs.output(dst).copy_from_slice(bufs.input(src));
            }
            Ok(())
        }
        other => unreachable!("a one-rank schedule only copies, got {other:?}"),
    }
}

fn expect_len(ctx: &WaitCtx<'_>, peer: usize, got: usize, want: usize) -> Result<(), Error> {
    if got == want {
        return Ok(());
    }
    Err(Error::Mismatch {
        rank: ctx.rank,
        peer,
        collective: ctx.collective.to_string(),
        seq: ctx.seq,
        detail: format!(
            "received {got} bytes where {want} were expected (different counts or dtypes?)"
        ),
    })
}

/// Executes one action.
fn step(t: &Chan<'_>, ctx: &WaitCtx<'_>, bufs: &Bufs<'_>, a: &Action) -> Result<(), Error> {
    let op = bufs.op;
    let (dtype, es, acc) = (op.dtype, bufs.es, op.dtype.accumulator().size());
    match a {
        Action::Copy { .. } => local_step(bufs, a)?,
        Action::Send { to, buf, range } => {
            let mut s = t.send_slot(*to, ctx)?;
            let src = match buf {
                Buf::Input => bufs.input(range),
                Buf::Output => &*bufs.output(range),
            };
            s.data()[..src.len()].copy_from_slice(src);
            s.post(src.len(), ctx)?;
        }
        Action::SendAcc { to, range } => {
            let mut s = t.send_slot(*to, ctx)?;
            let len = range.len() * acc;
            reduce::to_acc(dtype, &mut s.data()[..len], bufs.input(range));
            s.post(len, ctx)?;
        }
        Action::RecvReduceSend { from, to, range } => {
            let m = t.recv(*from, ctx)?;
            let len = range.len() * acc;
            expect_len(ctx, *from, m.data().len(), len)?;
            let mut s = t.send_slot(*to, ctx)?;
            reduce::combine(
                dtype,
                op.redop,
                &mut s.data()[..len],
                m.data(),
                bufs.input(range),
            );
            s.post(len, ctx)?;
        }
        Action::RecvReduceFinal {
            from,
            input,
            output,
            forward,
            nranks,
        } => {
            let m = t.recv(*from, ctx)?;
            expect_len(ctx, *from, m.data().len(), input.len() * acc)?;
            if bufs.same(input, output) {
                reduce::finalize(
                    dtype,
                    op.redop,
                    *nranks,
                    bufs.output(output),
                    m.data(),
                    Src::Dst,
                );
            } else {
                let src = Src::Buf(bufs.input(input));
                reduce::finalize(dtype, op.redop, *nranks, bufs.output(output), m.data(), src);
            }
            drop(m);
            if let Some(to) = forward {
                let mut s = t.send_slot(*to, ctx)?;
                let out = bufs.output(output);
                s.data()[..out.len()].copy_from_slice(out);
                s.post(out.len(), ctx)?;
            }
        }
        Action::RecvCopy {
            from,
            output,
            forward,
        } => {
            let m = t.recv(*from, ctx)?;
            expect_len(ctx, *from, m.data().len(), output.len() * es)?;
            bufs.output(output).copy_from_slice(m.data());
            if let Some(to) = forward {
                let mut s = t.send_slot(*to, ctx)?;
                s.data()[..m.data().len()].copy_from_slice(m.data());
                s.post(m.data().len(), ctx)?;
            }
        }
        Action::LoadAcc { range } => {
            let mut sc = bufs.scratch.borrow_mut();
            reduce::to_acc(
                dtype,
                &mut sc[range.start * acc..range.end * acc],
                bufs.input(range),
            );
        }
        Action::RecvCombine { from, range } => {
            let m = t.recv(*from, ctx)?;
            expect_len(ctx, *from, m.data().len(), range.len() * acc)?;
            let mut sc = bufs.scratch.borrow_mut();
            reduce::combine_acc(
                dtype,
                op.redop,
                &mut sc[range.start * acc..range.end * acc],
                m.data(),
            );
        }
        Action::SendScratch { to, range } => {
            let mut s = t.send_slot(*to, ctx)?;
            let sc = bufs.scratch.borrow();
            let src = &sc[range.start * acc..range.end * acc];
            s.data()[..src.len()].copy_from_slice(src);
            s.post(src.len(), ctx)?;
        }
        Action::FinishScratch { range, nranks } => {
            let sc = bufs.scratch.borrow();
            reduce::finish_acc(
                dtype,
                op.redop,
                *nranks,
                bufs.output(range),
                &sc[range.start * acc..range.end * acc],
            );
        }
        Action::RecvReduceAll {
            input,
            output,
            nranks,
        } => {
            // Up to 8 ranks (the latency-bound case) without touching the allocator.
            if *nranks <= 8 {
                let mut slots: [Option<In<'_>>; 8] = Default::default();
                reduce_all(t, ctx, bufs, input, output, &mut slots[..*nranks])?;
            } else {
                let mut slots: Vec<Option<In<'_>>> = (0..*nranks).map(|_| None).collect();
                reduce_all(t, ctx, bufs, input, output, &mut slots)?;
            }
        }
    }
    Ok(())
}

/// Receives `input`'s counterpart from every other rank and reduces all contributions in rank order
/// into `output`.
fn reduce_all<'t>(
    t: &'t Chan<'t>,
    ctx: &WaitCtx<'_>,
    bufs: &Bufs<'_>,
    input: &Range<usize>,
    output: &Range<usize>,
    slots: &mut [Option<In<'t>>],
) -> Result<(), Error> {
    let op = bufs.op;
    for (p, slot) in slots.iter_mut().enumerate() {
        if p != ctx.rank {
            let m = t.recv(p, ctx)?;
            expect_len(ctx, p, m.data().len(), input.len() * bufs.es)?;
            *slot = Some(m);
        }
    }
    let own = if bufs.same(input, output) {
        Src::Dst
    } else {
        Src::Buf(bufs.input(input))
    };
    fn src<'a>(slot: &'a Option<In<'_>>, own: Src<'a>) -> Src<'a> {
        slot.as_ref().map_or(own, |m| Src::Buf(m.data()))
    }
    let out = bufs.output(output);
    if slots.len() <= 8 {
        let mut srcs = [Src::Dst; 8];
        for (s, slot) in srcs.iter_mut().zip(slots.iter()) {
            *s = src(slot, own);
        }
        reduce::reduce_ordered(op.dtype, op.redop, out, &srcs[..slots.len()]);
    } else {
        let srcs: Vec<Src<'_>> = slots.iter().map(|s| src(s, own)).collect();
        reduce::reduce_ordered(op.dtype, op.redop, out, &srcs);
    }
    Ok(())
}
