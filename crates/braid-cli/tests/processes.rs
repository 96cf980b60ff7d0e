//! Real processes over real shared memory. This file is its own test harness: run without `BRAID_RANK`
//! it launches copies of itself as ranks (through `braid run`, or directly where the launcher would get
//! in the way) and checks how they end; run with `BRAID_RANK` it is a rank and plays the scenario named
//! by its first argument.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use braid::{Communicator, DType, Error, Priority, ReduceOp};
use braid_core::exact::{inputs, reduced};
use common::scenarios::{assert_identical, scenario_algorithms};
use common::{
    braid, braid_run, braid_segments, case, case_needing, free_port, me, no_segments_left, show,
};

// ---------------------------------------------------------------------------------------------------
// Rank side.

fn unaligned(len: usize) -> (Vec<u8>, usize) {
    (vec![0u8; len + 1], 1)
}

fn scenario_matrix(c: &Communicator) -> usize {
    let (rank, world) = (c.rank(), c.world_size());
    let mut checks = 0;
    let mut counts = vec![0, 1, world.saturating_sub(1), 7919];
    counts.dedup();
    for dtype in DType::ALL {
        for op in ReduceOp::ARITHMETIC {
            let mut cs = counts.clone();
            if matches!(
                (dtype, op),
                (DType::F32, ReduceOp::Sum)
                    | (DType::BF16, ReduceOp::Avg)
                    | (DType::I32, ReduceOp::Max)
            ) {
                cs.push(1_000_003);
            }
            for &count in &cs {
                let bytes = count * dtype.size();
                let ins = inputs(bytes, dtype, op, world);
                let want = reduced(&ins, dtype, op);
                let what = format!("all_reduce {dtype} {op} count {count}");
                // Out of place, unaligned on both sides.
                let (mut sbuf, so) = unaligned(bytes);
                sbuf[so..].copy_from_slice(&ins[rank]);
                let (mut rbuf, ro) = unaligned(bytes);
                c.all_reduce_bytes(&sbuf[so..], &mut rbuf[ro..], dtype, op)
                    .unwrap();
                assert!(
                    rbuf[ro..] == want[..],
                    "{what}: wrong result (out of place)"
                );
                assert_eq!(sbuf[so..], ins[rank][..], "{what}: the send buffer changed");
                assert_identical(c, &rbuf[ro..], &what);
                // In place.
                let mut buf = ins[rank].clone();
                c.all_reduce_bytes_in_place(&mut buf, dtype, op).unwrap();
                assert!(buf == want, "{what}: wrong result (in place)");
                checks += 2;
            }
        }
    }
    for dtype in [DType::F32, DType::BF16, DType::I8, DType::F64] {
        let es = dtype.size();
        for rc in [0usize, 1, 7919] {
            let op = ReduceOp::Sum;
            let ins = inputs(world * rc * es, dtype, op, world);
            let want = reduced(&ins, dtype, op);
            let mine = &want[rank * rc * es..(rank + 1) * rc * es];
            let mut out = vec![0u8; rc * es];
            c.reduce_scatter_bytes(&ins[rank], &mut out, dtype, op)
                .unwrap();
            assert!(out == mine, "reduce_scatter {dtype} {rc}");
            // All-gather of each rank's block gives back the full reduction.
            let mut all = vec![0u8; world * rc * es];
            c.all_gather_bytes(&out, &mut all, dtype).unwrap();
            assert!(all == want, "all_gather {dtype} {rc}");
            for root in 0..world {
                let mut b = if rank == root {
                    ins[rank].clone()
                } else {
                    vec![0u8; ins[rank].len()]
                };
                let send = b.clone();
                c.broadcast_bytes(&send, &mut b, dtype, root).unwrap();
                assert!(b == ins[root], "broadcast {dtype} from {root}");
                let mut r = vec![0xAAu8; ins[rank].len()];
                c.reduce_bytes(&ins[rank], &mut r, dtype, op, root).unwrap();
                if rank == root {
                    assert!(r == want, "reduce {dtype} to {root}");
                } else {
                    assert!(
                        r.iter().all(|x| *x == 0xAA),
                        "reduce wrote a non-root buffer"
                    );
                }
                checks += 2;
            }
            checks += 2;
        }
    }
    // Typed in-place variants.
    let mut v: Vec<f32> = (0..world * 5).map(|i| (i + rank) as f32).collect();
    c.reduce_scatter_in_place(&mut v, ReduceOp::Sum).unwrap();
    for (j, x) in v[rank * 5..(rank + 1) * 5].iter().enumerate() {
        let i = rank * 5 + j;
        let want: f32 = (0..world).map(|r| (i + r) as f32).sum();
        assert_eq!(*x, want, "reduce_scatter_in_place");
    }
    let mut g: Vec<u16> = vec![0; world * 3];
    g[rank * 3..(rank + 1) * 3].fill(rank as u16 + 1);
    let mut g32: Vec<u32> = g.iter().map(|x| *x as u32).collect();
    c.all_gather_in_place(&mut g32).unwrap();
    assert!(
        g32.chunks(3)
            .enumerate()
            .all(|(r, b)| b.iter().all(|x| *x == r as u32 + 1)),
        "all_gather_in_place"
    );
    // Arbitrary floats: the order of additions matters, the bits must still agree everywhere.
    let mut x: Vec<f32> = (0..100_003u64)
        .map(|i| (((i * 2654435761 + rank as u64 * 97) % 100_000) as f32 / 7.3) - 5000.0)
        .collect();
    c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    assert_identical(c, bytemuck::cast_slice(&x), "random f32 sum");
    c.barrier().unwrap();
    checks + 3
}

