//! Faults across real processes, and a bounded soak. This file is its own test harness, like
//! `processes.rs`: run without `BRAID_RANK` it launches copies of itself as ranks and checks how they end;
//! run with `BRAID_RANK` it is a rank and plays the scenario named by its first argument.
//!
//! Fault scenarios start their ranks directly (not through `braid run`, which would stop the survivors of
//! a fault): a victim rank dies (SIGKILL, SIGTERM, exit code 0) or stops (SIGSTOP) in the middle of a
//! stream of large all-reduces, and every survivor must see an error from the collective, not hang, find
//! its communicator poisoned, and still be able to build a new communicator with the other survivors.
//! Every wait is bounded by `BRAID_TIMEOUT_MS`; the harness bounds every scenario by twice that plus slack,
//! so a hang is a failure with the ranks' output, never a stuck test.

mod common;

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use braid::{Collective, Communicator, Config, DType, Error, ReduceOp, UniqueId};
use braid_core::exact::{fill, inputs, reduced, wrong};
use common::{braid_run, braid_segments, case, free_port, me, no_segments_left, show};

/// The timeout of the fault scenarios: short, so that a stopped peer is given up on quickly.
const FAULT_TIMEOUT_MS: u64 = 4000;
/// What a scenario may take beyond twice its timeout: process start, bootstrap, a second communicator.
const SLACK: Duration = Duration::from_secs(5);
/// How long a call on a poisoned communicator may take: it returns at once; this only allows for a
/// loaded machine, and is far below the timeout.
const FAIL_FAST_MS: u128 = 500;
/// Elements of the all-reduces a fault interrupts (16 MiB of f32: many slots, many chunks per rank).
const BIG: usize = 4 << 20;

/// [`BIG`], or `FAULTS_BIG_ELEMS` where a slow machine (the emulated RDMA guest) needs shorter
/// collectives to stay well inside the scenarios' bounds.
fn big() -> usize {
    std::env::var("FAULTS_BIG_ELEMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n >= 1 << 16)
        .unwrap_or(BIG)
}

// ---------------------------------------------------------------------------------------------------
// Rank side.

/// The transports the harness-side cases run over: `BRAID_TEST_TRANSPORTS` (comma-separated, e.g.
/// `rdma` inside the RDMA test guest), by default shared memory, TCP and `shared` (shared memory with
/// the all-reduces' buffers from `Communicator::alloc`, so that they run straight through them).
fn transports() -> Vec<&'static str> {
    let Ok(v) = std::env::var("BRAID_TEST_TRANSPORTS") else {
        return vec!["shm", "tcp", "shared"];
    };
    v.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| match t {
            "shm" => "shm",
            "tcp" => "tcp",
            "rdma" => "rdma",
            "shared" => "shared",
            other => panic!("BRAID_TEST_TRANSPORTS: {other:?} is not shm, tcp, shared or rdma"),
        })
        .collect()
}

/// [`transports`] without `shared`: the cases whose buffers are their own.
fn link_transports() -> Vec<&'static str> {
    transports()
        .into_iter()
        .filter(|t| *t != "shared")
        .collect()
}

/// The variant of an error and the peer it names.
fn kind(e: &Error) -> (&'static str, Option<usize>) {
    match e {
        Error::Timeout { peer, .. } => ("Timeout", Some(*peer)),
        Error::PeerFailed { peer, .. } => ("PeerFailed", Some(*peer)),
        Error::Mismatch { peer, .. } => ("Mismatch", Some(*peer)),
        Error::Aborted { .. } => ("Aborted", None),
        Error::Poisoned { .. } => ("Poisoned", None),
        Error::InvalidArgument(_) => ("InvalidArgument", None),
        Error::Bootstrap(_) => ("Bootstrap", None),
        Error::Io { .. } => ("Io", None),
        _ => ("other", None),
    }
}

fn peer_text(p: Option<usize>) -> String {
    p.map_or("-".to_string(), |p| p.to_string())
}

/// Sends `sig` to this process.
fn signal_self(sig: libc::c_int) {
    // SAFETY: kill(2) on our own pid has no memory effects in this process beyond the signal itself.
    unsafe {
        libc::kill(std::process::id() as libc::pid_t, sig);
    }
}

fn env_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

