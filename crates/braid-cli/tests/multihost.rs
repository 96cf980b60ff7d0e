//! Ranks on several hosts: network namespaces joined by a switch (`tests/netns/hosts.sh`), TCP between
//! them, shared memory inside each. Run without `BRAID_RANK` this harness makes the hosts and starts
//! copies of itself in them as ranks; run with `BRAID_RANK` it is a rank and plays the scenario named by
//! its first argument. Where namespaces cannot be made, every case says why and is reported ignored (a
//! failure under `BRAID_REQUIRE_TOOLS=1`).

mod common;

use std::io::Read;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use braid::Communicator;
use common::case_needing;
use common::netns::{self, Hosts, Opts};
use common::scenarios::scenario_algorithms;
use libtest_mimic::Trial;

const PORT: u16 = 29_500;
const SECRET: &str = "00112233445566778899aabbccddeeff";

fn rank_main(scenario: &str) -> i32 {
    let c = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            println!("init failed: {e}");
            return 1;
        }
    };
    // Ranks sit on host `rank % hosts`: shared memory inside a host (unless TCP is forced), TCP across.
    let n_hosts: usize = std::env::var("TEST_HOSTS").unwrap().parse().unwrap();
    let tcp_only = std::env::var("BRAID_TRANSPORT").as_deref() == Ok("tcp");
    for (p, route) in c.peer_transports().iter().enumerate() {
        let want = if p == c.rank() {
            "self"
        } else if p % n_hosts == c.rank() % n_hosts && !tcp_only {
            "shm"
        } else {
            "tcp"
        };
        if *route != want {
            println!(
                "rank {} reaches rank {p} over {route}, expected {want}",
                c.rank()
            );
            return 1;
        }
    }
    if scenario != "probe" && c.hosts().len() != n_hosts.min(c.world_size()) {
        println!("rank {} sees hosts {:?}", c.rank(), c.hosts());
        return 1;
    }
    match scenario {
        "algorithms" => {
            let n = scenario_algorithms(&c);
            println!("rank {} ok: {n} checks", c.rank());
            0
        }
        "probe" => {
            // Every host reported the same identity; probing must still find rank r on host r % n.
            let want: Vec<Vec<usize>> = (0..n_hosts)
                .map(|h| (0..c.world_size()).filter(|r| r % n_hosts == h).collect())
                .collect();
            if c.hosts() != want {
                println!(
                    "rank {} probed hosts {:?}, expected {want:?}",
                    c.rank(),
                    c.hosts()
                );
                return 1;
            }
            // The probed link between hosts (300 Mbit/s) feeds the tuner: large all-reduces go hierarchical.
            let (algo, why) = c.algorithm(braid::Collective::AllReduce, 64 << 20);
            if algo != braid::Algo::Hier {
                println!(
                    "rank {} picks {algo} ({why}) for 64 MiB across probed hosts",
                    c.rank()
                );
                return 1;
            }
            let n = scenario_algorithms(&c);
            println!(
                "rank {} ok: probed {:?}, 64 MiB picks {algo} ({why}), {n} checks",
                c.rank(),
                c.hosts()
            );
            0
        }
        other => {
            println!("unknown scenario {other}");
            2
        }
    }
}

/// A rank process inside a host, with its output collected.
struct Rank {
    rank: usize,
    host: usize,
    child: Child,
    out: std::thread::JoinHandle<String>,
}

