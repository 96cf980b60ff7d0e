//! Communicators whose ranks are threads of one process (shared memory works the same between threads):
//! argument checks, async ops, abort, timeouts, mismatches and the bootstrap's defences.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid::{Communicator, Config, DType, Error, ReduceOp, UniqueId};

use braid_testkit::ranks::{config, with_ranks};

#[test]
fn invalid_arguments_change_nothing_and_leave_the_communicator_usable() {
    with_ranks(2, config(20_000), |c| {
        let send = vec![1.0f32; 8];
        let mut recv = vec![7.0f32; 9];
        let e = c.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap_err();
        assert!(
            e.is_invalid_argument() && e.to_string().contains("send buffer has 32 bytes"),
            "{e}"
        );
        assert!(
            recv.iter().all(|v| *v == 7.0),
            "a rejected call wrote its output"
        );
        let e = c.broadcast_in_place(&mut recv, 2).unwrap_err();
        assert!(e.to_string().contains("root 2 is out of range"), "{e}");
        let e = c.reduce(&send, &mut recv, ReduceOp::Sum, 5).unwrap_err();
        assert!(e.to_string().contains("root 5"), "{e}");
        let mut odd = vec![0u8; 7];
        let e = c
            .all_reduce_bytes_in_place(&mut odd, DType::F32, ReduceOp::Sum)
            .unwrap_err();
        assert!(e.to_string().contains("not a whole number of float"), "{e}");
        let e = c
            .reduce_scatter(&send, &mut recv[..3], ReduceOp::Sum)
            .unwrap_err();
        assert!(e.to_string().contains("world × 3"), "{e}");
        let e = c.all_gather(&send, &mut recv).unwrap_err();
        assert!(e.to_string().contains("world × 8"), "{e}");
        let e = c
            .reduce_scatter_in_place(&mut recv, ReduceOp::Sum)
            .unwrap_err();
        assert!(e.to_string().contains("do not split"), "{e}");
        assert!(c.async_error().is_none());
        // Still usable, and sequence numbers did not move on any rank.
        let mut x = vec![c.rank() as f32 + 1.0; 5];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, vec![3.0; 5]);
    });
}

#[test]
fn init_rejects_bad_ranks() {
    let id = UniqueId::new().unwrap();
    let e = Communicator::init(2, 2, &id, Config::default())
        .err()
        .unwrap();
    assert!(e.to_string().contains("rank 2 is out of range"), "{e}");
    let e = Communicator::init(0, 0, &id, Config::default())
        .err()
        .unwrap();
    assert!(e.is_invalid_argument());
}

#[test]
fn async_ops_run_in_order_with_blocking_ones() {
    let results = with_ranks(3, config(20_000), |c| {
        let r = c.rank() as i64;
        let w1 = c.all_reduce_async(vec![r; 1000], ReduceOp::Sum);
        let w2 = c.all_gather_async(vec![r * 10; 3]);
        let w3 = c.broadcast_async(vec![r + 100; 70_000], 1).unwrap();
        let mut x = [r];
        c.all_reduce_in_place(&mut x, ReduceOp::Max).unwrap();
        let b = c.barrier_async();
        let a = w1.wait().unwrap();
        let g = w2.wait().unwrap();
        let bc = w3.wait().unwrap();
        b.wait().unwrap();
        (a, g, bc, x[0])
    });
    for (a, g, bc, m) in results {
        assert!(a.iter().all(|v| *v == 3));
        assert_eq!(g, vec![0, 0, 0, 10, 10, 10, 20, 20, 20]);
        assert!(bc.iter().all(|v| *v == 101));
        assert_eq!(m, 2);
    }
}