/// Two streams: a 64 MiB all-reduce on a low-priority stream, then small ones on a high-priority
/// stream; the small ones complete first, in issue order, and every result is exact. Then events
/// between streams, borrowed buffers in a scope, and raw (zero-copy) async calls.
fn scenario_streams(c: &Communicator) -> usize {
    let (rank, world) = (c.rank(), c.world_size());
    assert!(c.streams() >= 2, "BRAID_STREAMS must give two streams");
    c.set_stream_priority(1, Priority::Low).unwrap();
    c.set_stream_priority(0, Priority::High).unwrap();
    assert_eq!(c.stream_priority(1).unwrap(), Priority::Low);
    // Callbacks run on the thread that completes the work, after `wait` can return: they report
    // through a channel, and the test reads it with a deadline.
    let (tx, rx) = std::sync::mpsc::channel::<Result<String, String>>();
    let note = |label: String| {
        let tx = tx.clone();
        move |r: &Result<(), Error>| {
            let _ = tx.send(match r {
                Ok(()) => Ok(label),
                Err(e) => Err(format!("{label}: {e}")),
            });
        }
    };
    let big = vec![1.0f32 + rank as f32; 16 << 20];
    let big = c.all_reduce_async_on(1, big, ReduceOp::Sum).unwrap();
    big.on_complete(note("big".into()));
    const SMALL: usize = 12;
    let smalls: Vec<_> = (0..SMALL)
        .map(|i| {
            let w = c
                .all_reduce_async_on(0, vec![(rank * 100 + i) as u64; 3], ReduceOp::Sum)
                .unwrap();
            w.on_complete(note(format!("small{i}")));
            w
        })
        .collect();
    let w = world as u64;
    for (i, s) in smalls.into_iter().enumerate() {
        let got = s.wait().unwrap();
        let want = 100 * w * (w - 1) / 2 + w * i as u64;
        assert_eq!(got, vec![want; 3], "small all-reduce {i}");
    }
    let got = big.wait().unwrap();
    let want = world as f32 + (world * (world - 1) / 2) as f32;
    assert!(
        got.iter().all(|x| *x == want),
        "the 64 MiB all-reduce is wrong"
    );
    let order: Vec<String> = (0..=SMALL)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(30))
                .expect("a callback")
                .unwrap()
        })
        .collect();
    let expected: Vec<String> = (0..SMALL)
        .map(|i| format!("small{i}"))
        .chain(["big".to_string()])
        .collect();
    assert_eq!(
        order, expected,
        "rank {rank}: completion order (small ones first, in issue order)"
    );

    // An event: stream 1's next op starts only after stream 0's all-reduce is done.
    let first = c
        .all_reduce_async_on(0, vec![rank as u32 + 1; 1000], ReduceOp::Sum)
        .unwrap();
    let ev = c.record_event(0).unwrap();
    c.wait_event(1, &ev).unwrap();
    let second = c.barrier_async_on(1).unwrap();
    second.wait().unwrap();
    // The barrier on stream 1 completed, so the all-reduce before the event had.
    assert!(
        first.test(),
        "stream 1 did not wait for the event on stream 0"
    );
    let total = (world * (world + 1) / 2) as u32;
    assert_eq!(first.wait().unwrap(), vec![total; 1000]);

    // Borrowed buffers, no copies: complete when the scope ends.
    let send: Vec<f64> = (0..50_000).map(|i| (i % 13) as f64 + rank as f64).collect();
    let mut recv = vec![0.0f64; send.len()];
    let mut small = [rank as i64; 5];
    c.scope(|s| {
        let a = s.all_reduce(1, &send, &mut recv, ReduceOp::Sum).unwrap();
        let b = s.all_reduce_in_place(0, &mut small, ReduceOp::Max).unwrap();
        b.wait().unwrap();
        let _ = a; // completes when the scope ends
    });
    let ranks_sum = (world * (world - 1) / 2) as f64;
    for (i, v) in recv.iter().enumerate() {
        assert_eq!(
            *v,
            (i % 13) as f64 * world as f64 + ranks_sum,
            "scoped element {i}"
        );
    }
    assert_eq!(small, [world as i64 - 1; 5]);
    assert!(
        c.all_reduce_async_on(9, vec![0u8], ReduceOp::Sum).is_err(),
        "stream 9 exists?"
    );
    assert!(c.async_error().is_none());
    SMALL + 4
}

