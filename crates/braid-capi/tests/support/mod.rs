//! What the C and Python tests share: building `libbraid.so` and the `braid` launcher, and running a
//! program as every rank of `braid run -n N`.
//!
//! The C tests need the cdylib and another package's binary, neither of which cargo hands to an
//! integration test, so the test builds them with the cargo that is running it (see [`artifacts`]):
//! a no-op when they are up to date, and never stale. Test binaries run after cargo has finished
//! building and released its lock, so the nested build cannot deadlock.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

#[allow(unused_imports)] // each test target uses its own part
pub use braid_testkit::process::show;
#[allow(unused_imports)] // each test target uses its own part
pub use braid_testkit::tools::{have, require, tools_required, unavailable};

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

/// The flags that make `cargo build` put its output where this test binary's build did and with the
/// same profile: `--target-dir` (the nearest directory above holding cargo's `CACHEDIR.TAG`), `--target`
/// when the build was for an explicit target (`target/<triple>/<profile>`), and `--profile` (`test`,
/// as `cargo test` uses for every unit, for `target/debug`; the directory's name otherwise).
fn same_output_flags() -> Vec<String> {
    let dir = profile_dir();
    let target_dir = dir
        .ancestors()
        .find(|d| d.join("CACHEDIR.TAG").is_file())
        .unwrap_or_else(|| dir.parent().expect("target/<profile>"))
        .to_path_buf();
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "test".to_string(),
        Some(name) => name.to_string(),
    };
    let mut flags = vec![
        "--target-dir".to_string(),
        target_dir.display().to_string(),
        "--profile".to_string(),
        profile,
    ];
    let parent = dir.parent().expect("target/<profile>");
    if parent != target_dir {
        if let Some(triple) = parent.file_name().and_then(|n| n.to_str()) {
            flags.extend(["--target".to_string(), triple.to_string()]);
        }
    }
    flags
}

/// What the `cargo test` running this binary selected, read from its parent process's command line:
/// the directory it ran in and its package, feature and lock flags.
struct Outer {
    dir: PathBuf,
    flags: Vec<String>,
    /// Whether its selection builds braid-cli's integration tests, and so the `braid` binary.
    has_launcher: bool,
}

impl Outer {
    /// None when the parent is not a `cargo test` (a test runner, or the binary run by hand).
    fn read() -> Option<Outer> {
        let ppid = std::os::unix::process::parent_id();
        let cmdline = std::fs::read(format!("/proc/{ppid}/cmdline")).ok()?;
        let dir = std::fs::read_link(format!("/proc/{ppid}/cwd")).ok()?;
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .take_while(|a| a != "--")
            .collect();
        let program = Path::new(args.first()?).file_name()?.to_str()?;
        if !program.starts_with("cargo") {
            return None;
        }
        let at = args.iter().position(|a| a == "test" || a == "t")?;
        let mut flags = Vec::new();
        let (mut packages, mut excluded, mut whole) = (Vec::new(), Vec::new(), false);
        let mut rest = args[at + 1..].iter();
        while let Some(arg) = rest.next() {
            let (name, inline) = match arg.split_once('=') {
                Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
                _ => match arg.as_str() {
                    a if a.len() > 2 && (a.starts_with("-p") || a.starts_with("-F")) => {
                        (&a[..2], Some(a[2..].to_string()))
                    }
                    a => (a, None),
                },
            };
            match name {
                "--workspace" | "--all" => whole = true,
                "--all-features"
                | "--no-default-features"
                | "--locked"
                | "--offline"
                | "--frozen" => flags.push(name.to_string()),
                "-p" | "--package" | "--exclude" | "-F" | "--features" => {
                    let value = inline.or_else(|| rest.next().cloned())?;
                    match name {
                        "-p" | "--package" => packages.push(value.clone()),
                        "--exclude" => excluded.push(value.clone()),
                        _ => {}
                    }
                    flags.extend([name.to_string(), value]);
                }
                _ => {}
            }
        }
        // Without -p, cargo at the root of this virtual workspace tests every member.
        whole |= packages.is_empty() && dir == workspace();
        if whole {
            flags.push("--workspace".to_string());
        }
        let has_launcher = packages.iter().any(|p| p == "braid-cli")
            || (whole && !excluded.iter().any(|p| p == "braid-cli"));
        Some(Outer {
            dir,
            flags,
            has_launcher,
        })
    }
}

/// Runs `cargo build` with `args` in `dir`; fails the test with cargo's message if it fails.
fn cargo_build(dir: &Path, args: &[String]) {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.arg("build")
        .args(same_output_flags())
        .args(args)
        .current_dir(dir);
    let start = std::time::Instant::now();
    let out = cmd.output().expect("running cargo build");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "cargo build {} took {:.1} s",
        args.join(" "),
        start.elapsed().as_secs_f64()
    );
}

/// Builds libbraid and the launcher once per test binary; returns (the `braid` binary, the directory
/// holding `libbraid.so`).
///
/// The build reuses what the `cargo test` running this binary compiled: same target directory and
/// profile, and the same packages, features and dev-dependencies (`--lib --tests` with its selection),
/// so cargo resolves every crate's features as it did and only adds the cdylib. Where that selection
/// leaves out braid-cli (as `cargo test -p braid-capi` does), `-p braid-cli --bins` builds the launcher
/// on its own, which takes long the first time only.
pub fn artifacts() -> &'static (PathBuf, PathBuf) {
    static BUILT: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    BUILT.get_or_init(|| {
        let outer = Outer::read().unwrap_or_else(|| Outer {
            dir: workspace(),
            flags: vec!["-p".to_string(), "braid-capi".to_string()],
            has_launcher: false,
        });
        let mut args = outer.flags.clone();
        args.extend(["--lib".to_string(), "--tests".to_string()]);
        cargo_build(&outer.dir, &args);
        if !outer.has_launcher {
            cargo_build(
                &workspace(),
                &["-p", "braid-cli", "--bins"].map(String::from),
            );
        }
        let dir = profile_dir();
        let braid = dir.join("braid");
        let lib = dir.join("libbraid.so");
        assert!(braid.exists(), "{} was not built", braid.display());
        assert!(lib.exists(), "{} was not built", lib.display());
        (braid, dir)
    })
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
