//! The C tests (`tests/c/*.c`): compiled with gcc under AddressSanitizer and UndefinedBehaviorSanitizer
//! against `include/braid.h` and `libbraid.so`, and run as every rank of `braid run -n 2` and `-n 4`.
//! Any sanitizer report fails the test: ASan and UBSan stop the process (no recovery), LeakSanitizer
//! runs at exit, and the output is searched for reports as well.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::{artifacts, braid_run, profile_dir, require, show};

const SANITIZERS: &str = "address,undefined";

/// Compiles `tests/c/<name>.c` into `target/<profile>/capi-c-tests/<name>`.
fn compile(name: &str) -> PathBuf {
    let (_, libdir) = artifacts();
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out_dir = profile_dir().join("capi-c-tests");
    std::fs::create_dir_all(&out_dir).unwrap();
    let exe = out_dir.join(name);
    let out = Command::new("gcc")
        .args(["-std=gnu11", "-g", "-O1", "-Wall", "-Wextra", "-Werror"])
        .arg(format!("-fsanitize={SANITIZERS}"))
        .args(["-fno-sanitize-recover=all", "-fno-omit-frame-pointer"])
        .arg("-I")
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("tests/c").join(format!("{name}.c")))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(libdir)
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .args(["-lbraid", "-lm", "-pthread"])
        .output()
        .expect("running gcc");
    assert!(out.status.success(), "gcc {name}.c failed:\n{}", show(&out));
    exe
}

const ASAN_OPTIONS: &str =
    "detect_leaks=1:halt_on_error=1:exitcode=23:detect_stack_use_after_return=1";
const UBSAN_OPTIONS: &str = "halt_on_error=1:print_stacktrace=1";

/// Fails on an unsuccessful exit or any sanitizer report in the output.
fn assert_clean(what: &str, out: &std::process::Output) {
    let text = show(out);
    assert!(out.status.success(), "{what} failed:\n{text}");
    for report in [
        "AddressSanitizer",
        "LeakSanitizer",
        "runtime error:",
        "UndefinedBehaviorSanitizer",
    ] {
        assert!(!text.contains(report), "{what}: sanitizer report:\n{text}");
    }
}

