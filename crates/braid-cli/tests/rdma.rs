//! The RDMA transport over real verbs: every collective × algorithm on 2, 3 and 4 ranks sharing one
//! device, two hosts (shared memory inside, RDMA between) on two devices, striping over several queue
//! pairs, a write with a wrong key, and what a rank says when no device is usable.
//!
//! Built with `--features rdma`. The cases that need a device run where the verbs library lists one:
//! on a machine with an RDMA NIC, or inside the Soft-RoCE guest of `tests/rdma/guest.sh` (which
//! `tests/rdma/run-tests.sh` boots for CI). Elsewhere they say why they cannot run (and fail under
//! `BRAID_REQUIRE_TOOLS=1`). Like `processes.rs`, this file is its own harness: with `BRAID_RANK` set
//! it is a rank and plays the scenario named by its first argument.

mod common;

use std::time::{Duration, Instant};

use braid::{Communicator, Error, ReduceOp};
use common::scenarios::{scenario_algorithms, scenario_algorithms_registering};
use common::{braid_run, case, case_needing, show};

/// RDMA devices the kernel has (`/sys/class/infiniband`), sorted.
fn devices() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn need_devices(n: usize) -> Result<Vec<String>, String> {
    let d = devices();
    if d.len() < n {
        return Err(format!(
            "{} RDMA device(s) here, {n} needed (run through tests/rdma/run-tests.sh, which boots a \
             Soft-RoCE guest)",
            d.len()
        ));
    }
    Ok(d)
}

// ---------------------------------------------------------------------------------------------------
// Rank side.

/// Sets this rank's host identity and device from `TEST_RANKS_PER_HOST` and `TEST_IB_HCA_PER_HOST`
/// (one device per pretend host, comma-separated).
fn pretend_hosts() {
    common::pretend_hosts_from_env();
    if let Ok(list) = std::env::var("TEST_IB_HCA_PER_HOST") {
        let rank: usize = std::env::var("BRAID_RANK").unwrap().parse().unwrap();
        let per: usize = std::env::var("TEST_RANKS_PER_HOST").map_or(1, |v| v.parse().unwrap());
        let hcas: Vec<&str> = list.split(',').collect();
        std::env::set_var(
            "BRAID_IB_HCA",
            format!("={}", hcas[(rank / per) % hcas.len()]),
        );
    }
}

/// Every peer is reached as `TEST_EXPECT_ROUTES` says: `rdma` for all, or `shm+rdma` for shared
/// memory inside a host and RDMA between hosts.
fn check_routes(c: &Communicator) -> Result<(), String> {
    let want = std::env::var("TEST_EXPECT_ROUTES").unwrap_or_else(|_| "rdma".into());
    let hosts = c.hosts();
    let host_of = |r: usize| hosts.iter().position(|h| h.contains(&r));
    for (p, route) in c.peer_transports().iter().enumerate() {
        let expect = if p == c.rank() {
            "self"
        } else if want == "shm+rdma" && host_of(p) == host_of(c.rank()) {
            "shm"
        } else {
            "rdma"
        };
        if *route != expect {
            return Err(format!(
                "rank {} reaches rank {p} over {route}, expected {expect} (routes {:?})",
                c.rank(),
                c.peer_transports()
            ));
        }
    }
    Ok(())
}

/// Rank 1 writes with a wrong remote key: the receiving device refuses the write, both queue pairs
/// fail, and both ranks must get an error that names the other, within twice the timeout.
fn scenario_bad_key(c: &Communicator) -> i32 {
    let timeout = c.config().timeout;
    let mut buf = vec![1.0f32; 1 << 20];
    let start = Instant::now();
    let r = c.all_reduce_in_place(&mut buf, ReduceOp::Sum);
    let ms = start.elapsed().as_millis();
    let other = 1 - c.rank();
    match r {
        Err(Error::PeerFailed { peer, reason, .. }) if peer == other => {
            if start.elapsed() > 2 * timeout {
                println!("FAIL rank {} took {ms} ms (timeout {timeout:?})", c.rank());
                return 1;
            }
            println!(
                "rank {} ok: PeerFailed({peer}) in {ms} ms: {reason}",
                c.rank()
            );
            0
        }
        other => {
            println!("FAIL rank {}: {other:?} after {ms} ms", c.rank());
            1
        }
    }
}

