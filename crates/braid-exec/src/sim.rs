//! The simulator: every rank of a job on one thread, each running the real [`Executor`] over its link
//! of one in-memory network ([`MemNet`]), polled round-robin in virtual time.
//!
//! It is the executor of the runtime, not a model of it: the same state machine, the same kernels (on
//! the [`CpuEngine`]), rings of the same bounded depth. What the network adds is control: a latency per
//! message, a rank killed after some steps (its peers see it fail) and a rank stalled after some steps
//! (it stops making progress; its peers time out). A schedule that cannot finish is reported as a
//! deadlock, with each rank's position, instead of hanging; virtual time jumps to the next arrival, and
//! to the deadline when only a fault can explain the silence.

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::{DType, Error, ReduceOp};
use braid_sched::{Action, Collective};
use braid_transport::mem::{MemNet, Traffic};
use braid_transport::{Link, Span};

use crate::engine::CpuEngine;
use crate::executor::{Executor, Op, Plan, Progress, Run, Settings};

/// What one simulated run produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Each rank's output buffer.
    pub outputs: Vec<Vec<u8>>,
    /// Payload bytes each rank sent.
    pub bytes_sent: Vec<usize>,
    /// Messages each rank sent.
    pub messages: Vec<usize>,
    /// Payload bytes sent over each link: `link_bytes[from][to]`.
    pub link_bytes: Vec<Vec<usize>>,
}

/// Why a simulated run failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimError {
    /// No rank could make progress and nothing was in transit; each rank's next action index.
    Deadlock(Vec<usize>),
    /// A rank's executor failed (a length or tag mismatch, a broken schedule).
    Failed {
        /// The rank.
        rank: usize,
        /// Its error.
        error: Error,
    },
    /// Ranks finished with messages still unread.
    Leftover(usize),
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::Deadlock(pc) => write!(f, "deadlock at actions {pc:?}"),
            SimError::Failed { rank, error } => write!(f, "rank {rank} failed: {error}"),
            SimError::Leftover(n) => write!(f, "{n} messages left unread"),
        }
    }
}

impl std::error::Error for SimError {}

/// A fault injected into one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The rank dies once it has completed `after` steps: its peers see it fail.
    Kill {
        /// The rank.
        rank: usize,
        /// Steps it completes first.
        after: u64,
    },
    /// The rank stops making progress once it has completed `after` steps; it stays alive.
    Stall {
        /// The rank.
        rank: usize,
        /// Steps it completes first.
        after: u64,
    },
}

impl Fault {
    fn rank(self) -> usize {
        match self {
            Fault::Kill { rank, .. } | Fault::Stall { rank, .. } => rank,
        }
    }
}

/// One job to simulate.
#[derive(Clone, Debug)]
pub struct Job<'a> {
    /// Each rank's schedule.
    pub plans: &'a [Vec<Action>],
    /// The collective the schedules implement (named in errors).
    pub collective: Collective,
    /// Element type.
    pub dtype: DType,
    /// Reduction.
    pub op: ReduceOp,
    /// Each rank's input.
    pub inputs: &'a [Vec<u8>],
    /// Elements of each rank's output.
    pub out_count: usize,
    /// Slots per ring.
    pub depth: usize,
    /// Virtual latency of every message.
    pub latency: Duration,
    /// How long (virtual time) a collective may take.
    pub timeout: Duration,
    /// Injected faults.
    pub faults: Vec<Fault>,
}

impl<'a> Job<'a> {
    /// A fault-free job without latency.
    pub fn new(
        plans: &'a [Vec<Action>],
        dtype: DType,
        op: ReduceOp,
        inputs: &'a [Vec<u8>],
        out_count: usize,
        depth: usize,
    ) -> Job<'a> {
        Job {
            plans,
            collective: Collective::AllReduce,
            dtype,
            op,
            inputs,
            out_count,
            depth,
            latency: Duration::ZERO,
            timeout: Duration::from_secs(10),
            faults: Vec::new(),
        }
    }
}

/// What became of every rank.
#[derive(Debug)]
pub struct Report {
    /// Each rank's result; `None` for a rank that was killed or stalled.
    pub results: Vec<Option<Result<(), Error>>>,
    /// Each rank's output buffer (exact only where the rank succeeded).
    pub outputs: Vec<Vec<u8>>,
    /// What crossed the network.
    pub traffic: Traffic,
    /// Virtual time at the end.
    pub elapsed: Duration,
}

enum Rank {
    Running(Box<(Executor<CpuEngine>, Run)>),
    Finished(Result<(), Error>),
    Killed,
    Stalled,
}

/// The largest message any action of `plans` can send, in bytes (accumulator types are at most 8).
fn slot_bytes(plans: &[Vec<Action>]) -> usize {
    let len = |a: &Action| match a {
        Action::Copy { .. } | Action::LoadAcc { .. } | Action::FinishScratch { .. } => 0,
        Action::Send { range, .. }
        | Action::SendAcc { range, .. }
        | Action::RecvReduceSend { range, .. }
        | Action::RecvCombine { range, .. }
        | Action::SendScratch { range, .. } => range.len(),
        Action::RecvReduceFinal { input, .. } => input.len(),
        Action::RecvCopy { output, .. } => output.len(),
        Action::RecvReduceAll { input, .. } => input.len(),
    };
    let most = plans.iter().flatten().map(len).max().unwrap_or(0);
    (most * 8).max(64)
}

