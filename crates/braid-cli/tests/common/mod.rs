//! Helpers shared by the multi-process harnesses: where the binaries are, launching ranks, reading
//! /dev/shm.
#![allow(dead_code)]

pub mod netns;
pub mod scenarios;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output};

/// The `braid` binary under test.
pub fn braid() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_braid"))
}

/// This harness's own executable (which plays a rank when `BRAID_RANK` is set).
pub fn me() -> PathBuf {
    std::env::current_exe().unwrap()
}

/// The `braid-*` segments in /dev/shm, with the pid in their header (0 if it cannot be read).
pub fn braid_segments() -> Vec<(String, u32)> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("braid-") && !n.starts_with("braid-test-"))
                .map(|n| {
                    let mut hdr = [0u8; 24];
                    let pid = std::fs::File::open(PathBuf::from("/dev/shm").join(&n))
                        .and_then(|mut f| f.read_exact(&mut hdr))
                        .map_or(0, |_| u32::from_ne_bytes(hdr[20..24].try_into().unwrap()));
                    (n, pid)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// On the rank side: pretend ranks live on hosts of `TEST_RANKS_PER_HOST` ranks each (shared memory
/// inside a host, TCP between hosts) by setting `BRAID_HOST_ID` before the communicator starts.
pub fn pretend_hosts_from_env() {
    if let Ok(per) = std::env::var("TEST_RANKS_PER_HOST") {
        let rank: usize = std::env::var("BRAID_RANK").unwrap().parse().unwrap();
        let per: usize = per.parse().unwrap();
        std::env::set_var("BRAID_HOST_ID", format!("test-host-{}", rank / per));
    }
}

/// A finished process's status and output, for assertion messages.
pub fn show(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `braid run -n N -- <this harness> args...` with extra environment.
pub fn braid_run(n: usize, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(braid());
    cmd.args(["run", "-n", &n.to_string(), "--"])
        .arg(me())
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.env_remove("BRAID_RANK").output().unwrap()
}

/// A port free on the loopback interface right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