/// Starts `world` ranks of this harness, rank `r` on host `r % hosts.n()` (so hosts hold
/// non-contiguous ranks), and waits for all of them up to `limit`. Returns every rank's output, or
/// panics naming what failed.
fn run_ranks(
    hosts: &Hosts,
    world: usize,
    scenario: &str,
    env: &[(&str, &str)],
    limit: Duration,
) -> Vec<String> {
    let mut ranks: Vec<Rank> = (0..world)
        .map(|r| {
            let host = r % hosts.n();
            let mut cmd = hosts.command(host, std::env::current_exe().unwrap());
            cmd.arg(scenario)
                .env("BRAID_RANK", r.to_string())
                .env("BRAID_WORLD_SIZE", world.to_string())
                .env("BRAID_ROOT", format!("{}:{PORT}", hosts.addr(0)))
                .env("BRAID_SECRET", SECRET)
                .env("BRAID_TIMEOUT_MS", "60000")
                .env("TEST_HOSTS", hosts.n().to_string())
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let mut child = cmd.spawn().expect("spawn a rank");
            let (mut so, mut se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
            let out = std::thread::spawn(move || {
                let (mut a, mut b) = (String::new(), String::new());
                let _ = so.read_to_string(&mut a);
                let _ = se.read_to_string(&mut b);
                format!("{a}{b}")
            });
            Rank {
                rank: r,
                host,
                child,
                out,
            }
        })
        .collect();
    let deadline = Instant::now() + limit;
    let mut statuses = vec![None; world];
    while statuses.iter().any(Option::is_none) && Instant::now() < deadline {
        for (i, r) in ranks.iter_mut().enumerate() {
            if statuses[i].is_none() {
                statuses[i] = r.child.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let timed_out = statuses.iter().any(Option::is_none);
    for r in &mut ranks {
        let _ = r.child.kill();
        let _ = r.child.wait();
    }
    let outs: Vec<String> = ranks
        .into_iter()
        .map(|r| {
            let o = r.out.join().unwrap();
            format!("--- rank {} (host {}):\n{o}", r.rank, r.host)
        })
        .collect();
    assert!(
        !timed_out,
        "{scenario} with {env:?}: ranks still running after {limit:?}\n{}",
        outs.join("\n")
    );
    for (i, s) in statuses.iter().enumerate() {
        assert!(
            s.unwrap().success(),
            "{scenario} with {env:?}: rank {i} failed\n{}",
            outs.join("\n")
        );
    }
    outs
}

/// Every algorithm of every collective across 2 and 3 hosts × 1..3 ranks each, over TCP alone and over
/// shared memory inside hosts with TCP between them.
fn test_collectives_across_hosts() -> Result<(), String> {
    for n_hosts in [2, 3] {
        let hosts = Hosts::up(
            n_hosts,
            Opts {
                mtu: 9000,
                ..Opts::default()
            },
        )?;
        for per_host in 1..=3 {
            let world = n_hosts * per_host;
            for transport in ["tcp", "auto"] {
                if transport == "auto" && per_host == 1 {
                    continue; // the same as tcp
                }
                let start = Instant::now();
                let outs = run_ranks(
                    &hosts,
                    world,
                    "algorithms",
                    &[
                        ("BRAID_TRANSPORT", transport),
                        ("BRAID_CHUNK_BYTES", "16384"),
                    ],
                    Duration::from_secs(240),
                );
                let ok = outs.iter().filter(|o| o.contains(" ok: ")).count();
                assert_eq!(ok, world, "{}", outs.join("\n"));
                println!(
                    "  {n_hosts} hosts × {per_host} ranks over {transport}: every algorithm of every collective ok ({:.1} s)",
                    start.elapsed().as_secs_f64()
                );
            }
        }
    }
    Ok(())
}

/// With every host reporting one identity (as in clouds that hide placement), probing latency and
/// bandwidth at start-up recovers which ranks share a host.
fn test_probing_recovers_hidden_hosts() -> Result<(), String> {
    netns::qdisc_available(
        "tbf",
        &["rate", "1gbit", "burst", "125000", "latency", "50ms"],
    )?;
    let hosts = Hosts::up(
        2,
        Opts {
            rate: Some("1gbit".into()),
            ..Opts::default()
        },
    )?;
    // Two ranks per host: with three per host, six ranks on two cores starve each other enough that
    // loopback measurements inside a host can spread past the gap to the network.
    {
        let per_host = 2;
        let start = Instant::now();
        let outs = run_ranks(
            &hosts,
            2 * per_host,
            "probe",
            &[
                ("BRAID_TRANSPORT", "tcp"),
                ("BRAID_HOST_ID", "one-big-host"),
                ("BRAID_TOPO_PROBE", "1"),
            ],
            Duration::from_secs(240),
        );
        let line = outs
            .iter()
            .find_map(|o| o.lines().find(|l| l.contains("ok: probed")))
            .unwrap_or_default()
            .to_string();
        println!(
            "  2 hosts × {per_host} ranks, one identity: {line} ({:.1} s)",
            start.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// A case on hosts: it cannot run where namespaces cannot be made, nor where `run` says why it cannot
/// (`Err`); it panics when it fails.
fn on_hosts(name: &str, run: fn() -> Result<(), String>) -> Trial {
    case_needing(name, move || {
        netns::usable()?;
        run()
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("BRAID_RANK").is_some() {
        std::process::exit(rank_main(&args[0]));
    }
    let args = common::arguments();
    let tests = vec![
        on_hosts(
            "every collective across namespaced hosts, tcp and shm+tcp",
            test_collectives_across_hosts,
        ),
        on_hosts(
            "probing recovers hosts that all report one identity",
            test_probing_recovers_hidden_hosts,
        ),
    ];
    libtest_mimic::run(&args, tests).exit();
}
