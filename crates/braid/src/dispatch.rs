//! The dispatcher: the communicator's way to run a [`Call`]. It numbers calls per stream, sends each
//! one straight through shared buffers ([`crate::shared`]) when they all are, otherwise picks its
//! algorithm with the tuner and runs its plan with braid-exec's [`braid_exec::Executor`] (on the
//! calling thread on the blocking path: no hand-off), and records it in the flight recorder and on
//! the timeline.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use braid_core::{Config, DType, Error};
use braid_exec::{CpuEngine, Plan, Progress, Run, Settings, Wait};
use braid_sched::Algo;
use braid_transport::{Link, Stamp};
use tracing::{error, trace};

use crate::call::Call;
use crate::recorder::Recorder;
use crate::shared::{Shared, SharedRun};
use crate::timeline::{now_ns, Event, Timeline};
use crate::tune::Tuner;

/// A started op.
pub(crate) struct Running {
    run: Flow,
    /// When it started, as recorded.
    stamp: Stamp,
    /// What the timeline will show of it (when there is one).
    shown: Option<Shown>,
}

/// How a started op runs: a plan over messages, or straight through shared buffers.
enum Flow {
    Plan(Run),
    Shared(SharedRun),
}

impl Flow {
    fn seq(&self) -> u64 {
        match self {
            Flow::Plan(r) => r.seq(),
            Flow::Shared(r) => r.seq,
        }
    }

    fn stream(&self) -> usize {
        match self {
            Flow::Plan(r) => r.channel(),
            Flow::Shared(r) => r.stream,
        }
    }
}

/// A started op as the timeline will show it.
struct Shown {
    name: &'static str,
    count: usize,
    dtype: DType,
    algo: &'static str,
    began_ns: u64,
}

impl Running {
    /// Its sequence number on its stream.
    pub(crate) fn seq(&self) -> u64 {
        self.run.seq()
    }
}

/// What the recorder and the timeline call the path of a run over shared buffers.
const SHARED: &str = "shared";

/// Runs calls on one rank: numbers them per stream, picks their path and algorithm, records them.
pub(crate) struct Dispatcher {
    pub rank: usize,
    config: Config,
    pub tuner: Tuner,
    /// The CPU engine, by type: its kernels are called directly on the hot path.
    exec: braid_exec::Executor<CpuEngine>,
    /// The next sequence number of each stream.
    seqs: Vec<u64>,
    pub recorder: Recorder,
    /// The timeline (`BRAID_TIMELINE`), shared with the communicator for the caller's markers.
    pub timeline: Option<Arc<Timeline>>,
    /// Memory the ranks of the host share ([`crate::Communicator::alloc`]), once there is some.
    pub shared: Option<Shared>,
    /// Set by `abort`: every wait ends.
    abort: Arc<AtomicBool>,
}

impl Dispatcher {
    pub(crate) fn new(
        rank: usize,
        world: usize,
        config: Config,
        tuner: Tuner,
        link: Option<Box<dyn Link>>,
        abort: Arc<AtomicBool>,
    ) -> Dispatcher {
        let settings = Settings {
            timeout: config.timeout,
            debug_checks: config.debug_checks,
            rings: config.channels,
        };
        let exec = braid_exec::Executor::new(
            rank,
            world,
            settings,
            link,
            Box::new(CpuEngine::new()),
            abort.clone(),
        );
        let timeline = config
            .timeline
            .as_deref()
            .map(|p| Arc::new(Timeline::new(p, rank, config.streams.max(1))));
        Dispatcher {
            rank,
            seqs: vec![0; config.streams.max(1)],
            config,
            tuner,
            exec,
            recorder: Recorder::default(),
            timeline,
            shared: None,
            abort,
        }
    }

    /// The link to the other ranks (none alone).
    pub(crate) fn link(&self) -> Option<&dyn Link> {
        self.exec.link()
    }

    /// Sets the ranks of each host (called once, after the bootstrap).
    pub(crate) fn set_hosts(&mut self, hosts: Vec<Vec<usize>>) {
        self.tuner.set_hosts(hosts.iter().map(Vec::len).collect());
        self.exec.set_hosts(hosts);
    }

    /// The sequence number the next op on `stream` will get.
    pub(crate) fn next_seq(&self, stream: usize) -> u64 {
        self.seqs.get(stream).copied().unwrap_or(0)
    }