/// Before joining: rank 0 holds the bootstrap port from the launcher (`BRAID_ROOT_FD`, a listening
/// socket on that port, so nothing else can bind it), the other ranks hold no such socket.
fn check_root_port() -> Result<(), String> {
    let rank: usize = std::env::var("BRAID_RANK").unwrap().parse().unwrap();
    let root = std::env::var("BRAID_ROOT").unwrap();
    let fd = std::env::var("BRAID_ROOT_FD").ok();
    match (rank, fd) {
        (0, None) => Err("rank 0 was given no BRAID_ROOT_FD".into()),
        (0, Some(_)) => match std::net::TcpListener::bind(&root) {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Ok(()),
            Err(e) => Err(format!("binding {root} failed otherwise: {e}")),
            Ok(_) => Err(format!("{root} was free: the launcher did not hold it")),
        },
        (r, Some(fd)) => Err(format!("rank {r} was given BRAID_ROOT_FD={fd}")),
        (_, None) => Ok(()),
    }
}

fn rank_main(scenario: &str, args: &[String]) -> i32 {
    common::pretend_hosts_from_env();
    if scenario == "root-port" {
        if let Err(e) = check_root_port() {
            println!("FAIL {e}");
            return 1;
        }
    }
    let c = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("init failed: {e}");
            return 1;
        }
    };
    match scenario {
        "matrix" => {
            let n = scenario_matrix(&c);
            println!("rank {} ok: {n} checks", c.rank());
            0
        }
        "streams" => {
            let n = scenario_streams(&c);
            println!("rank {} ok: {n} checks", c.rank());
            0
        }
        "algorithms" => {
            let n = scenario_algorithms(&c);
            println!("rank {} ok: {n} checks", c.rank());
            0
        }
        "small" | "root-port" => {
            let mut x = [c.rank() as u64 + 1];
            c.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
            let w = c.world_size() as u64;
            assert_eq!(x[0], w * (w + 1) / 2);
            println!("rank {} ok", c.rank());
            0
        }
        "exit-rank" => {
            let (who, code): (usize, i32) = (args[0].parse().unwrap(), args[1].parse().unwrap());
            if c.rank() == who {
                return code;
            }
            let _ = c.barrier();
            std::thread::sleep(Duration::from_secs(120));
            0
        }
        "killed-rank" => {
            // Rank `victim` dies by SIGKILL in the middle of a stream of large all-reduces.
            let victim: usize = args[0].parse().unwrap();
            c.barrier().unwrap();
            if c.rank() == victim {
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(30));
                    // SAFETY: sending a signal to ourselves.
                    unsafe { libc_kill_self() };
                });
            }
            let start = Instant::now();
            let mut buf = vec![1.0f32; 4 << 20];
            loop {
                if let Err(e) = c.all_reduce_in_place(&mut buf, ReduceOp::Sum) {
                    println!("error after {} ms: {e}", start.elapsed().as_millis());
                    let ok = matches!(&e, Error::PeerFailed { collective, .. } | Error::Timeout { collective, .. } if collective == "all_reduce");
                    let later = c.barrier().unwrap_err();
                    println!("later: {later}");
                    return if ok && matches!(later, Error::Poisoned { .. }) {
                        0
                    } else {
                        1
                    };
                }
                buf.fill(1.0);
            }
        }
        other => {
            println!("unknown scenario {other}");
            2
        }
    }
}