/// The survivors' second communicator, named by `BRAID_ROOT2`/`BRAID_SECRET2`, rank `BRAID_RANK2` of 2;
/// an all-reduce over it must be right.
fn second_communicator() -> Result<String, String> {
    let id: UniqueId = format!("{}/{}", env_var("BRAID_ROOT2"), env_var("BRAID_SECRET2"))
        .parse()
        .map_err(|e| format!("second id: {e}"))?;
    let rank: usize = env_var("BRAID_RANK2").parse().unwrap();
    let start = Instant::now();
    let config = Config::from_env().map_err(|e| e.to_string())?;
    let c = Communicator::init(2, rank, &id, config).map_err(|e| format!("second init: {e}"))?;
    let mut x: Vec<f32> = (0..big() / 4).map(|i| (i % 5 + rank) as f32).collect();
    c.all_reduce_in_place(&mut x, ReduceOp::Sum)
        .map_err(|e| format!("second all_reduce: {e}"))?;
    let bad = x
        .iter()
        .enumerate()
        .filter(|(i, v)| **v != (2 * (i % 5) + 1) as f32)
        .count();
    let mut y = [rank as u64 + 10];
    c.all_reduce_in_place(&mut y, ReduceOp::Max)
        .map_err(|e| format!("second small all_reduce: {e}"))?;
    if bad != 0 || y[0] != 11 {
        return Err(format!(
            "second communicator: {bad} wrong elements, max {}",
            y[0]
        ));
    }
    Ok(format!(
        "second communicator ok in {} ms",
        start.elapsed().as_millis()
    ))
}

/// A victim dies or stops ~30 ms into a stream of large all-reduces; the survivors report what they saw.
fn scenario_fault(c: &Communicator, fault: &str, victim: usize) -> i32 {
    let (rank, world) = (c.rank(), c.world_size());
    let mut shared = std::env::var_os("FAULTS_SHARED").map(|_| c.alloc(big() * 4).unwrap());
    let mut own = if shared.is_some() {
        Vec::new()
    } else {
        vec![1.0f32; big()]
    };
    let buf: &mut [f32] = match &mut shared {
        Some(s) => &mut s.as_mut_slice()[..big()],
        None => &mut own,
    };
    buf.fill(1.0);
    c.barrier().unwrap();
    let start = Instant::now();
    if rank == victim {
        let fault = fault.to_string();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            match fault.as_str() {
                "kill" => signal_self(libc::SIGKILL),
                "term" => signal_self(libc::SIGTERM),
                "stop" => signal_self(libc::SIGSTOP),
                "exit0" => std::process::exit(0),
                other => panic!("unknown fault {other}"),
            }
        });
    }
    let mut done = 0usize;
    let (first, call) = loop {
        let t = Instant::now();
        match c.all_reduce_in_place(buf, ReduceOp::Sum) {
            Ok(()) => {
                if buf.iter().any(|v| *v != world as f32) {
                    println!("FAIL all-reduce #{done} before the fault gave a wrong result");
                    return 1;
                }
                buf.fill(1.0);
                done += 1;
            }
            Err(e) => break (e, t.elapsed()),
        }
    };
    let at = start.elapsed();
    let (k, peer) = kind(&first);
    println!(
        "first rank={rank} kind={k} peer={} at_ms={} call_ms={} ops={done} | {first}",
        peer_text(peer),
        at.as_millis(),
        call.as_millis()
    );
    let mut ok = true;
    let dead = fault != "stop";
    let expected = match &first {
        Error::PeerFailed { collective, .. } => collective == "all_reduce",
        Error::Timeout { collective, .. } => !dead && collective == "all_reduce",
        _ => false,
    };
    if !expected {
        println!("FAIL unexpected first error for fault {fault}: {first:?}");
        ok = false;
    }
    // Later calls fail fast, with the error that poisoned the communicator.
    let t = Instant::now();
    let later = c.barrier();
    let mut small = [1u32; 3];
    let later2 = c.all_reduce_in_place(&mut small, ReduceOp::Sum);
    let later_ms = t.elapsed().as_millis();
    let lk = later.as_ref().err().map_or("Ok", |e| kind(e).0);
    println!(
        "later kind={lk} ms={later_ms} | {}",
        later
            .as_ref()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    );
    let poisoned = |r: &Result<(), Error>| matches!(r, Err(Error::Poisoned { first: f, .. }) if *f == first.to_string());
    if !poisoned(&later) || !poisoned(&later2) || later_ms > FAIL_FAST_MS {
        println!("FAIL later calls: {later:?} / {later2:?} in {later_ms} ms");
        ok = false;
    }
    if c.async_error().as_ref() != Some(&first) {
        println!(
            "FAIL async_error() is {:?}, not the first error",
            c.async_error()
        );
        ok = false;
    }
    match second_communicator() {
        Ok(m) => println!("new {m}"),
        Err(m) => {
            println!("FAIL {m}");
            ok = false;
        }
    }
    i32::from(!ok)
}

