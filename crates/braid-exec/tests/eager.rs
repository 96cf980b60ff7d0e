//! The eager path (a small all-reduce of one message per peer, run in one straight pass by
//! `Executor::run_op`) against the resumable walk of the same plan: the same bytes for every dtype,
//! reduction, rank count and size it takes, in and out of place, and the same failures.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_core::{DType, Error, ReduceOp};
use braid_exec::{CpuEngine, Executor, Op, Settings};
use braid_sched::{Algo, Collective};
use braid_transport::mem::MemNet;
use braid_transport::{send_bytes, Link, Span, WaitCtx};

const SLOT: usize = 4096;

fn exec(net: &MemNet, rank: usize, world: usize, timeout: Duration) -> Executor<CpuEngine> {
    let link: Box<dyn Link> = Box::new(net.link(rank));
    Executor::new(
        rank,
        world,
        Settings {
            timeout,
            debug_checks: false,
            rings: 1,
        },
        Some(link),
        Box::new(CpuEngine::new()),
        Arc::new(AtomicBool::new(false)),
    )
}

fn op(dtype: DType, redop: ReduceOp, count: usize, send: Span, recv: Span) -> Op {
    Op {
        collective: Collective::AllReduce,
        root: 0,
        dtype,
        redop,
        count,
        send,
        recv,
    }
}

/// Bytes that are a valid, varied input of `dtype` (small values, so products stay finite).
fn input(dtype: DType, count: usize, rank: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ rank as u64;
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let v = ((x >> 33) % 7) as f64 - 3.0 + rank as f64 * 0.5;
        let bytes: Vec<u8> = match dtype {
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
            DType::F64 => v.to_le_bytes().to_vec(),
            DType::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
            _ => {
                let w = (x >> 40) as i64 % 5 - 2 + rank as i64;
                w.to_le_bytes()[..dtype.size()].to_vec()
            }
        };
        out.extend_from_slice(&bytes);
    }
    out
}

