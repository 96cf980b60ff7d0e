//! Engines as the executor sees them: memory an engine cannot compute on is refused before anything
//! happens, and an engine that completes kernels later holds back the posts and releases that depend on
//! them without changing any result.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::{DType, Error, ReduceOp};
use braid_exec::{
    CpuEngine, Engine, Executor, Kernel, Op, Progress, Scratch, Settings, Ticket, Wait,
};
use braid_sched::{Algo, Collective};
use braid_transport::mem::MemNet;
use braid_transport::{Link, MemKind, Span};

fn settings() -> Settings {
    Settings {
        timeout: Duration::from_secs(10),
        debug_checks: true,
        rings: 1,
    }
}

fn exec(net: &MemNet, rank: usize, world: usize, engine: Box<dyn Engine>) -> Executor {
    let link: Box<dyn Link> = Box::new(net.link(rank));
    Executor::new(
        rank,
        world,
        settings(),
        Some(link),
        engine,
        Arc::new(AtomicBool::new(false)),
    )
}

fn all_reduce(send: Span, recv: Span, count: usize) -> Op {
    Op {
        collective: Collective::AllReduce,
        root: 0,
        dtype: DType::F32,
        redop: ReduceOp::Sum,
        count,
        send,
        recv,
    }
}

#[test]
fn device_memory_is_refused_by_the_cpu_engine_before_anything_happens() {
    let net = MemNet::new(2, 1, 4, 1024);
    let mut e = exec(&net, 0, 2, Box::new(CpuEngine::new()));
    let mut host = vec![0u8; 16];
    // SAFETY: an address only; the executor must refuse it before touching it.
    let dev = unsafe { Span::device(0x7000_0000, 16, 0) };
    let h = Span::of_slice(&host);
    for (send, recv) in [(dev, h), (h, dev)] {
        let err = e
            .start(all_reduce(send, recv, 4), Algo::Ring, 0, 0, Instant::now())
            .err()
            .expect("device memory must be refused");
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("memory of device 0") && m.contains("cpu")),
            "{err}"
        );
    }
    assert_eq!(net.traffic().messages, vec![0, 0], "nothing was sent");
    // Partly overlapping buffers are refused too; nested ones (in place) are not.
    let p = host.as_mut_ptr();
    // SAFETY: both spans lie inside `host`, which outlives them; the first start is refused and the
    // run of the second is dropped unpolled.
    let (a, b) = unsafe { (Span::host(p, 12), Span::host(p.add(4), 12)) };
    let err = e
        .start(all_reduce(a, b, 3), Algo::Ring, 0, 0, Instant::now())
        .err();
    assert!(matches!(err, Some(Error::InvalidArgument(_))), "{err:?}");
    let err = e
        .start(all_reduce(h, h, 4), Algo::Ring, 5, 0, Instant::now())
        .err();
    assert!(
        matches!(&err, Some(Error::InvalidArgument(m)) if m.contains("channel 5")),
        "{err:?}"
    );
}

/// A CPU engine whose kernels complete only when the test says so (`done`), as a device stream's
/// would: the executor must not post or release anything that depends on them before then.
struct LateEngine {
    cpu: CpuEngine,
    next: Arc<AtomicU64>,
    done: Arc<AtomicU64>,
}

impl Engine for LateEngine {
    fn name(&self) -> &'static str {
        "late"
    }
    fn accepts(&self, kind: MemKind) -> bool {
        kind == MemKind::Host
    }
    unsafe fn submit(&mut self, kernel: &Kernel<'_>) -> Result<Option<Ticket>, Error> {
        // SAFETY: forwarded with the caller's own contract.
        unsafe { self.cpu.submit(kernel)? };
        Ok(Some(Ticket(self.next.fetch_add(1, Ordering::Relaxed) + 1)))
    }
    fn complete(&mut self, ticket: Ticket) -> Result<bool, Error> {
        Ok(ticket.0 <= self.done.load(Ordering::Relaxed))
    }
    fn wait(&mut self, _ticket: Ticket, _until: Instant) -> Result<(), Error> {
        self.done
            .store(self.next.load(Ordering::Relaxed), Ordering::Relaxed);
        Ok(())
    }
    fn scratch(&mut self, bytes: usize) -> Result<Scratch, Error> {
        self.cpu.scratch(bytes)
    }
}

#[test]
fn an_engine_that_completes_late_changes_nothing_but_order() {
    for algo in [Algo::Ring, Algo::Tree, Algo::Rhd, Algo::Direct] {
        let world = 3;
        let count = 1000;
        let net = MemNet::new(world, 1, 2, 256);
        let (next, completed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let mut execs: Vec<Executor> = (0..world)
            .map(|r| {
                let engine: Box<dyn Engine> = if r == 1 {
                    Box::new(LateEngine {
                        cpu: CpuEngine::new(),
                        next: next.clone(),
                        done: completed.clone(),
                    })
                } else {
                    Box::new(CpuEngine::new())
                };
                exec(&net, r, world, engine)
            })
            .collect();
        let inputs: Vec<Vec<f32>> = (0..world)
            .map(|r| (0..count).map(|i| (i % 7) as f32 + r as f32).collect())
            .collect();
        let mut outputs = vec![vec![0f32; count]; world];
        let now = Instant::now();
        let mut runs: Vec<_> = (0..world)
            .map(|r| {
                let send = Span::of_slice(bytemuck_f32(&inputs[r]));
                // SAFETY: `outputs[r]` outlives the run and is not touched until it completes.
                let recv = unsafe { Span::host(outputs[r].as_mut_ptr() as *mut u8, count * 4) };
                execs[r]
                    .start(all_reduce(send, recv, count), algo, 0, 7, now)
                    .unwrap()
            })
            .collect();
        let mut done = vec![false; world];
        let mut engine_waits = 0;
        for round in 0..100_000 {
            // The device finishes what it was given every few rounds.
            if round % 4 == 3 {
                completed.store(next.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            for r in 0..world {
                if done[r] {
                    continue;
                }
                match execs[r].poll(&mut runs[r], Instant::now()).unwrap() {
                    Progress::Done => done[r] = true,
                    Progress::Blocked(Wait::Engine(_)) => engine_waits += 1,
                    Progress::Blocked(_) | Progress::Yielded => {}
                }
            }
            if done.iter().all(|d| *d) {
                break;
            }
        }
        assert!(done.iter().all(|d| *d), "{algo:?} did not finish");
        assert!(
            engine_waits > 0,
            "{algo:?}: the late engine was never waited for"
        );
        for (r, out) in outputs.iter().enumerate() {
            for (i, v) in out.iter().enumerate() {
                let want: f32 = (0..world).map(|q| (i % 7) as f32 + q as f32).sum();
                assert_eq!(*v, want, "{algo:?} rank {r} element {i}");
            }
        }
        assert_eq!(net.traffic().unread, 0);
    }
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern of it is readable as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}