#[test]
fn a_completion_callback_may_issue_and_wait_for_another_collective() {
    let results = with_ranks(2, config(10_000), |c| {
        let c = Arc::new(c);
        let inner = c.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        // Rank 1 joins late, so rank 0's first all-reduce completes on its progress thread.
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        let first = c.all_reduce_async(vec![1u32; 10], ReduceOp::Sum);
        first.on_complete(move |r| {
            let on = std::thread::current().name().unwrap_or("").to_string();
            let second = r
                .clone()
                .and_then(|()| inner.all_reduce_async(vec![2u32; 10], ReduceOp::Sum).wait());
            let _ = tx.send((on, second));
        });
        let (on, second) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the callback ran");
        (c.rank(), on, second, first.wait())
    });
    for (rank, on, second, first) in results {
        assert_eq!(first.unwrap(), vec![2u32; 10], "rank {rank}");
        assert_eq!(
            second.unwrap(),
            vec![4u32; 10],
            "rank {rank}: the collective waited for in a callback (on thread {on:?})"
        );
        if rank == 0 {
            assert!(
                on.starts_with("braid-progress"),
                "rank 0's callback ran on {on:?}, not the progress thread: the test shows nothing"
            );
        }
    }
}

#[test]
fn work_test_reports_completion() {
    with_ranks(2, config(20_000), |c| {
        let w = c.all_reduce_async(vec![1u32; 10], ReduceOp::Sum);
        let start = Instant::now();
        while !w.test() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "async op never completed"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(w.wait().unwrap(), vec![2u32; 10]);
    });
}

#[test]
fn a_silent_peer_times_out_naming_it_and_the_error_sticks() {
    let out = with_ranks(2, config(300), |c| {
        if c.rank() == 1 {
            // Never joins the collective; waits until rank 0 has given up.
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let mut x = vec![1.0f64; 100];
        let e = c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap_err();
        let later = c.barrier().unwrap_err();
        Some((e, later, c.async_error()))
    });
    let (e, later, sticky) = out[0].clone().unwrap();
    assert!(
        matches!(&e, Error::Timeout { rank: 0, peer: 1, seq: 0, collective, .. } if collective == "all_reduce"),
        "{e}"
    );
    assert!(matches!(later, Error::Poisoned { .. }), "{later}");
    assert_eq!(sticky, Some(e));
}

#[test]
fn abort_from_another_thread_unblocks_a_collective() {
    let out = with_ranks(2, config(60_000), |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1000));
            // By now rank 0 aborted: this rank learns it from the shared segment, not from a timeout.
            let mut x = vec![0u8; 1 << 20];
            let start = Instant::now();
            let e = c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap_err();
            return (e, start.elapsed());
        }
        let c = Arc::new(c);
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            c2.abort();
        });
        let start = Instant::now();
        let mut x = vec![0u8; 1 << 20];
        let e = c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap_err();
        t.join().unwrap();
        (e, start.elapsed())
    });
    assert!(
        matches!(out[0].0, Error::Aborted { rank: 0, .. }),
        "{}",
        out[0].0
    );
    assert!(
        out[0].1 < Duration::from_secs(20),
        "abort took {:?}",
        out[0].1
    );
    assert!(
        matches!(out[1].0, Error::PeerFailed { peer: 0, .. }),
        "{}",
        out[1].0
    );
    assert!(
        out[1].1 < Duration::from_secs(20),
        "peer failure noticed after {:?}",
        out[1].1
    );
}

#[test]
fn mismatched_counts_are_an_error_not_a_hang() {
    let out = with_ranks(2, config(3_000), |c| {
        let mut x = vec![1.0f32; if c.rank() == 0 { 100 } else { 200 }];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum).err()
    });
    let errs: Vec<String> = out.iter().flatten().map(|e| e.to_string()).collect();
    assert!(!errs.is_empty(), "a mismatch went unnoticed");
    assert!(
        out.iter()
            .flatten()
            .any(|e| matches!(e, Error::Mismatch { .. } | Error::PeerFailed { .. })),
        "{errs:?}"
    );
}