/// Runs one all-reduce on every rank (a thread each), eager or through the walk, in place or not;
/// the outputs (or the errors).
fn all_reduce(
    world: usize,
    dtype: DType,
    redop: ReduceOp,
    count: usize,
    in_place: bool,
    eager: bool,
    seed: u64,
) -> Vec<Result<Vec<u8>, Error>> {
    let net = MemNet::new(world, 1, 2, SLOT);
    let timeout = Duration::from_secs(20);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let net = &net;
                s.spawn(move || {
                    let mut ex = exec(net, r, world, timeout);
                    let ins = input(dtype, count, r, seed);
                    let mut out = if in_place {
                        ins.clone()
                    } else {
                        vec![0u8; ins.len()]
                    };
                    // SAFETY: `ins` and `out` outlive the call and nothing else touches them meanwhile.
                    let (send, recv) = unsafe {
                        let recv = Span::host(out.as_mut_ptr(), out.len());
                        let send = if in_place {
                            recv
                        } else {
                            Span::host(ins.as_ptr() as *mut u8, ins.len())
                        };
                        (send, recv)
                    };
                    let o = op(dtype, redop, count, send, recv);
                    assert!(ex.runs_eager(&o, Algo::Direct));
                    let now = Instant::now();
                    let r = if eager {
                        ex.run_op(o, Algo::Direct, 0, 3, now, || {})
                    } else {
                        ex.start(o, Algo::Direct, 0, 3, now)
                            .and_then(|mut run| ex.run_blocking(&mut run))
                    };
                    r.map(|()| out)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn the_eager_path_is_the_walk_to_the_bit() {
    let mut cases = 0;
    for world in [2, 3, 5] {
        for dtype in DType::ALL {
            for redop in ReduceOp::ARITHMETIC {
                // One message per peer (the schedule cuts at a slot of accumulator elements) of
                // fewer than 4096 bytes (from there the walk may send from the caller's buffer).
                let max = (SLOT / dtype.accumulator().size()).min(4095 / dtype.size());
                for count in [1, 3, 17, max] {
                    for in_place in [false, true] {
                        let seed = (world * 1000 + count) as u64;
                        let eager = all_reduce(world, dtype, redop, count, in_place, true, seed);
                        let walk = all_reduce(world, dtype, redop, count, in_place, false, seed);
                        for (r, (e, w)) in eager.iter().zip(&walk).enumerate() {
                            let (e, w) = (e.as_ref().unwrap(), w.as_ref().unwrap());
                            assert_eq!(
                                e, w,
                                "{world} ranks, {dtype} {redop:?} × {count}, in place {in_place}, rank {r}"
                            );
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(
        cases,
        3 * DType::ALL.len() * ReduceOp::ARITHMETIC.len() * 4 * 2
    );
}

#[test]
fn only_small_direct_all_reduces_without_checks_take_it() {
    let net = MemNet::new(2, 1, 2, 1 << 16);
    let mut ex = exec(&net, 0, 2, Duration::from_secs(1));
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: the spans are only inspected, never run.
    let s = unsafe { Span::host(buf.as_mut_ptr(), buf.len()) };
    let small = op(
        DType::F32,
        ReduceOp::Sum,
        1023,
        s.prefix(4092).unwrap(),
        s.prefix(4092).unwrap(),
    );
    assert!(ex.runs_eager(&small, Algo::Direct));
    // A message of 4096 bytes or more (which the walk may send from the caller's buffer), two
    // messages per peer, or another schedule: the walk.
    let large = op(
        DType::F32,
        ReduceOp::Sum,
        1024,
        s.prefix(4096).unwrap(),
        s.prefix(4096).unwrap(),
    );
    assert!(!ex.runs_eager(&large, Algo::Direct));
    let cut = MemNet::new(2, 1, 2, 256);
    let mut in_two = exec(&cut, 0, 2, Duration::from_secs(1));
    let s400 = s.prefix(400).unwrap();
    assert!(!in_two.runs_eager(
        &op(DType::F32, ReduceOp::Sum, 100, s400, s400),
        Algo::Direct
    ));
    for algo in [Algo::Ring, Algo::Tree, Algo::Rhd] {
        assert!(!ex.runs_eager(&small, algo), "{algo:?}");
    }
    // With fingerprints exchanged first.
    let link: Box<dyn Link> = Box::new(net.link(1));
    let mut checked: Executor<CpuEngine> = Executor::new(
        1,
        2,
        Settings {
            timeout: Duration::from_secs(1),
            debug_checks: true,
            rings: 1,
        },
        Some(link),
        Box::new(CpuEngine::new()),
        Arc::new(AtomicBool::new(false)),
    );
    assert!(!checked.runs_eager(&small, Algo::Direct));
}

/// Runs an eager f32 sum on both ranks of `net`, rank `r` with the (count, sequence number)
/// `shape(r)`; each rank's error.
fn failing_pair(net: &MemNet, shape: impl Fn(usize) -> (usize, u64) + Sync) -> Vec<Error> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let shape = &shape;
                s.spawn(move || {
                    let (count, seq) = shape(r);
                    let mut ex = exec(net, r, 2, Duration::from_secs(10));
                    let mut buf = vec![1u8; 4 * count];
                    // SAFETY: `buf` outlives the call.
                    let sp = unsafe { Span::host(buf.as_mut_ptr(), buf.len()) };
                    let o = op(DType::F32, ReduceOp::Sum, count, sp, sp);
                    ex.run_op(o, Algo::Direct, 0, seq, Instant::now(), || {})
                        .unwrap_err()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank 0 of `world` runs an eager 8-byte all-reduce that its peers never join; its error.
fn rank0_alone(net: &MemNet, world: usize, timeout: Duration) -> Error {
    let mut ex = exec(net, 0, world, timeout);
    let mut buf = vec![0u8; 8];
    // SAFETY: `buf` outlives the call.
    let sp = unsafe { Span::host(buf.as_mut_ptr(), 8) };
    let o = op(DType::F32, ReduceOp::Sum, 2, sp, sp);
    ex.run_op(o, Algo::Direct, 0, 0, Instant::now(), || {})
        .unwrap_err()
}

#[test]
fn eager_failures_name_what_went_wrong_and_leave_the_rings_whole() {
    // Ranks that disagree on the collective's number: a mismatch on each side.
    let net = MemNet::new(2, 1, 2, SLOT);
    let errs = failing_pair(&net, |r| (2, 10 + r as u64));
    for (r, e) in errs.iter().enumerate() {
        assert!(
            matches!(e, Error::Mismatch { rank, peer, .. } if *rank == r && *peer == 1 - r),
            "{e}"
        );
        assert!(e.to_string().contains("belongs to collective"), "{e}");
    }
    // Every message was read (and released) although both failed.
    assert_eq!(net.traffic().unread, 0);

    // Counts that differ: a length mismatch.
    let net = MemNet::new(2, 1, 2, SLOT);
    let errs = failing_pair(&net, |r| (2 + r, 1));
    for e in &errs {
        assert!(e.to_string().contains("bytes where"), "{e}");
    }

    // A peer that never comes: a timeout naming it; a killed one: it failed.
    let net = MemNet::new(3, 1, 2, SLOT);
    let e = rank0_alone(&net, 3, Duration::from_millis(200));
    assert!(
        matches!(
            e,
            Error::Timeout {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{e}"
    );
    let net = MemNet::new(2, 1, 2, SLOT);
    net.kill(1);
    let e = rank0_alone(&net, 2, Duration::from_secs(10));
    assert!(
        matches!(
            e,
            Error::PeerFailed {
                rank: 0,
                peer: 1,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn with_several_faults_the_eager_path_reports_what_the_walk_reports() {
    // Rank 1 sends the wrong length, rank 2 another collective's message: the walk takes every
    // message (checking tags) before any length, so rank 2's tag is what both paths report.
    let mut errors = Vec::new();
    for eager in [true, false] {
        let net = MemNet::new(3, 1, 2, SLOT);
        let abort = AtomicBool::new(false);
        let now = Instant::now();
        let ctx = WaitCtx {
            rank: 1,
            collective: "test",
            seq: 5,
            deadline: now + Duration::from_secs(10),
            started: now,
            abort: &abort,
        };
        send_bytes(&net.link(1), 0, 0, &[0u8; 12], 5, &ctx).unwrap();
        send_bytes(&net.link(2), 0, 0, &[0u8; 8], 6, &ctx).unwrap();
        let mut ex = exec(&net, 0, 3, Duration::from_secs(10));
        let mut buf = vec![0u8; 8];
        // SAFETY: `buf` outlives the call.
        let sp = unsafe { Span::host(buf.as_mut_ptr(), 8) };
        let o = op(DType::F32, ReduceOp::Sum, 2, sp, sp);
        assert!(ex.runs_eager(&o, Algo::Direct));
        let e = if eager {
            ex.run_op(o, Algo::Direct, 0, 5, now, || {}).unwrap_err()
        } else {
            ex.start(o, Algo::Direct, 0, 5, now)
                .and_then(|mut run| ex.run_blocking(&mut run))
                .unwrap_err()
        };
        assert!(
            matches!(
                &e,
                Error::Mismatch {
                    rank: 0,
                    peer: 2,
                    ..
                }
            ),
            "eager {eager}: {e}"
        );
        errors.push(e.to_string());
    }
    assert_eq!(errors[0], errors[1]);
}