    /// Starts `op`, issued at `issued_ns` ([`now_ns`]), on `stream`. An op refused before anything
    /// happened (memory of the wrong kind) takes no sequence number.
    pub(crate) fn start(
        &mut self,
        op: &Call,
        stream: usize,
        issued_ns: u64,
    ) -> Result<Running, Error> {
        let seq = self.seq(stream)?;
        let stamp = Stamp::now();
        let started = stamp.instant();
        let (algo, run) = match self.start_shared(op, stream, seq, started) {
            Some(run) => (None, Flow::Shared(run)),
            None => {
                let (custom, algo) = self.route(op);
                let run = match custom {
                    Some(plan) => self.exec.start_plan(op.spec, plan, stream, seq, started)?,
                    None => self.exec.start(op.spec, algo, stream, seq, started)?,
                };
                (Some(algo), Flow::Plan(run))
            }
        };
        Ok(self.begin(op, stream, seq, algo, run, stamp, issued_ns))
    }

    /// The sequence number the next call on `stream` gets, or an error if there is no such stream.
    fn seq(&self, stream: usize) -> Result<u64, Error> {
        self.seqs.get(stream).copied().ok_or_else(|| {
            Error::invalid(format!(
                "stream {stream} does not exist (the communicator has {})",
                self.seqs.len()
            ))
        })
    }

    /// How a call that does not go through shared buffers runs: its own plan (an all-to-all of
    /// blocks of any size, with [`Algo::Direct`]), or the tuner's algorithm for its size.
    fn route(&mut self, op: &Call) -> (Option<Arc<Plan>>, Algo) {
        match self.custom_plan(op) {
            Some(plan) => (Some(plan), Algo::Direct),
            None => {
                let bytes = op.count * op.dtype.size();
                (None, self.tuner.pick_cached(op.kind.collective(), bytes))
            }
        }
    }

    /// What the timeline will show of `op` run with `algo`, started now (nothing without a
    /// timeline).
    fn shown(&self, op: &Call, algo: &'static str) -> Option<Shown> {
        self.timeline.as_ref().map(|_| Shown {
            name: op.kind.name(),
            count: op.count,
            dtype: op.dtype,
            algo,
            began_ns: now_ns(),
        })
    }

    /// Counts a started call on its stream and records its start: what makes a call started.
    #[allow(clippy::too_many_arguments)]
    fn count_and_record(
        seqs: &mut [u64],
        recorder: &Recorder,
        stream: usize,
        seq: u64,
        op: &Call,
        algo: Option<Algo>,
        stamp: Stamp,
    ) {
        seqs[stream] += 1;
        recorder.start(stream, seq, op, algo, stamp);
    }

    /// Starts `op` on `stream` if it runs straight through shared buffers (`None` otherwise, and
    /// nothing happened).
    fn start_if_shared(&mut self, op: &Call, stream: usize) -> Result<Option<Running>, Error> {
        let seq = self.seq(stream)?;
        let stamp = Stamp::now();
        let Some(run) = self.start_shared(op, stream, seq, stamp.instant()) else {
            return Ok(None);
        };
        let flow = Flow::Shared(run);
        Ok(Some(self.begin(op, stream, seq, None, flow, stamp, 0)))
    }

    /// Numbers, records and shows a started run.
    #[allow(clippy::too_many_arguments)]
    fn begin(
        &mut self,
        op: &Call,
        stream: usize,
        seq: u64,
        algo: Option<Algo>,
        run: Flow,
        stamp: Stamp,
        issued_ns: u64,
    ) -> Running {
        let algo_name = algo.map_or(SHARED, Algo::name);
        trace!(rank = self.rank, stream, seq, op = op.kind.name(), count = op.count, dtype = %op.dtype, algo = algo_name, "run");
        Dispatcher::count_and_record(&mut self.seqs, &self.recorder, stream, seq, op, algo, stamp);
        let shown = self.shown(op, algo_name);
        if let (Some(t), Some(shown)) = (&self.timeline, &shown) {
            if issued_ns != 0 && shown.began_ns > issued_ns {
                t.push(Event {
                    name: "queued".into(),
                    cat: "queue",
                    tid: stream as u64,
                    start_ns: issued_ns,
                    end_ns: shown.began_ns,
                    args: Default::default(),
                });
            }
        }
        Running { run, stamp, shown }
    }

    /// The run of `op` straight through shared buffers, when they all are (checked against the
    /// validity of the op first, as the plan path does).
    fn start_shared(
        &mut self,
        op: &Call,
        stream: usize,
        seq: u64,
        started: Instant,
    ) -> Option<SharedRun> {
        let deadline = started + self.config.timeout;
        self.shared
            .as_mut()?
            .start(op, stream, seq, started, deadline)
    }

