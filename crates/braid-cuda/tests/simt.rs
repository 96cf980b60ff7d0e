//! The SIMT runner (tests/host/simt.hpp), which runs the `__global__` kernels on CPU threads for the
//! host tests, checked on its own under ThreadSanitizer: barriers, shared memory, warp shuffles and
//! votes, atomics, early returns and launch geometry give the results a GPU gives; and what is wrong
//! is reported, not passed: a data race (by ThreadSanitizer), a barrier some thread never reaches and
//! a shuffle whose mask leaves out a live lane (by the runner, within its deadline, never a hang).

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

use support::built_once;

fn selftest() -> Option<PathBuf> {
    static EXE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    built_once(&EXE, "simt_selftest.cpp", &["-O1", "-fsanitize=thread"])
}

fn run(exe: &PathBuf, mode: &str) -> Output {
    Command::new(exe)
        .arg(mode)
        .env("BRAID_SIMT_TIMEOUT_MS", "500")
        .env_remove("TSAN_OPTIONS")
        .output()
        .expect("running the SIMT self-test")
}

#[test]
fn kernels_using_every_feature_of_the_runner_compute_what_a_gpu_computes() {
    let Some(exe) = selftest() else { return };
    let out = run(&exe, "check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the self-test failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for name in [
        "shared-memory block sum with __syncthreads",
        "__shfl_xor_sync butterfly sum",
        "__shfl_down_sync sum into lane 0",
        "__shfl_up_sync inclusive scan",
        "__shfl_sync broadcast from lane 3",
        "__shfl_sync with width 8",
        "__shfl_xor_sync of a double",
        "__ballot_sync, __any_sync, __all_sync",
        "returned threads count as arrived at barriers and leave their warp",
        "atomicAdd, atomicMax, float atomicAdd across blocks",
        "threadIdx, blockIdx, blockDim, gridDim in three dimensions",
        "a grid larger than the thread budget",
    ] {
        assert!(
            stdout.lines().any(|l| l == format!("ok {name}")),
            "{name}: not ok\n{stdout}"
        );
    }
    assert!(
        !stderr.contains("ThreadSanitizer"),
        "ThreadSanitizer reported:\n{stderr}"
    );
}

#[test]
fn threads_writing_one_word_unsynchronised_are_a_reported_race() {
    let Some(exe) = selftest() else { return };
    let out = run(&exe, "race");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("ThreadSanitizer: data race"),
        "the race was not reported ({}):\n{stderr}",
        out.status
    );
}

#[test]
fn a_barrier_some_threads_never_reach_stops_with_a_message() {
    let Some(exe) = selftest() else { return };
    let out = run(&exe, "divergent-barrier");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("waited past BRAID_SIMT_TIMEOUT_MS"),
        "no deadline message ({}):\n{stderr}",
        out.status
    );
}

#[test]
fn a_shuffle_leaving_out_a_live_lane_is_refused() {
    let Some(exe) = selftest() else { return };
    let out = run(&exe, "partial-mask");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("__shfl_sync with mask 0xffff")
            && stderr.contains("every live lane"),
        "the partial mask was not refused ({}):\n{stderr}",
        out.status
    );
}
