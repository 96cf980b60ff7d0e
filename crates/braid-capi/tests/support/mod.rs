//! What the C and Python tests share: building `libbraid.so` and the `braid` launcher, and running a
//! program as every rank of `braid run -n N`.
//!
//! The C tests need the cdylib and another package's binary, neither of which cargo hands to an
//! integration test, so the test builds them with the cargo that is running it (`$CARGO build -p
//! braid-capi -p braid-cli`): a no-op when they are up to date, and never stale. Test binaries run after
//! cargo has finished building and released its lock, so the nested build cannot deadlock.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

/// `target/<profile>`: where this test binary lives (`target/<profile>/deps/<test>`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// Builds libbraid and the launcher once per test binary; returns (the `braid` binary, the directory
/// holding `libbraid.so`).
pub fn artifacts() -> &'static (PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = profile_dir();
        // The test profile, as `cargo test` uses, so the build reuses what that already compiled.
        let profile = if dir.file_name().is_some_and(|n| n == "release") {
            "release"
        } else {
            "test"
        };
        let out = Command::new(env!("CARGO"))
            .args([
                "build",
                "--profile",
                profile,
                "-p",
                "braid-capi",
                "-p",
                "braid-cli",
            ])
            .current_dir(workspace())
            .output()
            .expect("running cargo build");
        assert!(
            out.status.success(),
            "cargo build -p braid-capi -p braid-cli failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let braid = dir.join("braid");
        let lib = dir.join("libbraid.so");
        assert!(braid.exists(), "{} was not built", braid.display());
        assert!(lib.exists(), "{} was not built", lib.display());
        (braid, dir)
    })
}

/// Status and output, for assertion messages.
pub fn show(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `braid run -n N -- program args...` with `LD_LIBRARY_PATH` and `BRAID_LIBRARY` set to the built
/// library, a bounded timeout, and `env` on top.
pub fn braid_run(n: usize, program: &[&str], env: &[(&str, &str)]) -> Output {
    let (braid, libdir) = artifacts();
    let mut cmd = Command::new(braid);
    cmd.args(["run", "-n", &n.to_string(), "--"])
        .args(program)
        .env("LD_LIBRARY_PATH", libdir)
        .env("BRAID_LIBRARY", libdir.join("libbraid.so"))
        .env("BRAID_TIMEOUT_MS", "60000")
        .env_remove("BRAID_RANK");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("running braid run")
}

/// Whether `program --version` runs.
pub fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}