/// SIGKILL to this process.
unsafe fn libc_kill_self() {
    extern "C" {
        fn kill(pid: i32, sig: i32) -> i32;
    }
    // SAFETY: plain syscall wrapper; 9 is SIGKILL.
    unsafe {
        kill(std::process::id() as i32, 9);
    }
}

// ---------------------------------------------------------------------------------------------------
// Harness side.

/// Starts `n` ranks directly (no launcher), with `vars(rank)` as their job environment.
fn spawn_ranks(
    n: usize,
    args: &[&str],
    vars: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<Output> {
    let children: Vec<_> = (0..n)
        .map(|r| {
            let mut cmd = Command::new(me());
            cmd.args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .env_remove("BRAID_RANK")
                .env_remove("BRAID_SECRET");
            for (k, v) in vars(r) {
                cmd.env(k, v);
            }
            cmd.spawn().unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

fn test_matrix() {
    for n in [1, 2, 3, 4, 5, 8] {
        let start = Instant::now();
        let o = braid_run(n, &["matrix"], &[("BRAID_TIMEOUT_MS", "60000")]);
        assert!(
            o.status.success(),
            "matrix on {n} ranks failed:\n{}",
            show(&o)
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(out.matches(" ok: ").count(), n, "{}", show(&o));
        println!(
            "  matrix on {n} ranks: ok ({:.1} s)",
            start.elapsed().as_secs_f64()
        );
    }
}

fn test_streams() {
    for transport in ["shm", "tcp"] {
        let o = braid_run(
            4,
            &["streams"],
            &[
                ("BRAID_TRANSPORT", transport),
                ("BRAID_TIMEOUT_MS", "60000"),
            ],
        );
        assert!(
            o.status.success(),
            "streams over {transport}:\n{}",
            show(&o)
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(out.matches(" ok: ").count(), 4, "{}", show(&o));
        println!("  streams on 4 ranks over {transport}: ok");
    }
}

fn test_algorithms() {
    for n in 2..=8 {
        let start = Instant::now();
        let o = braid_run(
            n,
            &["algorithms"],
            &[
                ("BRAID_TIMEOUT_MS", "60000"),
                ("BRAID_CHUNK_BYTES", "16384"),
            ],
        );
        assert!(
            o.status.success(),
            "algorithms on {n} ranks failed:\n{}",
            show(&o)
        );
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).matches(" ok: ").count(),
            n,
            "{}",
            show(&o)
        );
        println!(
            "  every algorithm on {n} ranks: ok ({:.1} s)",
            start.elapsed().as_secs_f64()
        );
    }
    // Rings split over channels running both ways.
    for n in [3, 4] {
        let env = [
            ("BRAID_TIMEOUT_MS", "60000"),
            ("BRAID_CHUNK_BYTES", "16384"),
            ("BRAID_CHANNELS", "3"),
        ];
        let o = braid_run(n, &["algorithms"], &env);
        assert!(
            o.status.success(),
            "algorithms on {n} ranks, 3 channels, failed:\n{}",
            show(&o)
        );
        println!("  every algorithm on {n} ranks with 3 channels: ok");
    }
}

/// Every algorithm over TCP alone, over several sockets per peer, and over shared memory inside
/// pretend hosts with TCP between them.
fn test_transports() {
    let cases: [(usize, &[(&str, &str)]); 5] = [
        (2, &[("BRAID_TRANSPORT", "tcp")]),
        (
            3,
            &[("BRAID_TRANSPORT", "tcp"), ("BRAID_SOCKETS_PER_PEER", "3")],
        ),
        (4, &[("TEST_RANKS_PER_HOST", "2")]),
        (
            5,
            &[
                ("TEST_RANKS_PER_HOST", "2"),
                ("BRAID_SOCKETS_PER_PEER", "2"),
            ],
        ),
        (6, &[("TEST_RANKS_PER_HOST", "3"), ("BRAID_CHANNELS", "2")]),
    ];
    for (n, extra) in cases {
        let start = Instant::now();
        let mut env = vec![
            ("BRAID_TIMEOUT_MS", "60000"),
            ("BRAID_CHUNK_BYTES", "16384"),
        ];
        env.extend_from_slice(extra);
        let o = braid_run(n, &["algorithms"], &env);
        assert!(
            o.status.success(),
            "algorithms on {n} ranks with {extra:?} failed:\n{}",
            show(&o)
        );
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).matches(" ok: ").count(),
            n,
            "{}",
            show(&o)
        );
        println!(
            "  every algorithm on {n} ranks with {extra:?}: ok ({:.1} s)",
            start.elapsed().as_secs_f64()
        );
    }
    // A rank that insists on shared memory cannot join ranks of another host, and says why.
    let o = braid_run(
        2,
        &["small"],
        &[
            ("TEST_RANKS_PER_HOST", "1"),
            ("BRAID_TRANSPORT", "shm"),
            ("BRAID_TIMEOUT_MS", "20000"),
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        !o.status.success() && out.contains("another host") && out.contains("BRAID_TRANSPORT=shm"),
        "{}",
        show(&o)
    );
    println!("  shm-only ranks on two hosts are refused with a reason: ok");
}

/// `braid topo` prints where the ranks are; the file it dumps is a topology file the runtime accepts,
/// and a broken one is an error that names the variable.
fn test_topo_command_and_files() {
    let file = std::env::temp_dir().join(format!("braid-topo-{}.json", std::process::id()));
    let run_topo = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(braid());
        cmd.args(["run", "-n", "3", "--"]).arg(braid()).arg("topo");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.env_remove("BRAID_RANK").output().unwrap()
    };
    let o = run_topo(&[("BRAID_TOPO_DUMP_FILE", file.to_str().unwrap())]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("3 ranks") && out.contains("self shm shm"),
        "{}",
        show(&o)
    );
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.contains("\"version\": 1") || text.contains("\"version\":1"),
        "{text}"
    );
    // Claim two hosts in a file: the runtime takes the grouping from it.
    let two = r#"{"version": 1, "hosts": [{"name": "a"}, {"name": "b"}],
        "ranks": [{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}, {"rank": 2, "host": "a"}]}"#;
    std::fs::write(&file, two).unwrap();
    let o = run_topo(&[("BRAID_TOPO_FILE", file.to_str().unwrap())]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("2 hosts"),
        "{}",
        show(&o)
    );
    std::fs::write(&file, "{\"version\": 1, \"hosts\": []}").unwrap();
    let o = run_topo(&[("BRAID_TOPO_FILE", file.to_str().unwrap())]);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !o.status.success() && all.contains("BRAID_TOPO_FILE"),
        "{}",
        show(&o)
    );
    std::fs::remove_file(&file).unwrap();
    println!("  braid topo, BRAID_TOPO_DUMP_FILE and BRAID_TOPO_FILE: ok");
}