/// Runs `job` to the end: every rank finishes, fails, or is the victim of a fault. Never hangs: a
/// state where nothing can move and nothing is in transit is a [`SimError::Deadlock`] without faults,
/// and the deadline (virtual time) with them.
pub fn simulate(job: &Job<'_>) -> Result<Report, SimError> {
    let n = job.plans.len();
    let es = job.dtype.size();
    let net = MemNet::new(n, 1, job.depth.max(1), slot_bytes(job.plans));
    net.set_latency(job.latency);
    let mut outputs = vec![vec![0u8; job.out_count * es]; n];
    let base = Instant::now();
    let settings = Settings {
        timeout: job.timeout,
        debug_checks: false,
        rings: 1,
    };
    let mut ranks = Vec::with_capacity(n);
    let mut aborts = Vec::with_capacity(n);
    for (r, out) in outputs.iter_mut().enumerate() {
        let link = net.link(r);
        aborts.push(link.abort_handle());
        let link: Option<Box<dyn Link>> = (n > 1).then(|| Box::new(link) as Box<dyn Link>);
        let mut exec = Executor::new(
            r,
            n,
            settings,
            link,
            Box::new(CpuEngine::new()),
            Arc::new(AtomicBool::new(false)),
        );
        let input = job.inputs.get(r).map_or(&[][..], Vec::as_slice);
        // SAFETY: the input is only read, and both vectors outlive every run (the runs end, or are
        // dropped, before this function returns) and are not touched meanwhile.
        let (send, recv) = unsafe {
            (
                Span::host(input.as_ptr() as *mut u8, input.len()),
                Span::host(out.as_mut_ptr(), out.len()),
            )
        };
        let op = Op {
            collective: job.collective,
            root: 0,
            dtype: job.dtype,
            redop: job.op,
            count: job.out_count,
            send,
            recv,
        };
        let plan = Arc::new(Plan::new(job.plans[r].clone()));
        match exec.start_plan(op, plan, 0, 0, base) {
            Ok(run) => ranks.push(Rank::Running(Box::new((exec, run)))),
            Err(e) => ranks.push(Rank::Finished(Err(e))),
        }
    }
    loop {
        let mut progressed = false;
        let now = base + net.now();
        for r in 0..n {
            let Rank::Running(running) = &mut ranks[r] else {
                continue;
            };
            let (exec, run) = &mut **running;
            let fault = job.faults.iter().find(|f| f.rank() == r);
            match fault {
                Some(Fault::Kill { after, .. }) if run.steps() >= *after => {
                    net.kill(r);
                    ranks[r] = Rank::Killed;
                    progressed = true;
                    continue;
                }
                Some(Fault::Stall { after, .. }) if run.steps() >= *after => {
                    ranks[r] = Rank::Stalled;
                    progressed = true;
                    continue;
                }
                _ => {}
            }
            let before = run.steps();
            match exec.poll_for(run, now, 4) {
                Ok(Progress::Done) => {
                    ranks[r] = Rank::Finished(Ok(()));
                    progressed = true;
                }
                Ok(Progress::Blocked(_) | Progress::Yielded) => progressed |= run.steps() != before,
                Err(e) => {
                    // As the communicator does: a failed rank tells its peers.
                    aborts[r].fail_and_wake();
                    ranks[r] = Rank::Finished(Err(e));
                    progressed = true;
                }
            }
        }
        if !ranks.iter().any(|r| matches!(r, Rank::Running(..))) {
            break;
        }
        if progressed {
            continue;
        }
        if let Some(t) = net.next_arrival() {
            net.advance(t.saturating_sub(net.now()));
        } else if !job.faults.is_empty() && net.now() < job.timeout {
            net.advance(job.timeout - net.now());
        } else {
            let pcs = ranks
                .iter()
                .map(|r| match r {
                    Rank::Running(running) => running.1.position(),
                    _ => usize::MAX,
                })
                .collect();
            return Err(SimError::Deadlock(pcs));
        }
    }
    let results = ranks
        .into_iter()
        .map(|r| match r {
            Rank::Finished(res) => Some(res),
            _ => None,
        })
        .collect();
    Ok(Report {
        results,
        outputs,
        traffic: net.traffic(),
        elapsed: net.now(),
    })
}

/// Runs fault-free `plans` (one per rank) with `inputs[r]` as rank `r`'s input and an output of
/// `out_count` elements per rank, over rings of `depth` slots. Ring schedules need `depth >= 2`: a
/// fused receive-reduce-send holds its incoming slot until the next peer's slot frees.
pub fn run(
    plans: &[Vec<Action>],
    dtype: DType,
    op: ReduceOp,
    inputs: &[Vec<u8>],
    out_count: usize,
    depth: usize,
) -> Result<Outcome, SimError> {
    let report = simulate(&Job::new(plans, dtype, op, inputs, out_count, depth))?;
    for (rank, r) in report.results.into_iter().enumerate() {
        if let Some(Err(error)) = r {
            return Err(SimError::Failed { rank, error });
        }
    }
    if report.traffic.unread > 0 {
        return Err(SimError::Leftover(report.traffic.unread));
    }
    Ok(Outcome {
        outputs: report.outputs,
        bytes_sent: report.traffic.bytes_sent(),
        messages: report.traffic.messages,
        link_bytes: report.traffic.link_bytes,
    })
}
