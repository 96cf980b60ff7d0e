//! Self-tests of the multi-host harness: hosts as network namespaces (`tests/netns/hosts.sh`, driven by
//! `common::netns`). This file is its own test harness: run plainly it brings hosts up and runs copies of
//! itself inside them; run with `BRAID_NETNS_ROLE` set it is one of those copies (a listener, a
//! connector, a bulk sender or receiver) and reports what it saw as `key value` lines on stdout.
//!
//! Where namespaces cannot be made (not root, no iproute2) every case says why and is reported ignored;
//! where the kernel has no token-bucket qdisc, only the throttled case is. With `BRAID_REQUIRE_TOOLS=1`
//! such a case fails instead.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::netns::{self, Hosts, Opts};
use common::{case_needing, me};
use libtest_mimic::Trial;

/// Bytes of each bulk transfer.
const BULK: usize = 32 << 20;
/// A copy of this harness inside a namespace ends itself after this long, whatever it is doing.
const ROLE_DEADLINE: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------------
// Inside a namespace.

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

fn say(key: &str, value: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{key} {value}").unwrap();
    out.flush().unwrap();
}

/// 64-bit FNV-1a over 8-byte words (the tail zero-padded): cheap enough for tens of MiB in a test.
fn hash(b: &[u8]) -> u64 {
    b.chunks(8).fold(0xcbf29ce484222325u64, |h, w| {
        let mut x = [0u8; 8];
        x[..w.len()].copy_from_slice(w);
        (h ^ u64::from_le_bytes(x)).wrapping_mul(0x100000001b3)
    })
}

/// What the bulk sender sends: not all zeros, so a wrong offset changes the hash.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i ^ (i >> 9) ^ (i >> 17)) as u8).collect()
}