    /// Puts a finished op on the timeline.
    fn show(&self, stream: usize, seq: u64, shown: &Shown, result: &Result<(), Error>) {
        let Some(t) = &self.timeline else { return };
        let mut args = serde_json::Map::new();
        args.insert("seq".into(), seq.into());
        args.insert("count".into(), shown.count.into());
        args.insert("dtype".into(), shown.dtype.name().into());
        args.insert("bytes".into(), (shown.count * shown.dtype.size()).into());
        args.insert("algo".into(), shown.algo.into());
        let outcome = match result {
            Ok(()) => "ok".to_string(),
            Err(e) => e.to_string(),
        };
        args.insert("result".into(), outcome.into());
        t.push(Event {
            name: shown.name.to_string(),
            cat: "collective",
            tid: stream as u64,
            start_ns: shown.began_ns,
            end_ns: now_ns(),
            args,
        });
    }

    /// Advances a started op by at most `budget` steps; records how it ended when it does.
    pub(crate) fn poll(
        &mut self,
        r: &mut Running,
        now: Instant,
        budget: u64,
    ) -> Result<Progress, Error> {
        let result = match &mut r.run {
            Flow::Plan(run) => self.exec.poll_for(run, now, budget),
            Flow::Shared(run) => match &self.shared {
                Some(sh) => sh.poll(run, budget),
                None => Err(Error::Internal("a shared run without shared memory".into())),
            },
        };
        match &result {
            Ok(Progress::Done) => self.finish(r, &Ok(())),
            Err(e) => self.finish(r, &Err(e.clone())),
            Ok(_) => {}
        }
        result
    }

    /// Sleeps until what `r` waits for may have happened, or `until`; an error ends the op (and is
    /// recorded).
    pub(crate) fn wait(&mut self, r: &mut Running, w: Wait, until: Instant) -> Result<(), Error> {
        let result = match &mut r.run {
            Flow::Plan(run) => self.exec.wait(run, w, until),
            Flow::Shared(run) => match &self.shared {
                Some(sh) => sh.wait(run, &self.abort, until),
                None => Err(Error::Internal("a shared run without shared memory".into())),
            },
        };
        if let Err(e) = &result {
            self.finish(r, &Err(e.clone()));
        }
        result
    }

    /// Runs `op` on `stream` to completion on this thread.
    pub(crate) fn run(&mut self, op: &Call, stream: usize) -> Result<(), Error> {
        if self.shared.is_some() {
            if let Some(mut r) = self.start_if_shared(op, stream)? {
                // The run's own deadline bounds every wait: no clock is read here.
                let now = r.stamp.instant();
                let until = now + self.config.timeout;
                loop {
                    match self.poll(&mut r, now, u64::MAX)? {
                        Progress::Done => return Ok(()),
                        Progress::Yielded => {}
                        Progress::Blocked(w) => self.wait(&mut r, w, until)?,
                    }
                }
            }
        }
        let seq = self.seq(stream)?;
        let stamp = Stamp::now();
        let started = stamp.instant();
        let (custom, algo) = self.route(op);
        let shown = self.shown(op, algo.name());
        // A call refused before it starts takes no number and leaves no record.
        let (seqs, recorder) = (&mut self.seqs, &self.recorder);
        let mut on_start =
            || Dispatcher::count_and_record(seqs, recorder, stream, seq, op, Some(algo), stamp);
        let result = match custom {
            Some(plan) => match self.exec.start_plan(op.spec, plan, stream, seq, started) {
                Ok(mut run) => {
                    on_start();
                    self.exec.run_blocking(&mut run)
                }
                Err(e) => Err(e),
            },
            None => self
                .exec
                .run_op(op.spec, algo, stream, seq, started, on_start),
        };
        if self.seqs[stream] != seq {
            // It started (and was recorded): record how it ended.
            self.record(stream, seq, stamp, &result);
            if let Some(shown) = &shown {
                self.show(stream, seq, shown, &result);
            }
        }
        result
    }

    /// The schedule of an op with blocks of any size (not cached: the sizes change every call).
    fn custom_plan(&self, op: &Call) -> Option<Arc<Plan>> {
        let b = op.blocks.as_deref()?;
        let (world, rank) = (self.exec.world(), self.rank);
        let actions = braid_sched::direct::all_to_all_v(
            world,
            rank,
            &b.send,
            &b.recv,
            self.exec.chunk(op.dtype),
        );
        Some(Arc::new(Plan::new(actions)))
    }

    fn finish(&self, r: &Running, result: &Result<(), Error>) {
        self.record(r.run.stream(), r.run.seq(), r.stamp, result);
        if let Some(shown) = &r.shown {
            self.show(r.run.stream(), r.run.seq(), shown, result);
        }
    }

    fn record(&self, stream: usize, seq: u64, started: Stamp, result: &Result<(), Error>) {
        self.recorder
            .finish(stream, seq, result, Stamp::now().nanos_since(started));
        if let Err(e) = result {
            if self.config.dump_on_timeout && !e.is_invalid_argument() {
                error!("rank {} {}", self.rank, self.recorder.dump());
            }
        }
    }
}