/// `braid compress-bench` measures codecs and compressed all-reduce side by side; a bad codec is refused.
fn test_compress_bench() {
    let o = Command::new(braid())
        .args([
            "compress-bench",
            "--ranks",
            "2",
            "-s",
            "64K",
            "-n",
            "1",
            "--codecs",
            "topk:0.1,int8",
        ])
        .env_remove("BRAID_RANK")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", show(&o));
    for row in ["memcpy", "dense", "topk:0.1", "int8"] {
        assert!(out.contains(row), "no {row} in:\n{}", show(&o));
    }
    let o = Command::new(braid())
        .args(["compress-bench", "--codecs", "topk:7"])
        .env_remove("BRAID_RANK")
        .output()
        .unwrap();
    assert!(
        o.status.code() == Some(2) && String::from_utf8_lossy(&o.stderr).contains("topk:7"),
        "{}",
        show(&o)
    );
    println!("  braid compress-bench: ok");
}

fn test_launcher_stops_everyone_when_one_rank_fails() {
    let start = Instant::now();
    let o = braid_run(3, &["exit-rank", "1", "7"], &[]);
    assert!(!o.status.success(), "{}", show(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("rank 1 exited with code 7"), "{}", show(&o));
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "the launcher took {:?}",
        start.elapsed()
    );
}

