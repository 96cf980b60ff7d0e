//! Several hosts on one machine, as network namespaces joined by a switch (`tests/netns/hosts.sh`).
//!
//! Host `i` is the namespace `<prefix>-h<i>` with `eth0` at 198.18.0.(1+i)/15; [`Hosts::command`] runs a
//! program there. Dropping [`Hosts`] removes every namespace it made, also when a test panics; a run
//! killed outright leaves its hosts to [`reap_orphans`] in the next run.

use std::io::Read;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The script that makes and removes the hosts.
pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/netns/hosts.sh")
}

/// How to build the hosts' links.
#[derive(Clone, Debug)]
pub struct Opts {
    /// MTU of every link.
    pub mtu: u32,
    /// Egress rate of every host (a tc rate such as `1gbit`); unlimited when `None`.
    pub rate: Option<String>,
    /// Added egress delay of every host (a tc time such as `1ms`); none when `None`.
    pub delay: Option<String>,
    /// Namespace names start with this; a fresh `braidt-<pid>-<k>` when `None`.
    pub prefix: Option<String>,
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            mtu: 1500,
            rate: None,
            delay: None,
            prefix: None,
        }
    }
}

/// A prefix no other process and no other [`Hosts`] of this process uses.
pub fn unique_prefix() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "braidt-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// How long one `ip`, `tc` or script call may take before it is killed.
const CALL_LIMIT: Duration = Duration::from_secs(30);

/// Runs `cmd` to the end with stdin closed, killing it past `limit`. Err says why it could not start
/// or that it was killed (with what it printed); a non-zero exit is not an error here.
pub fn bounded(cmd: &mut Command, limit: Duration) -> Result<Output, String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = r.read_to_end(&mut b);
            b
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let (status, killed) = loop {
        match child.try_wait() {
            Ok(Some(s)) => break (s, false),
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                break (child.wait().map_err(|e| format!("{what}: {e}"))?, true);
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(format!("{what}: {e}")),
        }
    };
    let o = Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    };
    if killed {
        return Err(failure(&format!("{what} killed after {limit:?}"), &o));
    }
    Ok(o)
}

fn failure(what: &str, o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr);
    format!("{what}: {} ({})", err.trim(), o.status)
}

/// Runs `ip args...`; Err says why it could not run or what it printed.
fn ip(args: &[&str]) -> Result<Output, String> {
    let o = bounded(Command::new("ip").args(args), CALL_LIMIT).map_err(|e| {
        if e.starts_with("cannot run") {
            format!("{e}; install iproute2")
        } else {
            e
        }
    })?;
    if o.status.success() {
        Ok(o)
    } else {
        Err(failure(&format!("`ip {}`", args.join(" ")), &o))
    }
}

/// Whether namespaces joined by veth pairs and a bridge can be made here: makes a throwaway namespace
/// with a veth pair and a bridge in it, then deletes it. Err says why not (no `ip`, not root, ...).
pub fn available() -> Result<(), String> {
    let ns = format!("{}-probe", unique_prefix());
    ip(&["netns", "add", &ns]).map_err(|e| {
        if euid() != Some(0) {
            format!("{e}; network namespaces need root (or CAP_SYS_ADMIN)")
        } else {
            e
        }
    })?;
    let r = ip(&[
        "-n", &ns, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1",
    ])
    .and_then(|_| ip(&["-n", &ns, "link", "add", "probebr", "type", "bridge"]))
    .map(|_| ());
    let d = ip(&["netns", "delete", &ns]).map(|_| ());
    r.and(d)
}

/// [`available`], found out once per process; the first time it is Ok this also removes the hosts of
/// runs that died ([`reap_orphans`]).
pub fn usable() -> Result<(), String> {
    static USABLE: OnceLock<Result<(), String>> = OnceLock::new();
    USABLE
        .get_or_init(|| {
            available()?;
            match reap_orphans() {
                Ok(gone) if !gone.is_empty() => {
                    println!("removed hosts of runs that died: {gone:?}")
                }
                Ok(_) => {}
                Err(e) => println!("could not look for hosts of runs that died: {e}"),
            }
            Ok(())
        })
        .clone()
}

