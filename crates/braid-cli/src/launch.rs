//! `braid run`: start N ranks of a program on this host, as torchrun or mpirun do, and stop them all
//! when one fails.

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use braid::UniqueId;

/// Set by the signal handler: the signal the launcher received (0 = none).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => "ended".to_string(),
    }
}

/// Sends `sig` to the process group of every child still running.
fn signal_all(children: &[(usize, Child)], done: &[bool], sig: libc::c_int) {
    for (i, (_, c)) in children.iter().enumerate() {
        if !done[i] {
            // SAFETY: kill(2) on a process group we created (each child leads its own group).
            unsafe {
                libc::kill(-(c.id() as libc::pid_t), sig);
            }
        }
    }
}

/// Runs `program args` as `n` ranks; returns the launcher's exit code.
pub fn run(n: usize, program: &OsString, args: &[OsString], extra_env: &[(String, String)]) -> i32 {
    if n == 0 {
        eprintln!("braid run: -n must be at least 1");
        return 2;
    }
    // The launcher binds the root's port and hands the listening socket to rank 0 (`BRAID_ROOT_FD`),
    // so no other socket can take the port between choosing it and rank 0 listening on it.
    let listener = match TcpListener::bind((Ipv4Addr::LOCALHOST, 0)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("braid run: no free local port for the bootstrap: {e}");
            return 1;
        }
    };
    let port = match listener.local_addr() {
        Ok(a) => a.port(),
        Err(e) => {
            eprintln!("braid run: the bootstrap listener has no address: {e}");
            return 1;
        }
    };
    let mut listener = Some(listener);
    let id = match UniqueId::unbound(SocketAddr::from((Ipv4Addr::LOCALHOST, port))) {
        Ok(id) => id,
        Err(e) => {
            eprintln!("braid run: {e}");
            return 1;
        }
    };
    // torch.distributed's variables too, so that `init_process_group` (any backend, braid's included)
    // works under `braid run` as under torchrun: its store gets a port of its own, never braid's.
    let torch_port = match TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).and_then(|l| l.local_addr())
    {
        Ok(a) => a.port(),
        Err(e) => {
            eprintln!("braid run: no free local port for torch's store (MASTER_PORT): {e}");
            return 1;
        }
    };
    // SAFETY: installing an async-signal-safe handler (it only stores to an atomic).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("BRAID_RANK", rank.to_string())
            .env("BRAID_WORLD_SIZE", n.to_string())
            .env("BRAID_LOCAL_RANK", rank.to_string())
            .env("BRAID_LOCAL_WORLD_SIZE", n.to_string())
            .env("BRAID_ROOT", id.addr().to_string())
            .env("BRAID_SECRET", id.secret_hex())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", Ipv4Addr::LOCALHOST.to_string())
            .env("MASTER_PORT", torch_port.to_string())
            .envs(extra_env.iter().map(|(k, v)| (k, v)))
            .process_group(0);
        if rank == 0 {
            if let Some(l) = &listener {
                let fd = l.as_raw_fd();
                cmd.env("BRAID_ROOT_FD", fd.to_string());
                // SAFETY: between fork and exec only fcntl(2), which is async-signal-safe, runs: it
                // lets rank 0 inherit the listening socket.
                unsafe {
                    cmd.pre_exec(move || {
                        if libc::fcntl(fd, libc::F_SETFD, 0) == 0 {
                            Ok(())
                        } else {
                            Err(std::io::Error::last_os_error())
                        }
                    });
                }
            }
        }
        let spawned = cmd.spawn();
        if rank == 0 {
            // Rank 0 holds the socket now; the launcher's copy goes, so the port closes with rank 0.
            drop(listener.take());
        }
        match spawned {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                eprintln!(
                    "braid run: cannot start rank {rank} ({}): {e}",
                    program.to_string_lossy()
                );
                let done = vec![false; children.len()];
                signal_all(&children, &done, libc::SIGKILL);
                for (_, c) in &mut children {
                    let _ = c.wait();
                }
                return 1;
            }
        }
    }
    let mut done = vec![false; n];
    let mut failure: Option<String> = None;
    let mut kill_at: Option<Instant> = None;
    let grace = Duration::from_secs(3);
    while done.iter().any(|d| !d) {
        for (i, (rank, c)) in children.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            match c.try_wait() {
                Ok(Some(status)) => {
                    done[i] = true;
                    if !status.success() && failure.is_none() {
                        failure = Some(format!("rank {rank} {}", describe(status)));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    done[i] = true;
                    failure.get_or_insert(format!("rank {rank}: cannot wait for it: {e}"));
                }
            }
        }
        let sig = SIGNALLED.swap(0, Ordering::SeqCst);
        if sig != 0 && failure.is_none() {
            failure = Some(format!("the launcher received signal {sig}"));
        }
        if failure.is_some() && kill_at.is_none() {
            signal_all(&children, &done, libc::SIGTERM);
            kill_at = Some(Instant::now() + grace);
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            signal_all(&children, &done, libc::SIGKILL);
            kill_at = Some(Instant::now() + grace);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    match failure {
        None => 0,
        Some(f) => {
            eprintln!("braid run: {f}; the other ranks were stopped");
            1
        }
    }
}