/// Registrations that overlap are refused; a buffer rewritten between collectives while registered
/// (the raw form, as the C ABI and `braid perf --register` use it) is sent as it is now, never as it
/// was when registered.
fn scenario_registrations(c: &Communicator) -> usize {
    let (rank, world) = (c.rank(), c.world_size());
    let n = 200_003usize;
    let mut send = vec![0u32; n];
    {
        let r = c.register(&send).unwrap();
        let e = c
            .register(&send[100..200])
            .err()
            .expect("an overlapping registration");
        assert!(e.to_string().contains("overlaps"), "{e}");
        drop(r);
    }
    // SAFETY: `send` outlives the registration, is never reallocated, and changes only between
    // collectives.
    assert!(unsafe { c.register_raw(send.as_ptr().cast(), n * 4) }.unwrap());
    let mut out = vec![0u32; n];
    for round in 0..4u32 {
        for (i, v) in send.iter_mut().enumerate() {
            *v = (i as u32).wrapping_mul(31) ^ (rank as u32 + 1).wrapping_mul(round + 7);
        }
        c.all_reduce(&send, &mut out, ReduceOp::Sum).unwrap();
        for (i, got) in out.iter().enumerate() {
            let want = (0..world as u32).fold(0u32, |acc, r| {
                acc.wrapping_add((i as u32).wrapping_mul(31) ^ (r + 1).wrapping_mul(round + 7))
            });
            assert_eq!(
                *got, want,
                "round {round}, element {i}: a stale or torn send"
            );
        }
    }
    c.deregister_raw(send.as_ptr().cast(), n * 4).unwrap();
    4
}