/// Accepts connections on `BRAID_NETNS_BIND` until stdin closes: answers each one's greeting and
/// reports its peer.
fn role_listen() {
    let l = TcpListener::bind(env("BRAID_NETNS_BIND")).unwrap();
    say("port", l.local_addr().unwrap().port());
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        d.store(true, Ordering::SeqCst);
    });
    l.set_nonblocking(true).unwrap();
    while !done.load(Ordering::SeqCst) {
        match l.accept() {
            Ok((s, peer)) => {
                say("peer", peer.ip());
                s.set_nonblocking(false).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut line = String::new();
                BufReader::new(&s).read_line(&mut line).unwrap();
                say("greeting", line.trim());
                writeln!(
                    &s,
                    "hello {} from {}",
                    peer.ip(),
                    s.local_addr().unwrap().ip()
                )
                .unwrap();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
    // Connections that arrived after the last poll are reported too.
    while let Ok((_, peer)) = l.accept() {
        say("peer", peer.ip());
    }
    say("done", "");
}

/// Connects to `BRAID_NETNS_TARGET`, greets, and reports the answer and its own address.
fn role_connect() {
    let target: SocketAddr = env("BRAID_NETNS_TARGET").parse().unwrap();
    let t = Instant::now();
    let s = TcpStream::connect_timeout(&target, Duration::from_secs(5)).unwrap();
    say("connect_secs", t.elapsed().as_secs_f64());
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    say("local", s.local_addr().unwrap().ip());
    writeln!(&s, "greetings").unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    say("reply", line.trim());
}

/// Receives one connection's bytes until EOF, timing from the first byte to EOF, then acknowledges.
fn role_recv() {
    let l = TcpListener::bind(env("BRAID_NETNS_BIND")).unwrap();
    say("port", l.local_addr().unwrap().port());
    let want: usize = env("BRAID_NETNS_BYTES").parse().unwrap();
    let (mut s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = vec![0u8; want];
    let mut scratch = [0u8; 4096];
    let (mut got, mut extra, mut first) = (0usize, 0usize, None);
    loop {
        let k = if got < want {
            s.read(&mut buf[got..]).unwrap()
        } else {
            s.read(&mut scratch).unwrap()
        };
        if k == 0 {
            break;
        }
        first.get_or_insert_with(Instant::now);
        if got < want {
            got += k;
        } else {
            extra += k;
        }
    }
    let secs = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
    s.write_all(b"!").unwrap();
    say("bytes", got + extra);
    say("secs", secs);
    say("hash", hash(&buf[..got]));
}

/// Sends `BRAID_NETNS_BYTES` bytes of the pattern to `BRAID_NETNS_TARGET` and waits for the
/// acknowledgement.
fn role_send() {
    let target: SocketAddr = env("BRAID_NETNS_TARGET").parse().unwrap();
    let data = pattern(env("BRAID_NETNS_BYTES").parse().unwrap());
    let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    let t = Instant::now();
    s.write_all(&data).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).unwrap();
    say("secs", t.elapsed().as_secs_f64());
    say("hash", hash(&data));
}

fn role_main(role: &str) {
    std::thread::spawn(|| {
        std::thread::sleep(ROLE_DEADLINE);
        eprintln!("gave up after {ROLE_DEADLINE:?}");
        std::process::exit(124);
    });
    match role {
        "listen" => role_listen(),
        "connect" => role_connect(),
        "recv" => role_recv(),
        "send" => role_send(),
        _ => panic!("unknown role {role}"),
    }
}

// ---------------------------------------------------------------------------------------------------
// Driving copies of this harness inside the hosts; every wait has a deadline.

/// A copy of this harness running in a host: its stdout lines arrive on a channel; dropped, it is killed.
struct Proc {
    what: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Option<JoinHandle<String>>,
}

/// What a finished copy reported.
struct Report {
    status: ExitStatus,
    lines: Vec<String>,
    stderr: String,
}

impl Report {
    /// Every value reported under `key`.
    fn all(&self, key: &str) -> Vec<&str> {
        self.lines
            .iter()
            .filter_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
            .collect()
    }

    /// The one value reported under `key`.
    fn get(&self, key: &str) -> &str {
        let all = self.all(key);
        match all[..] {
            [v] => v,
            _ => panic!("expected one `{key}` line in {:?}", self.lines),
        }
    }
}

impl Proc {
    fn start(hosts: &Hosts, host: usize, role: &str, env: &[(&str, String)]) -> Proc {
        let what = format!("{role} in host {host}");
        let mut cmd = hosts.command(host, me());
        cmd.env("BRAID_NETNS_ROLE", role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {what}: {e}"));
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = Some(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        }));
        Proc {
            what,
            stdin: child.stdin.take(),
            child,
            lines,
            stderr,
        }
    }

    /// The next stdout line, within `limit`.
    fn line(&mut self, limit: Duration) -> String {
        match self.lines.recv_timeout(limit) {
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => panic!("{}: no output within {limit:?}", self.what),
            Err(RecvTimeoutError::Disconnected) => {
                let r = self.finish(Duration::from_secs(5));
                panic!(
                    "{}: ended early ({}) with stderr:\n{}",
                    self.what, r.status, r.stderr
                )
            }
        }
    }

    /// The port a listening copy reports first.
    fn port(&mut self) -> u16 {
        let l = self.line(Duration::from_secs(10));
        l.strip_prefix("port ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("{}: expected `port N`, got {l:?}", self.what))
    }

    /// Closes stdin and waits until `limit` for the end; past it, kills the copy. Does not judge the
    /// status.
    fn finish(&mut self, limit: Duration) -> Report {
        drop(self.stdin.take());
        let t = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if t.elapsed() > limit {
                let _ = self.child.kill();
                let s = self.child.wait().unwrap();
                eprintln!("{}: killed after {limit:?}", self.what);
                break s;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let stderr = self
            .stderr
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        Report {
            status,
            lines: self.lines.try_iter().collect(),
            stderr,
        }
    }

    /// Waits as `finish` does and requires a clean exit.
    fn success(&mut self, limit: Duration) -> Report {
        let r = self.finish(limit);
        assert!(
            r.status.success(),
            "{}: {}\nstdout: {:?}\nstderr:\n{}",
            self.what,
            r.status,
            r.lines,
            r.stderr
        );
        r
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `program args...` (in host `i` when given) with a deadline; its stdout, or a panic saying why not.
fn output(hosts: Option<(&Hosts, usize)>, program: &str, args: &[&str]) -> String {
    let mut cmd = match hosts {
        Some((h, i)) => h.command(i, program),
        None => Command::new(program),
    };
    let o =
        netns::bounded(cmd.args(args), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        o.status.success(),
        "{program} {args:?}: {}",
        common::show(&o)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Sends `len` bytes from host `from` to host `to`; checks they all arrived intact and returns the
/// receiver's rate in Gbit/s.
fn bulk(hosts: &Hosts, from: usize, to: usize, len: usize) -> f64 {
    let bytes = ("BRAID_NETNS_BYTES", len.to_string());
    let mut recv = Proc::start(
        hosts,
        to,
        "recv",
        &[
            ("BRAID_NETNS_BIND", format!("{}:0", hosts.addr(to))),
            bytes.clone(),
        ],
    );
    let port = recv.port();
    let mut send = Proc::start(
        hosts,
        from,
        "send",
        &[
            ("BRAID_NETNS_TARGET", format!("{}:{port}", hosts.addr(to))),
            bytes,
        ],
    );
    let s = send.success(Duration::from_secs(30));
    let r = recv.success(Duration::from_secs(5));
    assert_eq!(r.get("bytes"), len.to_string(), "bytes received");
    assert_eq!(r.get("hash"), s.get("hash"), "the bytes received differ");
    let secs: f64 = r.get("secs").parse().unwrap();
    assert!(secs > 0.0, "no time measured");
    len as f64 * 8.0 / secs / 1e9
}

// ---------------------------------------------------------------------------------------------------
// The cases.

fn link_names() -> BTreeSet<String> {
    output(None, "ip", &["-o", "link", "show"])
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap().to_owned())
        .collect()
}

fn bench_routes() -> String {
    output(
        None,
        "ip",
        &["-4", "route", "show", "root", "198.18.0.0/15"],
    )
}

/// Three hosts reach one another over TCP at the documented addresses, and nothing appears in the
/// namespace the harness runs in.
fn test_three_hosts_talk() {
    let (links_before, routes_before) = (link_names(), bench_routes());
    let hosts = Hosts::up(3, Opts::default()).unwrap();
    for i in 0..3 {
        let addr = hosts.addr(i);
        assert_eq!(addr, Ipv4Addr::new(198, 18, 0, 1 + i as u8));
        let a = output(
            Some((&hosts, i)),
            "ip",
            &["-4", "-o", "addr", "show", "dev", "eth0"],
        );
        assert!(
            a.contains(&format!(" inet {addr}/15 ")),
            "host {i}'s eth0: {a}"
        );
        let lo = output(Some((&hosts, i)), "ip", &["-o", "link", "show", "lo"]);
        assert!(lo.contains(",UP"), "host {i}'s lo is down: {lo}");
        let mtu = output(Some((&hosts, i)), "ip", &["-o", "link", "show", "eth0"]);
        assert!(mtu.contains(" mtu 1500 "), "host {i}'s eth0: {mtu}");
    }
    assert_eq!(
        link_names(),
        links_before,
        "links appeared in (or vanished from) the harness's own namespace"
    );
    assert_eq!(
        bench_routes(),
        routes_before,
        "routes into 198.18.0.0/15 changed in the harness's own namespace"
    );

    let mut listener = Proc::start(
        &hosts,
        2,
        "listen",
        &[("BRAID_NETNS_BIND", format!("{}:0", hosts.addr(2)))],
    );
    let port = listener.port();
    let target = format!("{}:{port}", hosts.addr(2));
    let c = Proc::start(
        &hosts,
        0,
        "connect",
        &[("BRAID_NETNS_TARGET", target.clone())],
    )
    .success(Duration::from_secs(20));
    assert_eq!(c.get("local"), hosts.addr(0).to_string());
    assert_eq!(
        c.get("reply"),
        format!("hello {} from {}", hosts.addr(0), hosts.addr(2))
    );
    // From the harness's own namespace the listener cannot be reached: the attempt fails, or reaches
    // some other machine, never host 2.
    let from_outside =
        TcpStream::connect_timeout(&target.parse().unwrap(), Duration::from_millis(300));
    let l = listener.success(Duration::from_secs(10));
    assert_eq!(
        l.all("peer"),
        [hosts.addr(0).to_string()],
        "host 2 saw other peers than host 0 (outside attempt: {from_outside:?})"
    );
    assert_eq!(l.get("greeting"), "greetings");
    println!(
        "    outside attempt: {}",
        match from_outside {
            Ok(_) => "connected to something that is not host 2".to_owned(),
            Err(e) => e.to_string(),
        }
    );

    let gbit = bulk(&hosts, 0, 1, BULK);
    println!(
        "    unthrottled: {} MiB host 0 -> host 1 at {gbit:.2} Gbit/s",
        BULK >> 20
    );
}

/// A link throttled to 1 gbit by tbf carries a bulk transfer at about 1 Gbit/s; at 100 mbit, at about
/// 100 Mbit/s (which shows the shaping even on a machine too busy to move much more than 1 Gbit/s).
fn test_throttled_link() -> Result<(), String> {
    netns::qdisc_available(
        "tbf",
        &["rate", "1gbit", "burst", "125000", "latency", "50ms"],
    )?;
    for (rate, shown, gbit_want, len) in [
        ("1gbit", "1Gbit", 1.0, BULK),
        ("100mbit", "100Mbit", 0.1, BULK / 8),
    ] {
        let hosts = Hosts::up(
            2,
            Opts {
                rate: Some(rate.into()),
                ..Opts::default()
            },
        )
        .unwrap();
        for i in 0..2 {
            let q = output(Some((&hosts, i)), "tc", &["qdisc", "show", "dev", "eth0"]);
            assert!(
                q.contains("tbf") && q.contains(&format!("rate {shown} ")),
                "host {i}'s qdisc: {q}"
            );
        }
        let gbit = bulk(&hosts, 0, 1, len);
        println!(
            "    throttled to {rate}: {} MiB host 0 -> host 1 at {gbit:.3} Gbit/s",
            len >> 20
        );
        assert!(
            (0.5 * gbit_want..1.3 * gbit_want).contains(&gbit),
            "a {rate} link carried {gbit:.3} Gbit/s"
        );
    }
    Ok(())
}

/// `--delay` puts a netem qdisc on every host, so a TCP handshake takes at least two delays; on a
/// kernel without netem, `up` fails and leaves nothing behind (it fails after the namespaces, the bridge
/// and the links were made).
fn test_delay_or_clean_failure() {
    let prefix = netns::unique_prefix();
    let up = Hosts::up(
        2,
        Opts {
            delay: Some("20ms".into()),
            prefix: Some(prefix.clone()),
            ..Opts::default()
        },
    );
    let hosts = match up {
        Ok(h) => h,
        Err(e) => {
            assert!(e.contains("netem"), "up failed for another reason: {e}");
            assert_eq!(ours(&prefix), Vec::<String>::new(), "left by a failed up");
            println!("    no netem here; the failed up removed what it made: {e}");
            return;
        }
    };
    for i in 0..2 {
        let q = output(Some((&hosts, i)), "tc", &["qdisc", "show", "dev", "eth0"]);
        assert!(
            q.contains("netem") && q.contains("delay 20ms"),
            "host {i}'s qdisc: {q}"
        );
    }
    let mut listener = Proc::start(
        &hosts,
        1,
        "listen",
        &[("BRAID_NETNS_BIND", format!("{}:0", hosts.addr(1)))],
    );
    let port = listener.port();
    let c = Proc::start(
        &hosts,
        0,
        "connect",
        &[("BRAID_NETNS_TARGET", format!("{}:{port}", hosts.addr(1)))],
    )
    .success(Duration::from_secs(20));
    listener.success(Duration::from_secs(10));
    let secs: f64 = c.get("connect_secs").parse().unwrap();
    println!("    handshake with 20 ms each way: {:.1} ms", secs * 1e3);
    assert!(secs >= 0.039, "a handshake took {:.1} ms", secs * 1e3);
}

fn ours(prefix: &str) -> Vec<String> {
    netns::namespaces()
        .unwrap()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .collect()
}

/// Dropping the hosts removes every namespace they made, also when a panic drops them.
fn test_teardown() {
    let hosts = Hosts::up(2, Opts::default()).unwrap();
    let prefix = hosts.prefix().to_owned();
    let mut made = ours(&prefix);
    made.sort();
    assert_eq!(
        made,
        ["h0", "h1", "sw"].map(|s| format!("{prefix}-{s}")),
        "namespaces made"
    );
    drop(hosts);
    assert_eq!(ours(&prefix), Vec::<String>::new(), "left after drop");

    let prefix = netns::unique_prefix();
    let p = prefix.clone();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(move || {
        let _hosts = Hosts::up(
            2,
            Opts {
                prefix: Some(p.clone()),
                ..Opts::default()
            },
        )
        .unwrap();
        assert_eq!(ours(&p).len(), 3, "namespaces made");
        panic!("on purpose");
    });
    std::panic::set_hook(hook);
    match r {
        Err(e) if e.downcast_ref::<&str>() == Some(&"on purpose") => {}
        Err(e) => std::panic::resume_unwind(e),
        Ok(()) => unreachable!(),
    }
    assert_eq!(ours(&prefix), Vec::<String>::new(), "left after a panic");
}

/// A case on hosts: it cannot run where namespaces cannot be made, nor where `run` says why it cannot
/// (`Err`); it panics when it fails.
fn on_hosts(name: &str, run: fn() -> Result<(), String>) -> Trial {
    case_needing(name, move || {
        netns::usable()?;
        let start = Instant::now();
        run()?;
        println!("  took {:.1} s", start.elapsed().as_secs_f64());
        Ok(())
    })
}

fn main() {
    if let Ok(role) = std::env::var("BRAID_NETNS_ROLE") {
        role_main(&role);
        return;
    }
    let args = common::arguments();
    let mine = format!("braidt-{}-", std::process::id());
    let tests = vec![
        on_hosts(
            "three hosts talk over TCP, apart from this namespace",
            || {
                test_three_hosts_talk();
                Ok(())
            },
        ),
        on_hosts(
            "links shaped by tbf carry about their rate (1gbit, 100mbit)",
            test_throttled_link,
        ),
        on_hosts(
            "--delay adds latency, or a failed up leaves nothing",
            || {
                test_delay_or_clean_failure();
                Ok(())
            },
        ),
        on_hosts("hosts vanish when dropped, also on panic", || {
            test_teardown();
            Ok(())
        }),
        case_needing("no namespaces of this run remain", move || {
            netns::usable()?;
            let left: Vec<_> = netns::namespaces()?
                .into_iter()
                .filter(|n| n.starts_with(&mine))
                .collect();
            assert!(left.is_empty(), "namespaces left behind: {left:?}");
            Ok(())
        }),
    ];
    libtest_mimic::run(&args, tests).exit();
}
