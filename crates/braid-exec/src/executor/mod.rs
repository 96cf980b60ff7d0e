//! The executor: one rank's schedules over one [`Link`] and one [`Engine`], as resumable runs.
//!
//! [`Executor::start`] turns an [`Op`] into a [`Run`]; [`Executor::poll`] advances it as far as it can
//! go without waiting and says what it waits for ([`Wait`]); [`Executor::run_blocking`] drives a run to
//! the end on the calling thread, sleeping in [`Link::wait`] in between. Several runs, on distinct
//! channels, can be in flight at once and polled in any order: that is what streams and a progress
//! thread are made of, and what the simulator does with every rank of a job on one thread.
//!
//! A run holds the slots of its current action across polls (a received partial while it waits for room
//! at the next peer), so no action is half done when a poll returns. Kernels go to the engine; when the
//! engine queues one, the post or release that depends on it waits in the run until the engine says the
//! kernel completed, so a slot goes back to its sender only once nothing reads it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use braid_core::{DType, Error};
use braid_sched::{Algo, Collective, PlanSpec};
use braid_transport::{Event, Link};

use crate::engine::{Engine, Scratch};

mod eager;
mod plan;
mod run;
mod state;
mod step;
pub use plan::Plan;
use plan::PlanKey;
use run::Phase;
pub use run::{Op, Progress, Run, Wait};
use state::Cx;
pub use state::{Executor, Settings};
use step::{flush, local_step, run_ctx};

/// Plans kept; past this the least recently used goes (steady training loops use a handful).
const PLAN_CACHE: usize = 32;