#[test]
fn bootstrap_refuses_wrong_secrets_and_garbage_but_still_forms() {
    let id = UniqueId::new().unwrap();
    let addr = id.addr();
    let rank = |r: usize, id: UniqueId| {
        std::thread::spawn(move || {
            let c = Communicator::init(2, r, &id, config(20_000)).unwrap();
            let mut x = [1i32];
            c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
            x[0]
        })
    };
    // Rank 0 is waiting for rank 1 when the strays arrive: a wrong secret, garbage, silent sockets.
    let r0 = rank(0, id.clone());
    let wrong: UniqueId = format!("{addr}/{}", "ab".repeat(16)).parse().unwrap();
    let e = Communicator::init(2, 1, &wrong, config(10_000))
        .err()
        .unwrap();
    assert!(e.to_string().contains("wrong secret"), "{e}");
    // A flood: 40 connections that send garbage, and 40 that say nothing and stay open.
    let mut strays = Vec::new();
    for i in 0..40u8 {
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage.write_all(&[i; 64]).unwrap();
        strays.push(garbage);
        strays.push(TcpStream::connect(addr).unwrap());
    }
    let r1 = rank(1, id);
    assert_eq!(r0.join().unwrap(), 2);
    assert_eq!(r1.join().unwrap(), 2);
}

#[test]
fn bootstrap_times_out_naming_missing_ranks() {
    let id = UniqueId::new().unwrap();
    let e = Communicator::init(3, 0, &id, config(300)).err().unwrap();
    assert!(e.to_string().contains("ranks [1, 2]"), "{e}");
}

#[test]
fn world_of_one_copies() {
    with_ranks(1, config(1000), |c| {
        let send = [1.5f32, 2.5];
        let mut recv = [0f32; 2];
        c.all_reduce(&send, &mut recv, ReduceOp::Avg).unwrap();
        assert_eq!(recv, send);
        c.all_gather(&send, &mut recv).unwrap();
        assert_eq!(recv, send);
        c.barrier().unwrap();
    });
}

#[test]
fn debug_checks_show_both_fingerprints_of_a_mismatch() {
    let cfg = Config {
        debug_checks: true,
        ..config(10_000)
    };
    let out = with_ranks(2, cfg, |c| {
        // Agreeing calls pass the check.
        let mut x = vec![1.0f32; 10];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, vec![2.0; 10]);
        // Then rank 0 reduces 100 floats while rank 1 broadcasts 100 from rank 1.
        let mut y = vec![1.0f32; 100];
        if c.rank() == 0 {
            c.all_reduce_in_place(&mut y, ReduceOp::Sum).unwrap_err()
        } else {
            c.broadcast_in_place(&mut y, 1).unwrap_err()
        }
    });
    for (r, e) in out.iter().enumerate() {
        let text = e.to_string();
        assert!(
            matches!(e, Error::Mismatch { seq: 1, .. }),
            "rank {r}: {text}"
        );
        assert!(
            text.contains("all_reduce #1 count 100 float sum")
                && text.contains("broadcast #1 count 100 float root 1"),
            "rank {r}: {text}"
        );
    }
}

#[test]
fn the_flight_recorder_shows_what_ran_and_what_failed() {
    let out = with_ranks(2, config(300), |c| {
        let mut x = vec![0u64; 1000];
        c.all_reduce_in_place(&mut x, ReduceOp::Max).unwrap();
        c.barrier().unwrap();
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1200));
            return Vec::new();
        }
        let _ = c.all_gather_in_place(&mut x);
        c.flight_record()
    });
    let rec = &out[0];
    assert_eq!(rec.len(), 3, "{rec:?}");
    assert_eq!(
        (rec[0].op, rec[0].count, rec[0].dtype),
        ("all_reduce", 1000, "uint64")
    );
    assert_eq!(rec[1].op, "barrier");
    assert_eq!(rec[1].state, braid::recorder::State::Done);
    assert_eq!(rec[2].op, "all_gather");
    assert!(
        matches!(&rec[2].state, braid::recorder::State::Failed(e) if e.contains("timed out")),
        "{:?}",
        rec[2]
    );
}