fn rank_main(scenario: &str) -> i32 {
    pretend_hosts();
    let c = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("init failed: {e}");
            return 1;
        }
    };
    match scenario {
        "algorithms" => {
            if let Err(e) = check_routes(&c) {
                println!("FAIL {e}");
                return 1;
            }
            let n = scenario_algorithms(&c);
            println!(
                "rank {} ok: {n} checks over {}",
                c.rank(),
                c.transports_summary()
            );
            0
        }
        "registered" => {
            if let Err(e) = check_routes(&c) {
                println!("FAIL {e}");
                return 1;
            }
            let n = scenario_algorithms_registering(&c, true) + scenario_registrations(&c);
            println!("rank {} ok: {n} checks, send buffers registered", c.rank());
            0
        }
        "bad-key" => scenario_bad_key(&c),
        other => {
            println!("unknown scenario {other}");
            2
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Harness side.

fn run_algorithms(n: usize, env: &[(&str, &str)], what: &str) {
    let start = Instant::now();
    let mut all = vec![
        ("BRAID_TIMEOUT_MS", "120000"),
        ("BRAID_CHUNK_BYTES", "16384"),
    ];
    all.extend_from_slice(env);
    let o = braid_run(n, &["algorithms"], &all);
    assert!(o.status.success(), "{what}:\n{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches(" ok: ").count(), n, "{what}:\n{}", show(&o));
    println!("  {what}: ok ({:.1} s)", start.elapsed().as_secs_f64());
}

fn test_one_device() -> Result<(), String> {
    let d = need_devices(1)?;
    let hca = format!("={}", d[0]);
    for n in [2, 3, 4] {
        run_algorithms(
            n,
            &[("BRAID_TRANSPORT", "rdma"), ("BRAID_IB_HCA", &hca)],
            &format!("every algorithm on {n} ranks over rdma on {}", d[0]),
        );
    }
    Ok(())
}

fn test_striped() -> Result<(), String> {
    let d = need_devices(1)?;
    let hca = format!("={}", d[0]);
    run_algorithms(
        3,
        &[
            ("BRAID_TRANSPORT", "rdma"),
            ("BRAID_IB_HCA", &hca),
            ("BRAID_IB_QPS_PER_PEER", "3"),
            ("BRAID_CHUNK_BYTES", "262144"),
            ("BRAID_SLOTS", "4"),
        ],
        "every algorithm on 3 ranks, 256 KiB slots striped over 3 queue pairs",
    );
    Ok(())
}

fn test_two_hosts() -> Result<(), String> {
    let d = need_devices(2)?;
    let hcas = format!("{},{}", d[0], d[1]);
    run_algorithms(
        4,
        &[
            ("BRAID_TRANSPORT", "auto"),
            ("TEST_RANKS_PER_HOST", "2"),
            ("TEST_IB_HCA_PER_HOST", &hcas),
            ("TEST_EXPECT_ROUTES", "shm+rdma"),
        ],
        &format!("every algorithm on 2 hosts × 2 ranks: shm inside, rdma between ({hcas})"),
    );
    Ok(())
}

fn test_registered() -> Result<(), String> {
    let d = need_devices(1)?;
    let hca = format!("={}", d[0]);
    for (n, qps) in [(2, "1"), (3, "2")] {
        let start = Instant::now();
        let o = braid_run(
            n,
            &["registered"],
            &[
                ("BRAID_TRANSPORT", "rdma"),
                ("BRAID_IB_HCA", &hca),
                ("BRAID_TIMEOUT_MS", "120000"),
                ("BRAID_CHUNK_BYTES", "131072"),
                ("BRAID_IB_QPS_PER_PEER", qps),
            ],
        );
        assert!(o.status.success(), "{}", show(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(out.matches(" ok: ").count(), n, "{}", show(&o));
        println!(
            "  every algorithm on {n} ranks from registered send buffers ({qps} queue pair(s)): ok ({:.1} s)",
            start.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn test_bad_key() -> Result<(), String> {
    let d = need_devices(1)?;
    let hca = format!("={}", d[0]);
    let start = Instant::now();
    let o = braid_run(
        2,
        &["bad-key"],
        &[
            ("BRAID_TRANSPORT", "rdma"),
            ("BRAID_IB_HCA", &hca),
            ("BRAID_TIMEOUT_MS", "4000"),
            ("BRAID_IB_TEST_BAD_RKEY", "1"),
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches(" ok: ").count(), 2, "{}", show(&o));
    assert!(start.elapsed() < Duration::from_secs(30), "{}", show(&o));
    for l in out.lines().filter(|l| l.contains(" ok: ")) {
        println!("  {l}");
    }
    Ok(())
}

/// Asked for by name without a usable device, rdma is an error at start-up that says why; under
/// `auto` its absence is quiet and TCP or shared memory carry the job.
fn test_forced_without_device() {
    let o = braid_run(
        2,
        &["algorithms"],
        &[
            ("BRAID_TRANSPORT", "rdma"),
            ("BRAID_IB_HCA", "=no-such-device"),
            ("BRAID_TIMEOUT_MS", "20000"),
        ],
    );
    assert!(!o.status.success(), "{}", show(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("init failed") && out.contains("rdma") && out.contains("no RDMA"),
        "{}",
        show(&o)
    );
    let line = out
        .lines()
        .find(|l| l.contains("init failed"))
        .unwrap_or("");
    println!("  {}", &line[..line.len().min(160)]);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("BRAID_RANK").is_some() {
        std::process::exit(rank_main(&args[0]));
    }
    let args = common::arguments();
    let tests = vec![
        case(
            "rdma asked for without a usable device says why",
            test_forced_without_device,
        ),
        case_needing("every algorithm over rdma, one device", test_one_device),
        case_needing("striped over several queue pairs", test_striped),
        case_needing("two hosts on two devices, shm inside", test_two_hosts),
        case_needing(
            "sends from registered buffers, without a copy",
            test_registered,
        ),
        case_needing("a write with a wrong key fails both ranks", test_bad_key),
    ];
    libtest_mimic::run(&args, tests).exit();
}