impl<E: Engine + ?Sized> Executor<E> {
    /// An executor for `rank` of `world` over `link` (`None` for a one-rank communicator), computing
    /// with `engine`. `abort` fails every run when set.
    pub fn new(
        rank: usize,
        world: usize,
        settings: Settings,
        link: Option<Box<dyn Link>>,
        engine: Box<E>,
        abort: Arc<AtomicBool>,
    ) -> Executor<E> {
        let (slot_bytes, channels) = link
            .as_deref()
            .map_or((0, 0), |l| (l.slot_bytes(), l.channels()));
        Executor {
            rank,
            world,
            settings,
            slot_bytes,
            channels,
            link,
            engine,
            abort,
            hosts: Vec::new(),
            plans: Vec::new(),
            spare_scratch: Vec::new(),
            spare_rx: Vec::new(),
            eager_rx: Vec::new(),
            srcs: Vec::new(),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The link, if there are peers.
    pub fn link(&self) -> Option<&dyn Link> {
        self.link.as_deref()
    }

    /// Waits (until `until` at the latest) for every kernel the engine has queued: after a failed run,
    /// before the caller's memory is handed back.
    pub fn quiesce(&mut self, until: Instant) -> Result<(), Error> {
        self.engine.quiesce(until)
    }

    /// The engine's name.
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Sets the ranks of each host; rings then visit hosts in turn (when there is more than one).
    pub fn set_hosts(&mut self, hosts: Vec<Vec<usize>>) {
        self.hosts = if hosts.len() > 1 { hosts } else { Vec::new() };
        self.plans.clear();
    }

    /// Elements of the accumulator type per slot: the chunk size of every schedule (and of any plan
    /// built outside the planner for [`Executor::start_plan`]).
    pub fn chunk(&self, dtype: DType) -> usize {
        match &self.link {
            Some(_) => (self.slot_bytes / dtype.accumulator().size()).max(1),
            None => usize::MAX,
        }
    }

    /// The cached plan for `op` run with `algo`.
    pub fn plan(&mut self, op: &Op, algo: Algo) -> Arc<Plan> {
        self.cache_plan(op, algo);
        self.plans[0].1.clone()
    }

    /// Puts the plan for `op` run with `algo` first in the cache (made if it is not there).
    fn cache_plan(&mut self, op: &Op, algo: Algo) {
        let key = PlanKey {
            collective: op.collective,
            root: op.root,
            algo,
            count: op.count,
            chunk: self.chunk(op.dtype),
        };
        if let Some(i) = self.plans.iter().position(|(k, _)| *k == key) {
            if i > 0 {
                let hit = self.plans.remove(i);
                self.plans.insert(0, hit);
            }
            return;
        }
        let actions = if op.count == 0 && op.collective != Collective::Barrier {
            Vec::new()
        } else {
            braid_sched::plan(&PlanSpec {
                collective: op.collective,
                root: op.root,
                algo,
                world: self.world,
                rank: self.rank,
                count: op.count,
                chunk: key.chunk,
                hosts: &self.hosts,
                channels: self.settings.rings,
            })
        };
        self.plans.truncate(PLAN_CACHE - 1);
        self.plans.insert(0, (key, Arc::new(Plan::new(actions))));
    }

    /// Starts `op` with `algo` on `channel` as the op numbered `seq` there.
    pub fn start(
        &mut self,
        op: Op,
        algo: Algo,
        channel: usize,
        seq: u64,
        started: Instant,
    ) -> Result<Run, Error> {
        let plan = self.plan(&op, algo);
        self.start_plan(op, plan, channel, seq, started)
    }

    /// Starts `op` with a given plan (the simulator's way in: any schedule, not only the planner's).
    pub fn start_plan(
        &mut self,
        op: Op,
        plan: Arc<Plan>,
        channel: usize,
        seq: u64,
        started: Instant,
    ) -> Result<Run, Error> {
        self.check_op(&op, channel)?;
        let scratch = if plan.scratch {
            let bytes = (op.send.len() / op.dtype.size()) * op.dtype.accumulator().size();
            Some(self.take_scratch(bytes)?)
        } else {
            None
        };
        let mut rx = self.spare_rx.pop().unwrap_or_default();
        rx.clear();
        rx.resize_with(self.world.max(1), || None);
        let check = self.settings.debug_checks && self.world > 1 && self.link.is_some();
        Ok(Run {
            op,
            seq,
            tag: seq as u32,
            channel,
            plan: Some(plan),
            phase: if check {
                Phase::Check { sent: 0, recvd: 0 }
            } else {
                Phase::Plan
            },
            pc: 0,
            stage: 0,
            rx,
            tx: None,
            scratch,
            pending: None,
            deferred: VecDeque::new(),
            fingerprint: check.then(|| Box::new(op.fingerprint(seq).encode())),
            mismatch: None,
            started,
            deadline: started + self.settings.timeout,
            steps: 0,
            sent_from_caller: false,
        })
    }

    /// Refuses memory the engine cannot compute on, overlapping buffers and unknown channels.
    fn check_op(&self, op: &Op, channel: usize) -> Result<(), Error> {
        for (what, s) in [("send", &op.send), ("receive", &op.recv)] {
            if !s.is_empty() && !self.engine.accepts(s.kind()) {
                return Err(Error::invalid(format!(
                    "the {what} buffer is {}, which the {} engine cannot compute on",
                    s.kind().describe(),
                    self.engine.name()
                )));
            }
        }
        let (s, r) = (&op.send, &op.recv);
        if !s.is_empty() && !r.is_empty() && s.kind() == r.kind() {
            let (s0, s1) = (s.addr(), s.addr() + s.len());
            let (r0, r1) = (r.addr(), r.addr() + r.len());
            let overlap = s0 < r1 && r0 < s1;
            // In place: the same buffer, or one rank's block of the other (all-gather's input inside
            // its output, reduce-scatter's output inside its input).
            let nested = (s0 >= r0 && s1 <= r1) || (r0 >= s0 && r1 <= s1);
            if overlap && !nested {
                return Err(Error::invalid(
                    "the send and receive buffers overlap without being the same buffer",
                ));
            }
        }
        if self.link.is_some() && channel >= self.channels {
            return Err(Error::invalid(format!(
                "channel {channel} does not exist (the link has {})",
                self.channels
            )));
        }
        Ok(())
    }

    fn take_scratch(&mut self, bytes: usize) -> Result<Scratch, Error> {
        if let Some(i) = self
            .spare_scratch
            .iter()
            .position(|s| s.span().len() >= bytes)
        {
            let s = self.spare_scratch.swap_remove(i);
            return Ok(s);
        }
        self.engine.scratch(bytes)
    }

    /// Gives a finished or failed run's reusable parts back.
    fn recycle(&mut self, run: &mut Run) {
        if let Some(s) = run.scratch.take() {
            if self.spare_scratch.len() < 4 {
                self.spare_scratch.push(s);
            }
        }
        let mut rx = std::mem::take(&mut run.rx);
        if let Some(link) = &self.link {
            // A failed run may hold received slots; give them back so the ring stays consistent.
            for s in rx.iter_mut().filter_map(Option::take) {
                let _ = link.release(s);
            }
        }
        rx.clear();
        if self.spare_rx.len() < 4 {
            self.spare_rx.push(rx);
        }
    }

    /// Advances `run` as far as it goes without waiting. `now` is the time the caller goes by: a run
    /// that is blocked at or past its deadline fails with a timeout naming what it waited for.
    pub fn poll(&mut self, run: &mut Run, now: Instant) -> Result<Progress, Error> {
        self.poll_for(run, now, u64::MAX)
    }

    /// [`Executor::poll`], returning [`Progress::Yielded`] after `budget` steps so that a driver can
    /// turn to other runs (a higher-priority stream's) in between.
    pub fn poll_for(
        &mut self,
        run: &mut Run,
        now: Instant,
        budget: u64,
    ) -> Result<Progress, Error> {
        self.poll_inner(run, now, budget, false)
    }

    /// [`Executor::poll_for`]; with `block`, a wait on the link happens in place (the blocking path).
    fn poll_inner(
        &mut self,
        run: &mut Run,
        now: Instant,
        budget: u64,
        block: bool,
    ) -> Result<Progress, Error> {
        if run.phase == Phase::Done {
            return Ok(Progress::Done);
        }
        let r = self.advance(run, budget.max(1), block);
        let r = match r {
            Ok(Progress::Blocked(w)) => {
                if self.abort.load(Ordering::Relaxed) {
                    Err(Error::Aborted {
                        rank: self.rank,
                        during: format!(" during {} #{}", run.op.collective.name(), run.seq),
                    })
                } else if now >= run.deadline {
                    Err(self.timeout(run, w, now))
                } else {
                    Ok(Progress::Blocked(w))
                }
            }
            other => other,
        };
        match &r {
            Ok(Progress::Done) => self.recycle(run),
            Err(_) => {
                run.phase = Phase::Done;
                self.recycle(run);
            }
            Ok(Progress::Blocked(_) | Progress::Yielded) => {}
        }
        r
    }

    /// Sleeps until what `run` waits for may have happened, or `until` (at the latest its deadline).
    /// An error (the peer died, the deadline passed, an abort) ends the run: it is complete, and the
    /// error is its result.
    pub fn wait(&mut self, run: &mut Run, wait: Wait, until: Instant) -> Result<(), Error> {
        let until = until.min(run.deadline);
        let r = match wait {
            Wait::Link {
                peer,
                channel,
                event,
            } => match self.link.as_deref() {
                Some(link) => {
                    let ctx = run_ctx(self.rank, &self.abort, run);
                    link.wait(peer, channel, event, &ctx, until)
                }
                None => Ok(()),
            },
            Wait::Engine(t) => self.engine.wait(t, until),
            Wait::Flag { .. } => Ok(()),
        };
        if r.is_err() {
            run.phase = Phase::Done;
            self.recycle(run);
        }
        r
    }

    /// Starts `op` and runs it to the end on this thread: [`Executor::start`] and
    /// [`Executor::run_blocking`] in one, with the run kept in place. A small all-reduce of one message
    /// per peer takes the eager path (`eager.rs`: the same plan in one straight pass, the 8-byte path).
    /// `on_start` is called once the op has been accepted (not for one refused with an
    /// invalid-argument error).
    pub fn run_op(
        &mut self,
        op: Op,
        algo: Algo,
        channel: usize,
        seq: u64,
        started: Instant,
        on_start: impl FnOnce(),
    ) -> Result<(), Error> {
        self.cache_plan(&op, algo);
        if self.eager_fits(&op, &self.plans[0].1) {
            self.check_op(&op, channel)?;
            on_start();
            // The plan stays in the cache (first), borrowed there: no reference count traffic.
            return self.run_eager(&op, channel, seq, started);
        }
        let plan = self.plans[0].1.clone();
        let mut run = self.start_plan(op, plan, channel, seq, started)?;
        on_start();
        self.run_blocking(&mut run)
    }

    /// Whether [`Executor::run_op`] runs `op` with `algo` on the eager path (one message per peer,
    /// the plan's actions in one straight pass).
    pub fn runs_eager(&mut self, op: &Op, algo: Algo) -> bool {
        self.cache_plan(op, algo);
        self.eager_fits(op, &self.plans[0].1)
    }

    /// Runs `run` to the end on this thread, sleeping on the link or the engine between polls.
    pub fn run_blocking(&mut self, run: &mut Run) -> Result<(), Error> {
        // The waits below enforce the deadline themselves; no clock is read on this path.
        let now = run.started;
        loop {
            match self.poll_inner(run, now, u64::MAX, true)? {
                Progress::Done => return Ok(()),
                Progress::Yielded => {}
                Progress::Blocked(Wait::Link {
                    peer,
                    channel,
                    event,
                }) => {
                    let Some(link) = self.link.as_deref() else {
                        return Err(Error::Internal("a one-rank plan waited on a link".into()));
                    };
                    let ctx = run_ctx(self.rank, &self.abort, run);
                    if let Err(e) = link.wait(peer, channel, event, &ctx, run.deadline) {
                        run.phase = Phase::Done;
                        self.recycle(run);
                        return Err(e);
                    }
                }
                Progress::Blocked(Wait::Engine(t)) => {
                    if let Err(e) = self.engine.wait(t, run.deadline) {
                        run.phase = Phase::Done;
                        self.recycle(run);
                        return Err(e);
                    }
                }
                Progress::Blocked(Wait::Flag { .. }) => {
                    return Err(Error::Internal("a plan waited on a shared flag".into()));
                }
            }
        }
    }

    fn timeout(&self, run: &Run, w: Wait, now: Instant) -> Error {
        let (peer, what) = match w {
            Wait::Link { peer, event, .. } => (peer, event.describe().to_string()),
            Wait::Engine(_) => (self.rank, format!("the {} engine", self.engine.name())),
            Wait::Flag { peer } => (peer, "a flag in shared memory".to_string()),
        };
        Error::Timeout {
            rank: self.rank,
            peer,
            collective: run.op.collective.name().to_string(),
            seq: run.seq,
            waited_ms: now.saturating_duration_since(run.started).as_millis() as u64,
            what,
        }
    }

    /// What a step needs, when there are peers.
    fn cx(&mut self) -> Option<Cx<'_, E>> {
        Some(Cx {
            rank: self.rank,
            world: self.world,
            link: self.link.as_deref()?,
            engine: &mut *self.engine,
            abort: &self.abort,
            srcs: &mut self.srcs,
        })
    }

    /// Walks the plan from the run's position: `Some` when it blocks or yields, `None` at the end.
    /// With `block`, a wait on the link (with no post held back for a kernel) happens in place, and
    /// the walk goes on from where it stopped.
    fn walk(
        &mut self,
        run: &mut Run,
        plan: &Plan,
        first: u64,
        budget: u64,
        block: bool,
    ) -> Result<Option<Progress>, Error> {
        while let Some(a) = plan.actions.get(run.pc) {
            let stepped = self.cx().map(|mut cx| cx.step(run, a));
            let wait = match stepped {
                Some(w) => w?,
                None => local_step(&mut *self.engine, run, a)?,
            };
            if let Some(w) = wait {
                if let (
                    true,
                    Some(link),
                    Wait::Link {
                        peer,
                        channel,
                        event,
                    },
                ) = (block && run.deferred.is_empty(), self.link.as_deref(), w)
                {
                    let ctx = run_ctx(self.rank, &self.abort, run);
                    link.wait(peer, channel, event, &ctx, run.deadline)?;
                    continue;
                }
                return self.blocked(run, w).map(Some);
            }
            run.pc += 1;
            run.stage = 0;
            run.steps += 1;
            if run.steps - first >= budget && run.pc < plan.actions.len() {
                return Ok(Some(Progress::Yielded));
            }
        }
        Ok(None)
    }

    /// A run that cannot go on waits for `w`, unless posts are held back for kernels: what this rank
    /// waits for may depend on them, so then the engine is what to wait on.
    fn blocked(&mut self, run: &mut Run, w: Wait) -> Result<Progress, Error> {
        if let (Some(link), false) = (self.link.as_deref(), run.deferred.is_empty()) {
            flush(&mut *self.engine, link, self.rank, &self.abort, run)?;
        }
        match run.deferred.front() {
            Some((t, _)) => Ok(Progress::Blocked(Wait::Engine(*t))),
            None => Ok(Progress::Blocked(w)),
        }
    }

    fn advance(&mut self, run: &mut Run, budget: u64, block: bool) -> Result<Progress, Error> {
        let first = run.steps;
        loop {
            match run.phase {
                Phase::Check { .. } => {
                    let Some(mut cx) = self.cx() else {
                        run.phase = Phase::Plan;
                        continue;
                    };
                    if let Some(w) = cx.check(run)? {
                        return self.blocked(run, w);
                    }
                    if let Some(e) = run.mismatch.take() {
                        return Err(*e);
                    }
                    run.phase = Phase::Plan;
                }
                Phase::Plan => {
                    // The plan is taken out of the run while it is walked (no reference count
                    // traffic on the hot path) and always put back.
                    let Some(plan) = run.plan.take() else {
                        return Err(Error::Internal("a run without its plan".into()));
                    };
                    let r = self.walk(run, &plan, first, budget, block);
                    run.plan = Some(plan);
                    if let Some(p) = r? {
                        return Ok(p);
                    }
                    run.phase = Phase::Drain;
                }
                Phase::Drain => {
                    if let Some(link) = self.link.as_deref() {
                        flush(&mut *self.engine, link, self.rank, &self.abort, run)?;
                    }
                    if let Some((t, _)) = run.deferred.front() {
                        return Ok(Progress::Blocked(Wait::Engine(*t)));
                    }
                    if let Some(t) = run.pending {
                        if !self.engine.complete(t)? {
                            return Ok(Progress::Blocked(Wait::Engine(t)));
                        }
                        run.pending = None;
                    }
                    if run.sent_from_caller {
                        // The caller gets its buffer back only when no write reads it any more.
                        if let Some(peer) =
                            self.link.as_deref().and_then(|l| l.unsettled(run.channel))
                        {
                            return Ok(Progress::Blocked(Wait::Link {
                                peer,
                                channel: run.channel,
                                event: Event::Sent,
                            }));
                        }
                        run.sent_from_caller = false;
                    }
                    run.phase = Phase::Done;
                    run.steps += 1;
                }
                Phase::Done => return Ok(Progress::Done),
            }
        }
    }
}