/// Rank 0 blocks in an all-reduce that rank 1 has not joined; a thread of rank 0 aborts after 200 ms.
fn scenario_abort(c: &Communicator) -> i32 {
    let rank = c.rank();
    c.barrier().unwrap();
    let mut buf = vec![1.0f32; big()];
    if rank == 0 {
        let (r, returned, aborted_at) = std::thread::scope(|s| {
            let h = s.spawn(|| {
                std::thread::sleep(Duration::from_millis(200));
                let t = Instant::now();
                c.abort();
                t
            });
            let r = c.all_reduce_in_place(&mut buf, ReduceOp::Sum);
            let returned = Instant::now();
            (r, returned, h.join().unwrap())
        });
        let after = returned.saturating_duration_since(aborted_at);
        let e = match r {
            Ok(()) => {
                println!("FAIL the all-reduce succeeded without rank 1");
                return 1;
            }
            Err(e) => e,
        };
        println!(
            "abort kind={} after_ms={} returned_before_abort={} | {e}",
            kind(&e).0,
            after.as_millis(),
            returned < aborted_at
        );
        let mut ok = matches!(e, Error::Aborted { .. })
            && returned >= aborted_at
            && after < Duration::from_secs(2);
        let t = Instant::now();
        let later = c.barrier();
        let later_ms = t.elapsed().as_millis();
        println!("later {later:?} in {later_ms} ms");
        ok &= matches!(later, Err(Error::Poisoned { .. })) && later_ms < FAIL_FAST_MS;
        ok &= matches!(c.async_error(), Some(Error::Aborted { .. }));
        // Stay alive while rank 1 runs into the abort, so that it learns of it from the failed flag and
        // not from a vanished process.
        std::thread::sleep(Duration::from_secs(4));
        i32::from(!ok)
    } else {
        std::thread::sleep(Duration::from_millis(1000));
        let t = Instant::now();
        let r = c.all_reduce_in_place(&mut buf, ReduceOp::Sum);
        let took = t.elapsed();
        let Err(e) = r else {
            println!("FAIL rank 1's all-reduce succeeded after rank 0 aborted");
            return 1;
        };
        let (k, peer) = kind(&e);
        println!(
            "peer kind={k} peer={} ms={} | {e}",
            peer_text(peer),
            took.as_millis()
        );
        // Over shared memory the aborted rank marks itself failed; over TCP it closes its connections.
        let ok = matches!(&e, Error::PeerFailed { peer: 0, reason, .. }
                if reason.contains("failed or aborted")
                    || reason.contains("closed the connection")
                    || reason.contains("sending to it failed"))
            && took < Duration::from_secs(10);
        i32::from(!ok)
    }
}

/// Rank 0 queues async all-reduces and drops its communicator at once; rank 1 dies (or stops) after its
/// second all-reduce. The drop runs the queue to the end and must return within twice the timeout.
fn scenario_destroy(c: Communicator, mode: &str) -> i32 {
    let rank = c.rank();
    c.barrier().unwrap();
    if rank == 1 {
        let mut buf = vec![1.0f32; big()];
        for _ in 0..2 {
            buf.fill(1.0);
            c.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
        }
        signal_self(if mode == "stop" {
            libc::SIGSTOP
        } else {
            libc::SIGKILL
        });
        // A stopped rank is killed by the harness before it gets here.
        std::thread::sleep(Duration::from_secs(600));
        return 1;
    }
    let works: Vec<_> = (0..4)
        .map(|_| c.all_reduce_async(vec![1.0f32; big()], ReduceOp::Sum))
        .collect();
    let t = Instant::now();
    drop(c);
    let drop_ms = t.elapsed().as_millis();
    let results: Vec<_> = works.into_iter().map(|w| w.wait()).collect();
    let summary: Vec<String> = results
        .iter()
        .map(|r| match r {
            Ok(v) if v.iter().all(|x| *x == 2.0) => "ok".to_string(),
            Ok(_) => "WRONG".to_string(),
            Err(e) => format!("{}({})", kind(e).0, peer_text(kind(e).1)),
        })
        .collect();
    println!("drop_ms={drop_ms} works={}", summary.join(","));
    for r in &results {
        if let Err(e) = r {
            println!("  {e}");
        }
    }
    let want = if mode == "stop" {
        "Timeout(1)"
    } else {
        "PeerFailed(1)"
    };
    let ok = summary == ["ok", "ok", want, "Poisoned(-)"] && drop_ms < 2 * FAULT_TIMEOUT_MS as u128;
    i32::from(!ok)
}

/// xorshift64*: every rank seeds it the same way and so makes the same sequence of calls.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// Growth of VmRSS allowed between 10% of the soak and its end. One op's working set is at most a few
/// MiB (each rank's inputs for the reference, ≤ 4 × 1 MiB, plus send, receive and the executor's
/// accumulator scratch, ≤ 8 MiB for i8/u8 summed in wider types) and is reached long before 10% of the
/// ops, so the allocator has no reason to grow past it; 64 MiB is far above that noise and far below
/// what a leak of one buffer per op would add (hundreds of MiB at the default size).
const RSS_GROWTH_LIMIT_KIB: u64 = 64 << 10;