/// Runs a C test on `n` ranks under the sanitizers; returns its stdout.
fn run_c(name: &str, n: usize) -> String {
    let exe = compile(name);
    let out = braid_run(
        n,
        &[exe.to_str().unwrap()],
        &[
            ("ASAN_OPTIONS", ASAN_OPTIONS),
            ("UBSAN_OPTIONS", UBSAN_OPTIONS),
        ],
    );
    assert_clean(&format!("{name} on {n} ranks"), &out);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn gcc_or_say_why() -> bool {
    require("gcc", "the C tests")
}

#[test]
fn collectives_on_2_and_4_ranks_under_sanitizers() {
    if !gcc_or_say_why() {
        return;
    }
    for n in [2, 4] {
        let out = run_c("collectives", n);
        for r in 0..n {
            assert!(
                out.contains(&format!("rank {r}: collectives ok")),
                "rank {r} of {n} did not finish:\n{out}"
            );
        }
    }
}

#[test]
fn compressed_all_reduce_on_2_and_4_ranks_under_sanitizers() {
    if !gcc_or_say_why() {
        return;
    }
    for n in [2, 4] {
        let out = run_c("compressed", n);
        for r in 0..n {
            assert!(
                out.contains(&format!("rank {r}: compressed ok")),
                "rank {r} of {n} did not finish:\n{out}"
            );
        }
    }
}

#[test]
fn hostile_input_is_rejected_without_effect_under_sanitizers() {
    if !gcc_or_say_why() {
        return;
    }
    for n in [2, 4] {
        let out = run_c("hostile", n);
        for r in 0..n {
            assert!(
                out.contains(&format!("rank {r}: 64 hostile cases ok")),
                "rank {r} of {n} did not finish:\n{out}"
            );
        }
    }
}

/// Installs header, one library file and `braid.pc` (from the template) into a fresh prefix, as the
/// C ABI page of the docs (`docs/src/c-abi.md`) says; returns the prefix.
fn stage(name: &str, lib: &str) -> PathBuf {
    let (_, libdir) = artifacts();
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let prefix = profile_dir().join(name);
    let _ = std::fs::remove_dir_all(&prefix);
    std::fs::create_dir_all(prefix.join("include")).unwrap();
    std::fs::create_dir_all(prefix.join("lib/pkgconfig")).unwrap();
    std::fs::copy(
        crate_dir.join("include/braid.h"),
        prefix.join("include/braid.h"),
    )
    .unwrap();
    let (from, to) = (libdir.join(lib), prefix.join("lib").join(lib));
    if std::fs::hard_link(&from, &to).is_err() {
        std::fs::copy(&from, &to).unwrap();
    }
    let pc = std::fs::read_to_string(crate_dir.join("braid.pc.in"))
        .unwrap()
        .replace("@PREFIX@", prefix.to_str().unwrap())
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
    std::fs::write(prefix.join("lib/pkgconfig/braid.pc"), pc).unwrap();
    prefix
}

/// Builds the README's example with the flags `pkg-config` gives for `prefix` and runs it on 2 ranks.
fn build_and_run_example(prefix: &Path, pkg_config_args: &[&str]) {
    let flags = Command::new("pkg-config")
        .args(pkg_config_args)
        .args(["--cflags", "--libs", "braid"])
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .output()
        .unwrap();
    assert!(flags.status.success(), "pkg-config: {}", show(&flags));
    let flags = String::from_utf8(flags.stdout).unwrap();
    assert!(flags.contains("-lbraid"), "{flags}");
    let exe = prefix.join("example");
    let out = Command::new("gcc")
        .args(["-Wall", "-Werror"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/example.c"))
        .args(flags.split_whitespace())
        .arg(format!("-Wl,-rpath,{}", prefix.join("lib").display()))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gcc example.c {flags}: {}",
        show(&out)
    );
    let out = braid_run(2, &[exe.to_str().unwrap()], &[]);
    let text = show(&out);
    assert!(out.status.success(), "{text}");
    for r in 0..2 {
        assert!(text.contains(&format!("rank {r} of 2: mean 0.5")), "{text}");
    }
}

#[test]
fn readme_example_builds_with_pkg_config_shared_and_static() {
    if !gcc_or_say_why() {
        return;
    }
    if !require("pkg-config", "the README example's build") {
        return;
    }
    build_and_run_example(&stage("capi-prefix-shared", "libbraid.so"), &[]);
    // Only the archive installed: `--static` adds the system libraries it needs (Libs.private).
    build_and_run_example(&stage("capi-prefix-static", "libbraid.a"), &["--static"]);
}

#[test]
fn ranks_as_threads_and_abort_from_another_thread_under_sanitizers() {
    if !gcc_or_say_why() {
        return;
    }
    let exe = compile("threads");
    let (_, libdir) = artifacts();
    let out = Command::new(&exe)
        .env("LD_LIBRARY_PATH", libdir)
        .env("ASAN_OPTIONS", ASAN_OPTIONS)
        .env("UBSAN_OPTIONS", UBSAN_OPTIONS)
        .env_remove("BRAID_RANK")
        .output()
        .unwrap();
    assert_clean("threads", &out);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("threads ok"),
        "{}",
        show(&out)
    );
}

#[test]
fn the_library_exports_exactly_the_functions_the_header_declares() {
    if !require("nm", "the check of the library's exports (binutils)") {
        return;
    }
    let (_, libdir) = artifacts();
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(libdir.join("libbraid.so"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let mut exported: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [_, "T", name] if name.starts_with("braid_") => Some(name.to_string()),
            _ => None,
        })
        .collect();
    exported.sort();
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/braid.h"))
            .unwrap();
    let mut declared: Vec<String> = header
        .lines()
        .filter_map(|l| {
            let name = l.split('(').next()?.split_whitespace().last()?;
            let name = name.trim_start_matches('*');
            (l.contains('(') && name.starts_with("braid_") && !l.trim_start().starts_with('*'))
                .then(|| name.to_string())
        })
        .collect();
    declared.sort();
    declared.dedup();
    assert!(
        exported.len() >= 30,
        "only {} exports: {exported:?}",
        exported.len()
    );
    assert_eq!(exported, declared, "exports of libbraid.so vs braid.h");
}
