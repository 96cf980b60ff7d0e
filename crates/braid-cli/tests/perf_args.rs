//! `braid perf` and `braid compress-bench` arguments: what is refused, how briefly, and that the memory
//! bound measurement does not hold the other ranks up.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn braid(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_braid"));
    cmd.args(args).env_remove("BRAID_RANK");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn show(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn a_step_factor_below_two_is_refused() {
    for f in ["0", "1"] {
        let o = braid(
            &["perf", "--ranks", "2", "-b", "8", "-e", "64", "-f", f],
            &[],
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.code() == Some(2) && err.contains("-f") && err.contains("at least 2"),
            "{}",
            show(&o)
        );
        assert!(o.stdout.is_empty(), "it measured something:\n{}", show(&o));
    }
}

#[test]
fn a_long_codec_spec_gives_a_short_error() {
    let spec = "x".repeat(20_000);
    let o = braid(&["compress-bench", "--codecs", &spec], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{}", &err[..err.len().min(500)]);
    // What the message says about the input is short; the list of accepted forms follows it.
    let about_input = err.split("; accepted:").next().unwrap_or_default();
    assert!(
        about_input.len() < 300 && err.len() < 600,
        "{} bytes of error, {} before the accepted forms",
        err.len(),
        about_input.len()
    );
    assert!(err.contains("20000 characters"), "{err}");
    assert!(err.contains("xxxxxxxx"), "{err}");
}

#[test]
fn many_iterations_do_not_time_out_the_ranks_waiting_for_the_memory_bound() {
    // Rank 0 measures the memory bound while the others wait at a barrier; with -n iterations of it, at
    // 16 MiB, that wait would outlast a one-second timeout.
    let start = Instant::now();
    let o = braid(
        &[
            "perf", "--ranks", "2", "-b", "16M", "-e", "16M", "-n", "400", "-w", "0", "-c", "0",
        ],
        &[("BRAID_TIMEOUT_MS", "1000")],
    );
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("16777216"),
        "{}",
        show(&o)
    );
    assert!(
        start.elapsed() < Duration::from_secs(120),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn an_unknown_collective_is_refused_with_the_valid_names() {
    for bad in ["gather", "barrier", "all_reducex"] {
        let o = braid(&["perf", "--ranks", "2", "--collective", bad], &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{}", show(&o));
        assert!(err.contains(bad), "{}", show(&o));
        for name in [
            "all_reduce",
            "broadcast",
            "reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
        ] {
            assert!(err.contains(name), "{name} is not listed:\n{}", show(&o));
        }
        assert!(o.stdout.is_empty(), "it measured something:\n{}", show(&o));
    }
}

#[test]
fn an_algorithm_the_collective_lacks_is_refused() {
    let o = braid(
        &[
            "perf",
            "--ranks",
            "2",
            "--collective",
            "broadcast",
            "--algo",
            "rhd",
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.code() == Some(2)
            && err.contains("rhd")
            && err.contains("ring")
            && err.contains("tree"),
        "{}",
        show(&o)
    );
    assert!(o.stdout.is_empty(), "it measured something:\n{}", show(&o));
}

#[test]
fn a_collective_may_be_spelled_without_underscores() {
    let o = braid(
        &[
            "perf",
            "--ranks",
            "2",
            "--collective",
            "allgather",
            "-b",
            "64",
            "-e",
            "64",
            "-n",
            "1",
            "-w",
            "0",
        ],
        &[],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", show(&o));
    assert!(
        out.starts_with("# braid perf: all_gather,") && out.contains("Out of bounds values : 0 OK"),
        "{}",
        show(&o)
    );
}

#[test]
fn device_memory_runs_every_device_collective_exactly_across_processes() {
    // Emulated device memory: the ipc transport's rings shared by descriptor between the rank
    // processes, kernels run late by the emulated engine; every result is checked.
    for collective in [
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "reduce_scatter",
    ] {
        let o = braid(
            &[
                "perf",
                "--ranks",
                "3",
                "--device",
                "emulated",
                "--collective",
                collective,
                "-b",
                "8",
                "-e",
                "256K",
                "-f",
                "8",
                "-n",
                "2",
                "-w",
                "1",
                "-d",
                "bfloat16",
            ],
            &[],
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{collective}: {}", show(&o));
        assert!(
            out.contains("# buffers in emulated device memory, 3 ranks through ipc")
                && out.contains("Out of bounds values : 0 OK"),
            "{collective}: {}",
            show(&o)
        );
    }
}

#[test]
fn device_options_braid_cannot_honour_are_refused() {
    let o = braid(&["perf", "--ranks", "2", "--device", "tpu"], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.code() == Some(2)
            && err.contains("unknown device \"tpu\"")
            && err.contains("emulated"),
        "{}",
        show(&o)
    );
    for extra in [&["--collective", "all_to_all"][..], &["--algo", "ring"][..]] {
        let mut args = vec![
            "perf", "--ranks", "2", "--device", "emulated", "-b", "64", "-e", "64",
        ];
        args.extend_from_slice(extra);
        let o = braid(&args, &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success()
                && (err.contains("does not run on device memory yet") || err.contains("--algo")),
            "{extra:?}: {}",
            show(&o)
        );
    }
}