const SOAK_KINDS: [&str; 6] = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "barrier",
];

/// `SOAK_OPS` random collectives (kind, size, dtype, op, algorithm, root), every result checked exactly.
fn scenario_soak(c: &Communicator) -> i32 {
    let (rank, world) = (c.rank(), c.world_size());
    println!("pid={}", std::process::id());
    let ops: usize = std::env::var("SOAK_OPS")
        .ok()
        .map_or(3000, |v| v.parse().expect("SOAK_OPS"));
    let seed: u64 = std::env::var("SOAK_SEED")
        .ok()
        .map_or(0x9e37_79b9_7f4a_7c15, |v| v.parse().expect("SOAK_SEED"));
    let mut rng = Rng(seed | 1);
    let mut bad = 0u64;
    let mut per_kind = [0usize; 6];
    let mut in_calls = [Duration::ZERO; 6];
    let mut bytes_moved = 0usize;
    let mut rss_early = 0u64;
    c.barrier().unwrap();
    let start = Instant::now();
    for i in 0..ops {
        if i == ops / 10 {
            rss_early = vm_rss_kib();
        }
        // Every draw happens on every rank, in the same order, whatever the rank.
        let k = rng.below(SOAK_KINDS.len());
        let dtype = DType::ALL[rng.below(DType::ALL.len())];
        let op = ReduceOp::ARITHMETIC[rng.below(ReduceOp::ARITHMETIC.len())];
        let bytes = match rng.below(32) {
            0 => 0,
            1 => 1 << 20,
            _ => (2f64.powf(rng.unit() * 20.0) as usize).min(1 << 20),
        };
        let root = rng.below(world);
        let in_place = rng.below(2) == 0;
        let coll = [
            Some(Collective::AllReduce),
            Some(Collective::ReduceScatter),
            Some(Collective::AllGather),
            Some(Collective::Broadcast),
            Some(Collective::Reduce),
            None,
        ][k];
        if let Some(coll) = coll {
            let algos = coll.algos();
            let pick = rng.below(algos.len() + 1);
            c.set_algorithm(coll, algos.get(pick).copied()).unwrap();
        }
        let es = dtype.size();
        let count = bytes / es;
        let what = format!(
            "op #{i}: {} {dtype} {op} {} bytes root {root}",
            SOAK_KINDS[k],
            count * es
        );
        let r = match k {
            0 => {
                let ins = inputs(count * es, dtype, op, world);
                let want = reduced(&ins, dtype, op);
                if in_place {
                    let mut buf = ins[rank].clone();
                    let t = Instant::now();
                    let r = c.all_reduce_bytes_in_place(&mut buf, dtype, op);
                    in_calls[k] += t.elapsed();
                    bad += wrong(&buf, &want, es);
                    r
                } else {
                    let mut out = vec![0x5au8; count * es];
                    let t = Instant::now();
                    let r = c.all_reduce_bytes(&ins[rank], &mut out, dtype, op);
                    in_calls[k] += t.elapsed();
                    bad += wrong(&out, &want, es);
                    r
                }
            }
            1 => {
                let rc = count / world;
                let ins = inputs(world * rc * es, dtype, op, world);
                let want = reduced(&ins, dtype, op);
                let mut out = vec![0x5au8; rc * es];
                let t = Instant::now();
                let r = c.reduce_scatter_bytes(&ins[rank], &mut out, dtype, op);
                in_calls[k] += t.elapsed();
                bad += wrong(&out, &want[rank * rc * es..(rank + 1) * rc * es], es);
                r
            }
            2 => {
                let rc = count / world;
                let ins = inputs(rc * es, dtype, op, world);
                let mut out = vec![0x5au8; world * rc * es];
                let t = Instant::now();
                let r = c.all_gather_bytes(&ins[rank], &mut out, dtype);
                in_calls[k] += t.elapsed();
                bad += wrong(&out, &ins.concat(), es);
                r
            }
            3 => {
                let mut send = vec![0u8; count * es];
                fill(&mut send, dtype, op, root);
                let mut out = if rank == root {
                    send.clone()
                } else {
                    vec![0x5au8; count * es]
                };
                // Off the root the send buffer is ignored: an empty one, or one full of junk.
                let junk = vec![0x33u8; count * es];
                let t = Instant::now();
                let r = if rank == root {
                    c.broadcast_bytes(&send, &mut out, dtype, root)
                } else if in_place {
                    c.broadcast_bytes(&[], &mut out, dtype, root)
                } else {
                    c.broadcast_bytes(&junk, &mut out, dtype, root)
                };
                in_calls[k] += t.elapsed();
                bad += wrong(&out, &send, es);
                r
            }
            4 => {
                let ins = inputs(count * es, dtype, op, world);
                let want = reduced(&ins, dtype, op);
                let mut out = vec![0xaau8; count * es];
                let t = Instant::now();
                let r = c.reduce_bytes(&ins[rank], &mut out, dtype, op, root);
                in_calls[k] += t.elapsed();
                if rank == root {
                    bad += wrong(&out, &want, es);
                } else {
                    bad += out.iter().filter(|b| **b != 0xaa).count() as u64;
                }
                r
            }
            _ => {
                let t = Instant::now();
                let r = c.barrier();
                in_calls[k] += t.elapsed();
                r
            }
        };
        if let Err(e) = r {
            println!("FAIL soak rank {rank}: {what}: {e}");
            return 1;
        }
        per_kind[k] += 1;
        bytes_moved += count * es;
        if bad != 0 {
            println!("FAIL soak rank {rank}: {what}: {bad} wrong elements so far");
            return 1;
        }
    }
    c.barrier().unwrap();
    let secs = start.elapsed().as_secs_f64();
    let rss_end = vm_rss_kib();
    let growth = rss_end.saturating_sub(rss_early);
    let counts: Vec<String> = SOAK_KINDS
        .iter()
        .zip(per_kind)
        .zip(in_calls)
        .map(|((n, k), t)| {
            format!(
                "{n} {k} ({:.0} us/call)",
                t.as_secs_f64() * 1e6 / k.max(1) as f64
            )
        })
        .collect();
    println!(
        "soak rank {rank} ok: {ops} ops ({}), {:.0} MiB of buffers, {bad} wrong, {secs:.1} s, {:.0} ops/s, \
         VmRSS {:.1} MiB at 10% -> {:.1} MiB at the end (+{:.1} MiB, limit {} MiB)",
        counts.join(", "),
        bytes_moved as f64 / (1 << 20) as f64,
        ops as f64 / secs,
        rss_early as f64 / 1024.0,
        rss_end as f64 / 1024.0,
        growth as f64 / 1024.0,
        RSS_GROWTH_LIMIT_KIB >> 10
    );
    if growth > RSS_GROWTH_LIMIT_KIB {
        println!("FAIL soak rank {rank}: VmRSS grew by {growth} KiB");
        return 1;
    }
    0
}

