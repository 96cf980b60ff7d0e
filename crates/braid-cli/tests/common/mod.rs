//! Helpers shared by the multi-process harnesses: where the binaries are, launching ranks, reading
//! /dev/shm, and running cases through libtest-mimic (so `cargo test FILTER`, `--exact`, `--list` and
//! `--ignored` work as with the built-in harness).
#![allow(dead_code)]

pub mod netns;
pub mod scenarios;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output};

use libtest_mimic::{Arguments, Completion, Failed, Trial};

#[allow(unused_imports)] // each test target uses its own part
pub use braid_testkit::process::show;
pub use braid_testkit::tools::{required_but_unavailable, tools_required};

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

/// The outcome of a case that cannot run here because of `why` (a missing tool or privilege): ignored,
/// shown as `ignored (cannot run here: why)`, or a failure naming `why` under `BRAID_REQUIRE_TOOLS=1`.
pub fn unavailable(why: &str) -> Result<Completion, Failed> {
    if tools_required() {
        Err(required_but_unavailable(why).into())
    } else {
        Ok(Completion::ignored_with(format!("cannot run here: {why}")))
    }
}

/// A case that passes when it returns and fails when it panics.
pub fn case(name: &str, run: fn()) -> Trial {
    Trial::test(name, move || {
        run();
        Ok(())
    })
}

/// A case that may find it cannot run here: `Err(why)` from `run` is handed to [`unavailable`].
pub fn case_needing(
    name: &str,
    run: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> Trial {
    Trial::ignorable_test(name, move || match run() {
        Ok(()) => Ok(Completion::Completed),
        Err(why) => unavailable(&why),
    })
}

/// This harness's command line for libtest-mimic, one case at a time (unless `--test-threads` says
/// otherwise): the cases spawn many processes each and several judge what all of them left behind.
pub fn arguments() -> Arguments {
    let mut args = Arguments::from_args();
    args.test_threads.get_or_insert(1);
    args
}

/// A last case: no braid segment in /dev/shm that was not there in `before` (as [`braid_segments`]
/// read it when the harness started) and that `ours` accepts.
pub fn no_segments_left(
    name: &str,
    before: Vec<(String, u32)>,
    ours: impl Fn(&(String, u32)) -> bool + Send + 'static,
) -> Trial {
    Trial::test(name, move || {
        let new: Vec<_> = braid_segments()
            .into_iter()
            .filter(|s| !before.contains(s))
            .collect();
        let leaked: Vec<_> = new.iter().filter(|s| ours(s)).collect();
        if new.len() > leaked.len() {
            println!(
                "  (ignored: {} new braid segment(s) of other processes)",
                new.len() - leaked.len()
            );
        }
        if leaked.is_empty() {
            Ok(())
        } else {
            Err(format!("shared-memory segments left in /dev/shm: {leaked:?}").into())
        }
    })
}