fn test_launcher_holds_the_root_port() {
    let o = braid_run(3, &["root-port"], &[]);
    assert!(o.status.success(), "{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches(" ok").count(), 3, "{}", show(&o));
}

fn test_killed_rank() {
    let port = free_port();
    let timeout_ms = 20_000u64;
    let start = Instant::now();
    let outs = spawn_ranks(3, &["killed-rank", "2"], |r| {
        vec![
            ("BRAID_RANK".into(), r.to_string()),
            ("BRAID_WORLD_SIZE".into(), "3".into()),
            ("BRAID_ROOT".into(), format!("127.0.0.1:{port}")),
            (
                "BRAID_SECRET".into(),
                "0123456789abcdef0123456789abcdef".into(),
            ),
            ("BRAID_TIMEOUT_MS".into(), timeout_ms.to_string()),
        ]
    });
    let elapsed = start.elapsed();
    assert_eq!(
        outs[2].status.code(),
        None,
        "rank 2 should have been killed:\n{}",
        show(&outs[2])
    );
    for o in &outs[..2] {
        assert!(
            o.status.success(),
            "a survivor did not report the failure properly:\n{}",
            show(o)
        );
    }
    let all: String = outs[..2]
        .iter()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .collect();
    assert!(
        all.contains("rank 2"),
        "no survivor named the dead rank:\n{all}"
    );
    assert!(
        elapsed < Duration::from_millis(2 * timeout_ms),
        "survivors took {elapsed:?}"
    );
    println!(
        "  killed rank: survivors failed in {elapsed:?}: {}",
        all.lines().next().unwrap_or("")
    );
}

fn test_torchrun_variables() {
    // One host (a loopback root): the ranks agree on a secret from this user's host-local key.
    let port = free_port();
    let home = std::env::temp_dir().join(format!("braid-torchrun-home-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let outs = spawn_ranks(2, &["small"], |r| {
        vec![
            ("RANK".into(), r.to_string()),
            ("WORLD_SIZE".into(), "2".into()),
            ("MASTER_ADDR".into(), "127.0.0.1".into()),
            ("MASTER_PORT".into(), port.to_string()),
            ("HOME".into(), home.to_str().unwrap().into()),
        ]
    });
    for o in &outs {
        assert!(o.status.success(), "{}", show(o));
    }
    assert!(home.join(".cache/braid/host-secret").is_file());
    std::fs::remove_dir_all(&home).unwrap();
    // A root another host could be on, and no secret: refused on every rank, before any connection
    // (an outsider who can reach the port could otherwise join with a secret computed from public
    // values), with a message that says what to set.
    let start = Instant::now();
    let outs = spawn_ranks(2, &["small"], |r| {
        vec![
            ("RANK".into(), r.to_string()),
            ("WORLD_SIZE".into(), "2".into()),
            ("MASTER_ADDR".into(), "10.255.255.1".into()),
            ("MASTER_PORT".into(), "29500".into()),
        ]
    });
    for o in &outs {
        let err = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            !o.status.success() && err.contains("BRAID_SECRET") && err.contains("braid secret"),
            "{}",
            show(o)
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

/// Runs a `braid perf` command line; asserts that it succeeded and found every result exact; its
/// standard output.
fn perf_checked(cmd: &mut Command) -> String {
    let o = cmd.env_remove("BRAID_RANK").output().unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("Out of bounds values : 0 OK"), "{out}");
    out
}

fn test_perf_runs_and_checks() {
    let json = std::env::temp_dir().join(format!("braid-perf-{}.json", std::process::id()));
    perf_checked(
        Command::new(braid())
            .args([
                "perf", "--ranks", "3", "-b", "8", "-e", "1M", "-f", "16", "-n", "2", "-w", "1",
                "--json",
            ])
            .arg(&json),
    );
    let text = std::fs::read_to_string(&json).unwrap();
    std::fs::remove_file(&json).unwrap();
    assert!(
        text.contains("\"tool\": \"braid\"") && text.contains("\"size\": 524288"),
        "{text}"
    );
    assert!(!text.contains("\"wrong\": 1"), "{text}");
}

/// Every all-reduce algorithm at 3 ranks under valgrind's memcheck: no invalid access or use of
/// uninitialised memory in any rank, and exact results (braid must also run at all there: valgrind
/// gives a process no usable vDSO and lacks some newer system calls, such as `pidfd_open`, which
/// braid falls back from; valgrind's warnings about it in the output are expected).
fn test_perf_under_valgrind() -> Result<(), String> {
    let probe = Command::new("valgrind").arg("--version").output();
    if !probe.is_ok_and(|o| o.status.success()) {
        return Err("valgrind is not installed (apt-get install valgrind)".into());
    }
    perf_checked(
        Command::new("valgrind")
            .args(["-q", "--trace-children=yes", "--error-exitcode=97"])
            .arg(braid())
            .args([
                "perf", "--ranks", "3", "--algo", "all", "-b", "8", "-e", "64K", "-f", "8", "-n",
                "2", "-w", "1",
            ]),
    );
    Ok(())
}

fn test_perf_all_algorithms_and_plot() {
    let png = std::env::temp_dir().join(format!("braid-perf-{}.png", std::process::id()));
    let out = perf_checked(
        Command::new(braid())
            .args([
                "perf", "--ranks", "3", "--algo", "all", "-b", "8", "-e", "256K", "-f", "64", "-n",
                "2", "-w", "1", "--plot",
            ])
            .arg(&png),
    );
    for name in ["ring", "tree", "rhd", "direct", "pick/best"] {
        assert!(out.contains(name), "no {name} column:\n{out}");
    }
    let bytes = std::fs::read(&png).unwrap();
    std::fs::remove_file(&png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
    // An unknown algorithm is refused before anything starts.
    let o = Command::new(braid())
        .args(["perf", "--ranks", "2", "--algo", "butterfly"])
        .env_remove("BRAID_RANK")
        .output()
        .unwrap();
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("butterfly"),
        "{}",
        show(&o)
    );
}

fn test_perf_every_collective() {
    // nccl-tests' busbw / algbw on n ranks.
    fn factor(name: &str, n: f64) -> f64 {
        match name {
            "all_reduce" => 2.0 * (n - 1.0) / n,
            "broadcast" | "reduce" => 1.0,
            _ => (n - 1.0) / n,
        }
    }
    // (name, whether the size is split into one block per rank, whether it has an in-place form).
    let collectives = [
        ("all_reduce", false, true),
        ("broadcast", false, true),
        ("reduce", false, true),
        ("all_gather", true, true),
        ("reduce_scatter", true, true),
        ("all_to_all", true, false),
    ];
    for (name, split, in_place) in collectives {
        for ranks in [2usize, 3] {
            let what = format!("{name} on {ranks} ranks");
            let json = std::env::temp_dir().join(format!(
                "braid-perf-{name}-{ranks}-{}.json",
                std::process::id()
            ));
            let o = Command::new(braid())
                .args(["perf", "--ranks", &ranks.to_string(), "--collective", name])
                .args([
                    "-b", "1000", "-e", "256000", "-f", "16", "-n", "2", "-w", "1",
                ])
                .args(["-c", "1", "--json"])
                .arg(&json)
                .env_remove("BRAID_RANK")
                .output()
                .unwrap();
            assert!(o.status.success(), "{what}: {}", show(&o));
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(
                out.contains("Out of bounds values : 0 OK"),
                "{what}:\n{out}"
            );
            assert!(
                out.lines().next().unwrap_or_default().contains(name),
                "{what}: the header does not name it:\n{out}"
            );
            let text = std::fs::read_to_string(&json).unwrap();
            std::fs::remove_file(&json).unwrap();
            let report: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(report["collective"], name, "{what}: {text}");
            assert_eq!(report["ranks"], ranks, "{what}: {text}");
            let rows = report["results"].as_array().unwrap();
            // 1000, 16000 and 256000 bytes of f32, rounded down to a multiple of ranks × 4 where split.
            let want: Vec<u64> = [1000u64, 16000, 256000]
                .iter()
                .map(|&b| {
                    let unit = if split { 4 * ranks as u64 } else { 4 };
                    b / unit * unit
                })
                .collect();
            let sizes: Vec<u64> = rows.iter().map(|r| r["size"].as_u64().unwrap()).collect();
            assert_eq!(sizes, want, "{what}: {text}");
            let lines: Vec<&str> = out
                .lines()
                .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                .collect();
            assert_eq!(lines.len(), rows.len(), "{what}:\n{out}");
            for (row, line) in rows.iter().zip(lines) {
                let size = row["size"].as_u64().unwrap();
                let count = row["count"].as_u64().unwrap();
                let per_rank = if split {
                    size / 4 / ranks as u64
                } else {
                    size / 4
                };
                assert_eq!(count, per_rank, "{what}: {row}");
                assert!(
                    line.split_whitespace()
                        .take(2)
                        .eq([size.to_string(), count.to_string()]),
                    "{what}: row {line:?} is not size {size}, count {count}"
                );
                let oop = &row["oop"];
                assert_eq!(oop["wrong"], 0, "{what}: {row}");
                let (algbw, busbw) = (
                    oop["algbw"].as_f64().unwrap(),
                    oop["busbw"].as_f64().unwrap(),
                );
                assert!(algbw > 0.0, "{what}: {row}");
                let f = factor(name, ranks as f64);
                assert!(
                    (busbw - algbw * f).abs() <= 1e-9 * algbw.max(1.0),
                    "{what}: busbw {busbw} is not {f} × algbw {algbw}"
                );
                assert_eq!(row.get("ip").is_some(), in_place, "{what}: {row}");
                if in_place {
                    assert_eq!(row["ip"]["wrong"], 0, "{what}: {row}");
                } else {
                    assert!(line.contains("n/a"), "{what}: {line}");
                }
            }
        }
    }
    // The algorithms of a collective other than all-reduce, side by side.
    for (name, algos) in [
        ("broadcast", &["ring", "tree"][..]),
        ("all_gather", &["ring", "direct"][..]),
    ] {
        let o = Command::new(braid())
            .args([
                "perf",
                "--ranks",
                "3",
                "--collective",
                name,
                "--algo",
                "all",
            ])
            .args(["-b", "1K", "-e", "64K", "-f", "64", "-n", "2", "-w", "1"])
            .env_remove("BRAID_RANK")
            .output()
            .unwrap();
        assert!(o.status.success(), "{name}: {}", show(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("Out of bounds values : 0 OK"), "{out}");
        let header = out
            .lines()
            .find(|l| l.contains("pick/best"))
            .unwrap_or_default();
        for a in algos {
            assert!(header.contains(a), "{name}: no {a} column:\n{out}");
        }
        assert!(
            !header.contains("rhd"),
            "{name}: an all-reduce algorithm:\n{out}"
        );
    }
}

fn test_tune_writes_a_file_the_runtime_uses() {
    let file = std::env::temp_dir().join(format!("braid-tune-{}.json", std::process::id()));
    let o = Command::new(braid())
        .args([
            "tune", "--ranks", "2,3", "-b", "8", "-e", "64K", "-f", "16", "-n", "2", "-w", "1",
            "-o",
        ])
        .arg(&file)
        .env_remove("BRAID_RANK")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.contains("\"world\": 2") && text.contains("\"world\": 3"),
        "{text}"
    );
    // Collectives are written by their canonical name.
    assert!(
        text.contains("\"collective\": \"all_reduce\"") && !text.contains("allreduce"),
        "{text}"
    );
    // A run with the file: its choices come from the table.
    let o = braid_run(
        2,
        &["small"],
        &[("BRAID_TUNE_FILE", file.to_str().unwrap())],
    );
    assert!(o.status.success(), "{}", show(&o));
    // A broken file is an error that names the variable.
    std::fs::write(&file, "{").unwrap();
    let o = braid_run(
        2,
        &["small"],
        &[("BRAID_TUNE_FILE", file.to_str().unwrap())],
    );
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stdout).contains("BRAID_TUNE_FILE"),
        "{}",
        show(&o)
    );
    std::fs::remove_file(&file).unwrap();
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("BRAID_RANK").is_some() || std::env::var_os("RANK").is_some() {
        std::process::exit(rank_main(&args[0], &args[1..]));
    }
    let args = common::arguments();
    let before = braid_segments();
    let tests = vec![
        case("matrix of ranks × dtypes × ops × counts", test_matrix),
        case(
            "two streams: priorities, events, callbacks, borrowed buffers",
            test_streams,
        ),
        case(
            "every algorithm of every collective, forced",
            test_algorithms,
        ),
        case("tcp, several sockets, and shm+tcp hosts", test_transports),
        case("braid topo and topology files", test_topo_command_and_files),
        case("braid compress-bench", test_compress_bench),
        case(
            "launcher stops everyone when one rank fails",
            test_launcher_stops_everyone_when_one_rank_fails,
        ),
        case(
            "the launcher hands rank 0 the bootstrap port",
            test_launcher_holds_the_root_port,
        ),
        case("rank killed mid-collective", test_killed_rank),
        case("torchrun variables", test_torchrun_variables),
        case("braid perf checks its results", test_perf_runs_and_checks),
        case_needing(
            "braid perf under valgrind: no memory errors, exact results",
            test_perf_under_valgrind,
        ),
        case(
            "braid perf --algo all marks the pick and plots",
            test_perf_all_algorithms_and_plot,
        ),
        case(
            "braid perf measures every collective, checked",
            test_perf_every_collective,
        ),
        case(
            "braid tune writes a file the runtime uses",
            test_tune_writes_a_file_the_runtime_uses,
        ),
        no_segments_left(
            "/dev/shm holds no braid segments afterwards",
            before,
            |_| true,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}