fn rank_main(scenario: &str, args: &[String]) -> i32 {
    let c = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("init failed: {e}");
            return 1;
        }
    };
    match scenario {
        "fault" => {
            let code = scenario_fault(&c, &args[0], args[1].parse().unwrap());
            let t = Instant::now();
            drop(c);
            println!("drop_ms={}", t.elapsed().as_millis());
            code
        }
        "abort" => scenario_abort(&c),
        "destroy" => scenario_destroy(c, &args[0]),
        "soak" => scenario_soak(&c),
        other => {
            println!("unknown scenario {other}");
            2
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Harness side.

/// Pids of every rank these tests started, to tell their shared-memory segments from other runs'.
static PIDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// A secret for a communicator started by this harness.
fn secret(salt: u64) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    format!(
        "{:016x}{:016x}",
        t ^ salt.rotate_left(32),
        std::process::id() as u64 ^ salt
    )
}

/// A rank started directly, its output drained by threads so that it never blocks on a full pipe.
struct Proc {
    rank: usize,
    child: Child,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
    status: Option<ExitStatus>,
    stdout: String,
    stderr: String,
}

fn drain(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

impl Proc {
    fn spawn(rank: usize, args: &[&str], vars: &[(String, String)]) -> Proc {
        let mut cmd = Command::new(me());
        cmd.args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_remove("BRAID_RANK");
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        PIDS.lock().unwrap().push(child.id());
        let out = Some(drain(child.stdout.take().unwrap()));
        let err = Some(drain(child.stderr.take().unwrap()));
        Proc {
            rank,
            child,
            out,
            err,
            status: None,
            stdout: String::new(),
            stderr: String::new(),
        }
    }

    /// Whether it has ended; collects its output when it has.
    fn poll(&mut self) -> bool {
        if self.status.is_none() {
            if let Some(s) = self.child.try_wait().unwrap() {
                self.status = Some(s);
                self.stdout = self.out.take().unwrap().join().unwrap();
                self.stderr = self.err.take().unwrap().join().unwrap();
            }
        }
        self.status.is_some()
    }

    fn kill(&mut self) {
        if !self.poll() {
            let _ = self.child.kill();
            let _ = self.child.wait();
            self.poll();
        }
    }

    fn show(&self) -> String {
        format!(
            "rank {} status {:?}\nstdout:\n{}\nstderr:\n{}",
            self.rank, self.status, self.stdout, self.stderr
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A failed assertion must not leave a stopped or spinning rank behind.
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Waits until every process of `ps` has ended, or kills them all at `deadline` and fails.
fn wait_all(ps: &mut [&mut Proc], deadline: Instant, what: &str) {
    while !ps.iter_mut().all(|p| p.poll()) {
        if Instant::now() >= deadline {
            for p in ps.iter_mut() {
                p.kill();
            }
            let outs: Vec<String> = ps.iter().map(|p| p.show()).collect();
            panic!("{what}: still running at the deadline\n{}", outs.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The job environment of rank `r` of `world` started directly.
fn job_vars(
    r: usize,
    world: usize,
    port: u16,
    secret: &str,
    timeout_ms: u64,
) -> Vec<(String, String)> {
    vec![
        ("BRAID_RANK".into(), r.to_string()),
        ("BRAID_WORLD_SIZE".into(), world.to_string()),
        ("BRAID_ROOT".into(), format!("127.0.0.1:{port}")),
        ("BRAID_SECRET".into(), secret.into()),
        ("BRAID_TIMEOUT_MS".into(), timeout_ms.to_string()),
    ]
}

/// `key=value` from a line of a rank's report.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split(" | ")
        .next()?
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// What one survivor of a fault reported.
struct Seen {
    rank: usize,
    kind: String,
    peer: Option<usize>,
    at_ms: u64,
    message: String,
    later_ms: u64,
    drop_ms: u64,
}

fn seen(p: &Proc) -> Seen {
    let line = |prefix: &str| {
        p.stdout
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line:\n{}", p.show()))
            .to_string()
    };
    let first = line("first ");
    let later = line("later ");
    let drop = line("drop_ms=");
    let num = |l: &str, k: &str| -> u64 { field(l, k).and_then(|v| v.parse().ok()).unwrap() };
    Seen {
        rank: p.rank,
        kind: field(&first, "kind").unwrap().to_string(),
        peer: field(&first, "peer").and_then(|v| v.parse().ok()),
        at_ms: num(&first, "at_ms"),
        message: first.split_once(" | ").unwrap().1.to_string(),
        later_ms: num(&later, "ms"),
        drop_ms: num(&drop, "drop_ms"),
    }
}

/// The message without the reporting rank's prefix, cut to `n` characters.
fn head(m: &str, n: usize) -> String {
    let m = m.split_once(": ").map_or(m, |(_, rest)| rest);
    if m.chars().count() > n {
        format!("{}…", m.chars().take(n).collect::<String>())
    } else {
        m.to_string()
    }
}

struct Row {
    transport: &'static str,
    fault: &'static str,
    victim: usize,
    victim_end: String,
    seen: Vec<Seen>,
    wall: Duration,
}

fn run_fault(transport: &'static str, fault: &'static str, victim: usize) -> Row {
    let world = 3;
    let (port, port2) = (free_port(), free_port());
    let (s1, s2) = (secret(victim as u64 * 8 + 1), secret(victim as u64 * 8 + 2));
    let survivors: Vec<usize> = (0..world).filter(|r| *r != victim).collect();
    let start = Instant::now();
    let mut ps: Vec<Proc> = (0..world)
        .map(|r| {
            let mut vars = job_vars(r, world, port, &s1, FAULT_TIMEOUT_MS);
            vars.push(("BRAID_ROOT2".into(), format!("127.0.0.1:{port2}")));
            vars.push(("BRAID_SECRET2".into(), s2.clone()));
            if transport == "shared" {
                vars.push(("BRAID_TRANSPORT".into(), "shm".into()));
                vars.push(("FAULTS_SHARED".into(), "1".into()));
            } else {
                vars.push(("BRAID_TRANSPORT".into(), transport.into()));
            }
            if let Some(r2) = survivors.iter().position(|s| *s == r) {
                vars.push(("BRAID_RANK2".into(), r2.to_string()));
            }
            Proc::spawn(r, &["fault", fault, &victim.to_string()], &vars)
        })
        .collect();
    let deadline = start + Duration::from_millis(2 * FAULT_TIMEOUT_MS) + SLACK;
    let what = format!("fault {fault} of rank {victim} over {transport}");
    {
        let mut live: Vec<&mut Proc> = ps.iter_mut().filter(|p| p.rank != victim).collect();
        wait_all(&mut live, deadline, &what);
    }
    let wall = start.elapsed();
    let v = &mut ps[victim];
    if fault == "stop" {
        assert!(!v.poll(), "the stopped rank ended by itself:\n{}", v.show());
        v.kill();
    } else {
        wait_all(&mut [&mut *v], Instant::now() + SLACK, &what);
    }
    let status = v.status.unwrap();
    let victim_end = match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => "?".into(),
    };
    let expected_end = match fault {
        "kill" | "stop" => "signal 9",
        "term" => "signal 15",
        _ => "exit 0",
    };
    assert_eq!(victim_end, expected_end, "{what}: victim:\n{}", v.show());
    for p in &ps {
        if p.rank != victim {
            assert!(
                p.status.unwrap().success(),
                "{what}: survivor failed:\n{}",
                p.show()
            );
        }
    }
    let seen: Vec<Seen> = ps.iter().filter(|p| p.rank != victim).map(seen).collect();
    let all = || ps.iter().map(|p| p.show()).collect::<Vec<_>>().join("\n");
    for s in &seen {
        let named_ok = match s.kind.as_str() {
            // A dead victim is seen directly, or through a survivor that saw it and marked itself failed.
            "PeerFailed" if fault != "stop" => {
                s.peer == Some(victim)
                    || seen
                        .iter()
                        .any(|o| Some(o.rank) == s.peer && o.peer == Some(victim))
            }
            // A stopped victim is still alive: a survivor that times out names it, also when it was
            // waiting on another survivor that was itself waiting on the victim (the chain of waits
            // is followed); the others learn that a survivor failed.
            // A rare interleaving can still blame a survivor; at least one survivor's timeout must
            // name the stopped rank.
            "Timeout" => {
                fault == "stop"
                    && (s.peer == Some(victim)
                        || seen
                            .iter()
                            .any(|o| o.kind == "Timeout" && o.peer == Some(victim)))
            }
            "PeerFailed" => seen
                .iter()
                .any(|o| Some(o.rank) == s.peer && o.kind == "Timeout"),
            _ => false,
        };
        assert!(
            named_ok,
            "{what}: rank {} saw {} naming rank {:?}:\n{}",
            s.rank,
            s.kind,
            s.peer,
            all()
        );
        assert!(
            (s.later_ms as u128) < FAIL_FAST_MS && s.drop_ms < 2 * FAULT_TIMEOUT_MS,
            "{what}: rank {}: later calls took {} ms, the drop {} ms",
            s.rank,
            s.later_ms,
            s.drop_ms
        );
    }
    assert!(
        wall < Duration::from_millis(2 * FAULT_TIMEOUT_MS) + SLACK,
        "{what}: survivors took {wall:?}"
    );
    Row {
        transport,
        fault,
        victim,
        victim_end,
        seen,
        wall,
    }
}

fn test_fault_matrix() {
    let mut rows = Vec::new();
    for transport in transports() {
        for victim in [1, 0] {
            for fault in ["kill", "term", "exit0", "stop"] {
                let row = run_fault(transport, fault, victim);
                println!(
                    "  {fault} rank {victim} over {transport}: ok ({:.1} s)",
                    row.wall.as_secs_f64()
                );
                rows.push(row);
            }
        }
    }
    println!(
        "  {:<4} {:<6} {:<6} {:<10} {:<8} {:<16} {:>9} {:>8} {:>7}  message",
        "via",
        "fault",
        "victim",
        "victim end",
        "survivor",
        "error",
        "t_err ms",
        "later ms",
        "drop ms"
    );
    for r in &rows {
        for (i, s) in r.seen.iter().enumerate() {
            let (t, f, v, e) = if i == 0 {
                (
                    r.transport,
                    r.fault,
                    r.victim.to_string(),
                    r.victim_end.as_str(),
                )
            } else {
                ("", "", String::new(), "")
            };
            println!(
                "  {t:<4} {f:<6} {v:<6} {e:<10} {:<8} {:<16} {:>9} {:>8} {:>7}  {}",
                s.rank,
                format!("{}({}){}", s.kind, peer_text(s.peer), ""),
                s.at_ms,
                s.later_ms,
                s.drop_ms,
                head(&s.message, 72)
            );
        }
    }
    println!(
        "  (t_err: from the barrier before the stream; the fault comes ~30 ms after it; timeout \
         {FAULT_TIMEOUT_MS} ms)"
    );
}

fn test_abort_across_processes() {
    for transport in link_transports() {
        let port = free_port();
        let s = secret(77);
        let start = Instant::now();
        let mut ps: Vec<Proc> = (0..2)
            .map(|r| {
                let mut vars = job_vars(r, 2, port, &s, 60_000);
                vars.push(("BRAID_TRANSPORT".into(), transport.into()));
                Proc::spawn(r, &["abort"], &vars)
            })
            .collect();
        let mut all: Vec<&mut Proc> = ps.iter_mut().collect();
        wait_all(&mut all, start + Duration::from_secs(30), "abort");
        for p in &ps {
            assert!(
                p.status.unwrap().success(),
                "over {transport}: {}",
                p.show()
            );
        }
        let r0 = ps[0]
            .stdout
            .lines()
            .find(|l| l.starts_with("abort "))
            .unwrap();
        let r1 = ps[1]
            .stdout
            .lines()
            .find(|l| l.starts_with("peer "))
            .unwrap();
        println!(
            "  {transport}: rank 0: {} after abort() in {} ms: {}",
            field(r0, "kind").unwrap(),
            field(r0, "after_ms").unwrap(),
            head(r0.split_once(" | ").unwrap().1, 60)
        );
        println!(
            "  {transport}: rank 1: {}({}) in {} ms (timeout 60000 ms): {}",
            field(r1, "kind").unwrap(),
            field(r1, "peer").unwrap(),
            field(r1, "ms").unwrap(),
            head(r1.split_once(" | ").unwrap().1, 60)
        );
    }
}

fn test_destroy_never_hangs() {
    let cases = link_transports()
        .into_iter()
        .flat_map(|t| [(t, "kill"), (t, "stop")]);
    for (transport, mode) in cases {
        let port = free_port();
        let s = secret(99);
        let start = Instant::now();
        let mut ps: Vec<Proc> = (0..2)
            .map(|r| {
                let mut vars = job_vars(r, 2, port, &s, FAULT_TIMEOUT_MS);
                vars.push(("BRAID_TRANSPORT".into(), transport.into()));
                Proc::spawn(r, &["destroy", mode], &vars)
            })
            .collect();
        let deadline = start + Duration::from_millis(2 * FAULT_TIMEOUT_MS) + SLACK;
        wait_all(&mut [&mut ps[0]], deadline, "destroy");
        if mode == "stop" {
            ps[1].kill();
        }
        wait_all(&mut [&mut ps[1]], Instant::now() + SLACK, "destroy");
        assert!(ps[0].status.unwrap().success(), "{}", ps[0].show());
        assert_eq!(ps[1].status.unwrap().signal(), Some(9), "{}", ps[1].show());
        let line = ps[0]
            .stdout
            .lines()
            .find(|l| l.starts_with("drop_ms="))
            .unwrap();
        println!(
            "  {transport}: peer {}: {line} (limit {} ms)",
            if mode == "stop" { "stopped" } else { "killed" },
            2 * FAULT_TIMEOUT_MS
        );
    }
}

fn test_soak() {
    let ops: usize = std::env::var("SOAK_OPS").map_or(3000, |v| v.parse().expect("SOAK_OPS"));
    // Over a network a third as many: each op costs more, and the point is the mix, not the count.
    let cases = link_transports()
        .into_iter()
        .map(|t| (t, if t == "shm" { ops } else { ops.div_ceil(3) }));
    for (transport, ops) in cases {
        let start = Instant::now();
        let ops = ops.to_string();
        let o = braid_run(
            4,
            &["soak"],
            &[
                ("BRAID_TIMEOUT_MS", "5000"),
                ("SOAK_OPS", &ops),
                ("BRAID_TRANSPORT", transport),
            ],
        );
        let out = String::from_utf8_lossy(&o.stdout);
        PIDS.lock().unwrap().extend(
            out.lines()
                .filter_map(|l| l.strip_prefix("pid=")?.parse::<u32>().ok()),
        );
        assert!(
            o.status.success(),
            "soak over {transport} failed:\n{}",
            show(&o)
        );
        let oks: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("soak rank "))
            .collect();
        assert_eq!(oks.len(), 4, "{}", show(&o));
        for l in oks {
            println!("  {l}");
        }
        println!(
            "  soak of {ops} ops on 4 ranks over {transport}: {:.1} s",
            start.elapsed().as_secs_f64()
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("BRAID_RANK").is_some() || std::env::var_os("RANK").is_some() {
        std::process::exit(rank_main(&args[0], &args[1..]));
    }
    let args = common::arguments();
    let before = braid_segments();
    let tests = vec![
        case(
            "a rank killed, terminated, exiting or stopped mid-collective",
            test_fault_matrix,
        ),
        case(
            "abort from another thread, across processes",
            test_abort_across_processes,
        ),
        case(
            "dropping a communicator never hangs",
            test_destroy_never_hangs,
        ),
        case("soak of random collectives", test_soak),
        // Segments of other runs on this host (made and unlinked while we ran) are not ours to judge.
        no_segments_left(
            "/dev/shm holds no braid segments of these runs afterwards",
            before,
            |(_, pid)| PIDS.lock().unwrap().contains(pid),
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}