/// Whether a `tc` qdisc of this kind (`tbf`, `netem`) can be attached here: tries it on a veth in a
/// throwaway namespace. Err says why not (the kernel may lack `sch_<kind>`).
pub fn qdisc_available(kind: &str, params: &[&str]) -> Result<(), String> {
    let ns = format!("{}-probe", unique_prefix());
    ip(&["netns", "add", &ns])?;
    let r = ip(&[
        "-n", &ns, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1",
    ])
    .and_then(|_| {
        let o = bounded(
            Command::new("ip")
                .args([
                    "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "probe0", "root", kind,
                ])
                .args(params),
            CALL_LIMIT,
        )?;
        if o.status.success() {
            Ok(())
        } else {
            Err(failure(
                &format!("`tc qdisc add ... {kind}` (the kernel may lack sch_{kind})"),
                &o,
            ))
        }
    });
    let d = ip(&["netns", "delete", &ns]).map(|_| ());
    r.and(d)
}

/// The effective user id, read from /proc so no `unsafe` is needed; None when it cannot be read.
fn euid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Names of all network namespaces (`ip netns list`).
pub fn namespaces() -> Result<Vec<String>, String> {
    let o = ip(&["netns", "list"])?;
    Ok(String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

/// Removes the hosts of test runs that ended without dropping theirs (killed by a signal, say): every
/// `braidt-<pid>-<k>` set (or probe namespace) whose process no longer exists. Returns the switch and
/// probe namespaces removed.
pub fn reap_orphans() -> Result<Vec<String>, String> {
    let mut gone = Vec::new();
    for ns in namespaces()? {
        let (prefix, probe) = match (ns.strip_suffix("-sw"), ns.strip_suffix("-probe")) {
            (Some(p), _) => (p, false),
            (_, Some(p)) => (p, true),
            _ => continue,
        };
        let mut parts = prefix.splitn(3, '-');
        let (Some("braidt"), Some(pid), Some(_)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if pid.parse::<u32>().is_err() || std::path::Path::new("/proc").join(pid).exists() {
            continue;
        }
        if probe {
            ip(&["netns", "delete", &ns])?;
        } else {
            down(prefix)?;
        }
        gone.push(ns.clone());
    }
    Ok(gone)
}

/// `hosts.sh down --prefix prefix`; Err with the script's message if that failed.
fn down(prefix: &str) -> Result<(), String> {
    let o = bounded(
        Command::new("bash")
            .arg(script())
            .args(["down", "--prefix", prefix]),
        CALL_LIMIT,
    )?;
    if o.status.success() {
        Ok(())
    } else {
        Err(failure("hosts.sh down", &o))
    }
}

/// `n` hosts joined by one switch; removed on drop.
#[derive(Debug)]
pub struct Hosts {
    prefix: String,
    n: usize,
    opts: Opts,
}

impl Hosts {
    /// Brings up `n` hosts (1..=254). Err says why they could not be made, with the script's message.
    pub fn up(n: usize, opts: Opts) -> Result<Hosts, String> {
        let prefix = opts.prefix.clone().unwrap_or_else(unique_prefix);
        let mut cmd = Command::new("bash");
        cmd.arg(script())
            .args(["up", &n.to_string(), "--prefix", &prefix])
            .args(["--mtu", &opts.mtu.to_string()]);
        if let Some(r) = &opts.rate {
            cmd.args(["--rate", r]);
        }
        if let Some(d) = &opts.delay {
            cmd.args(["--delay", d]);
        }
        let o = bounded(&mut cmd, CALL_LIMIT)?;
        if !o.status.success() {
            return Err(failure(&format!("hosts.sh up {n}"), &o));
        }
        Ok(Hosts { prefix, n, opts })
    }

    /// The prefix of every namespace these hosts use.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// How many hosts.
    pub fn n(&self) -> usize {
        self.n
    }

    /// The options they were made with.
    pub fn opts(&self) -> &Opts {
        &self.opts
    }

    /// The namespace of host `i`.
    pub fn namespace(&self, i: usize) -> String {
        assert!(i < self.n, "host {i} of {}", self.n);
        format!("{}-h{i}", self.prefix)
    }

    /// The address of host `i`'s `eth0`: 198.18.0.(1+i).
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        assert!(i < self.n, "host {i} of {}", self.n);
        Ipv4Addr::new(198, 18, 0, 1 + i as u8)
    }

    /// A command that runs `program` inside host `i` (`ip netns exec`; the program replaces `ip`, so the
    /// child's pid is the program's). Add arguments, environment and stdio as for any command.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.namespace(i)]).arg(program);
        cmd
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if let Err(e) = down(&self.prefix) {
            eprintln!("removing hosts {}: {e}", self.prefix);
        }
    }
}