#[test]
fn an_argument_error_only_the_root_sees_fails_every_rank_never_a_wrong_result() {
    // The root passes a receive buffer of the wrong size; the other rank, which cannot check it, is
    // already in the reduce. Its message must not be paired with the root's next collective.
    let start = Instant::now();
    let results = with_ranks(2, config(20_000), |c| {
        let send = vec![c.rank() as f32 + 1.0; 4];
        let first = if c.rank() == 0 {
            let mut short = vec![0.0f32; 3];
            c.reduce(&send, &mut short, ReduceOp::Sum, 0)
        } else {
            c.reduce(&send, &mut [], ReduceOp::Sum, 0)
        };
        // The next collective, of the size of the reduce: the root must not take the other rank's
        // reduce message for its all-reduce partner's.
        let mut x = vec![10.0f32; 4];
        let next = c.all_reduce_in_place(&mut x, ReduceOp::Sum).map(|()| x);
        (c.rank(), first, next)
    });
    for (rank, first, next) in results {
        if rank == 0 {
            let e = first.unwrap_err();
            assert!(
                e.is_invalid_argument() && e.to_string().contains("receive buffer"),
                "{e}"
            );
            let e = next.expect_err("the root's next collective succeeded after a one-sided error");
            assert!(matches!(e, Error::Poisoned { .. }), "{e}");
        } else {
            // Its reduce may have completed (a non-root only sends); what follows fails, naming rank 0.
            let e = next.expect_err("the other rank's next collective succeeded");
            assert!(e.to_string().contains("rank 0"), "{e} (reduce: {first:?})");
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn two_threads_calling_one_communicator_at_once_is_an_error_on_every_rank() {
    let results = with_ranks(2, config(20_000), |c| {
        let mut second = None;
        if c.rank() == 1 {
            // Late, so that rank 0's first call is still waiting when its second thread calls.
            std::thread::sleep(Duration::from_millis(300));
            let mut x = vec![1.0f32; 4];
            // It pairs with rank 0's first call, which is well formed: either result is right.
            let _ = c.all_reduce_in_place(&mut x, ReduceOp::Sum);
        } else {
            std::thread::scope(|s| {
                let first = s.spawn(|| {
                    let mut x = vec![1.0f32; 4];
                    let _ = c.all_reduce_in_place(&mut x, ReduceOp::Sum);
                });
                std::thread::sleep(Duration::from_millis(100));
                let mut y = vec![2.0f32; 4];
                second = Some(c.all_reduce_in_place(&mut y, ReduceOp::Sum));
                first.join().unwrap();
            });
        }
        // Whatever comes next fails on every rank, naming the rank that was used wrongly.
        let mut z = vec![3.0f32; 4];
        (second, c.all_reduce_in_place(&mut z, ReduceOp::Sum).err())
    });
    let e = results[0].0.as_ref().unwrap().as_ref().unwrap_err();
    assert!(
        e.is_invalid_argument() && e.to_string().contains("one thread at a time"),
        "{e}"
    );
    for (rank, (_, next)) in results.iter().enumerate() {
        let e = next
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank}'s next call succeeded"));
        assert!(e.to_string().contains("rank 0"), "rank {rank}: {e}");
    }
}

#[test]
fn an_unwritable_topology_dump_fails_init_on_every_rank() {
    let cfg = Config {
        topo_dump_file: Some("/nonexistent-braid-dir/topo.json".into()),
        ..config(20_000)
    };
    let id = UniqueId::new().unwrap();
    let start = Instant::now();
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let (id, cfg) = (id.clone(), cfg.clone());
            std::thread::spawn(move || Communicator::init(2, r, &id, cfg).err())
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let e = h
            .join()
            .unwrap()
            .unwrap_or_else(|| panic!("rank {r}'s init succeeded"));
        assert!(
            e.to_string().contains("BRAID_TOPO_DUMP_FILE"),
            "rank {r}: {e}"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}
