#!/usr/bin/env bash
# Everything braid does on a GPU, in one run: the GPU tests of braid-cuda (devices, memory, pointer
# kinds, streams and events, modules, every reduce-copy kernel against braid-core bit for bit, the
# device engine against the CPU engine, the ipc transport's rings in GPU memory) with
# BRAID_REQUIRE_GPU=1, so that a missing GPU fails instead of skipping; every kernel shape timed
# against the device-to-device copy bandwidth measured in the same run; and `braid perf --device cuda`
# with 2 and 4 rank processes on the one GPU (all-reduce, then the other device collectives), every
# result checked; PyTorch CUDA tensors through the Python binding; and braid against NCCL on the same
# tensors (benches/nccl_compare.py); and the device-resident all-reduce (one kernel per collective:
# resident_bench) with 2 and 4 ranks as threads of one process and as processes under CUDA MPS, with a
# CUDA graph replay and a rank that dies mid-run. Meant to finish within 6 minutes on one GPU.
#
#   scripts/gpu-check.sh              build here and run here (needs cargo and a GPU)
#   scripts/gpu-check.sh bundle DIR   build the test binary, the bench and the sm_80/sm_90 kernel cache
#                                     into DIR (needs cargo and libnvrtc, not a GPU)
#   scripts/gpu-check.sh run DIR      run a bundle (needs a GPU, not cargo)
#
# Environment: BENCH_BYTES (default 268435456) and BENCH_ITERS (20) for the bench; BRAID_CUDA_DEVICE
# picks the device; GPU_CHECK_STAGES picks stages (default "tests kernels resident perf python nccl").
# Several processes on one GPU run under MPS, started here when nvidia-cuda-mps-control exists (and
# stopped at the end).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)

bundle() {
    local dir=$1
    mkdir -p "$dir/cache"
    dir=$(cd "$dir" && pwd)
    cd "$root"
    # The test binary's path, from cargo's own report of what it built.
    local tests
    tests=$(cargo test --release -p braid-cuda --test gpu --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
    [ -n "$tests" ] || { echo "gpu-check: building the GPU tests failed" >&2; return 1; }
    cargo build --release -q -p braid-cuda --example reduce_copy_bench --example resident_bench
    cargo build --release -q -p braid-cli -p braid-capi
    mkdir -p "$dir/python/braid" "$dir/python/tests"
    cp python/braid/*.py "$dir/python/braid/"
    cp python/tests/test_cuda.py "$dir/python/tests/"
    mkdir -p "$dir/benches"
    cp benches/nccl_compare.py "$dir/benches/"
    cp target/release/libbraid.so "$dir/python/braid/libbraid.so"
    cp "$tests" "$dir/gpu-tests"
    cp target/release/examples/reduce_copy_bench "$dir/reduce_copy_bench"
    cp target/release/examples/resident_bench "$dir/resident_bench"
    cp target/release/braid "$dir/braid"
    strip "$dir/gpu-tests" "$dir/reduce_copy_bench" "$dir/resident_bench" "$dir/braid" \
        "$dir/python/braid/libbraid.so" 2>/dev/null || true
    # The kernels compiled ahead, so the run does not wait for NVRTC: the cache is keyed by NVRTC's
    # major version, and a driver of the same major version loads a newer minor's CUBIN (where it does
    # not, the run compiles once and says so).
    for arch in 80 90; do
        BRAID_CUDA_CACHE="$dir/cache" "$dir/reduce_copy_bench" --compile-only "$arch"
        BRAID_CUDA_CACHE="$dir/cache" "$dir/resident_bench" --compile-only "$arch"
    done
    echo "gpu-check: bundle in $dir ($(du -sh "$dir" | cut -f1))"
}

# Starts the MPS daemon unless one runs; stop_mps stops the one started here.
mps_started=0
start_mps() {
    command -v nvidia-cuda-mps-control >/dev/null 2>&1 || { echo "(no nvidia-cuda-mps-control: processes time-slice)"; return 0; }
    if ! pgrep -x nvidia-cuda-mps-control >/dev/null 2>&1; then
        nvidia-cuda-mps-control -d && mps_started=1 && echo "(MPS daemon started)"
    fi
}
stop_mps() {
    if [ "$mps_started" = 1 ]; then echo quit | nvidia-cuda-mps-control; mps_started=0; fi
}

run_bundle() {
    local dir
    dir=$(cd "$1" && pwd)
    export BRAID_CUDA_CACHE="$dir/cache" BRAID_REQUIRE_GPU=1
    local stages=${GPU_CHECK_STAGES:-tests kernels resident perf python nccl}
    local start=$SECONDS failed=0
    has() { case " $stages " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
    if has tests; then
        echo "== GPU tests"
        timeout 300 "$dir/gpu-tests" --test-threads 1 --nocapture || failed=1
    fi
    if has kernels; then
        echo "== reduce-copy kernels against the device-to-device copy"
        timeout 120 "$dir/reduce_copy_bench" --bytes "${BENCH_BYTES:-268435456}" --iters "${BENCH_ITERS:-20}" || failed=1
    fi
    if has resident; then
        for ranks in 2 4; do
            echo "== device-resident all-reduce, $ranks ranks as threads of one process"
            timeout 120 "$dir/resident_bench" --ranks "$ranks" || failed=1
        done
        start_mps
        for ranks in 2 4; do
            echo "== device-resident all-reduce, $ranks rank processes (MPS)"
            timeout 120 "$dir/resident_bench" --procs --ranks "$ranks" || failed=1
        done
        echo "== device-resident all-reduce, rank 1 of 2 processes dies mid-run: rank 0 must report it"
        local t0=$SECONDS
        if timeout 60 "$dir/resident_bench" --procs --ranks 2 --die 1 --timeout-ms 2000 --max 1048576; then
            echo "FAILED: the run with a dead rank succeeded"; failed=1
        else
            echo "(ended with an error after $((SECONDS - t0)) s, as it should)"
        fi
        nvidia-smi --query-compute-apps=pid,name --format=csv,noheader 2>/dev/null | sed 's/^/(left on the GPU) /'
    fi
    if has perf; then
        start_mps
        for ranks in 2 4; do
            echo "== braid perf --device cuda, $ranks ranks on one GPU"
            timeout 120 "$dir/braid" perf --ranks "$ranks" --device cuda -b 8 -e 256M -f 4 -n 20 -w 5 || failed=1
        done
        for c in broadcast all_gather reduce_scatter; do
            echo "== braid perf --device cuda --collective $c, 4 ranks"
            timeout 120 "$dir/braid" perf --ranks 4 --device cuda --collective "$c" -b 1K -e 64M -f 16 -n 10 -w 2 || failed=1
        done
    fi
    if has python; then
        echo "== PyTorch CUDA tensors through the Python binding, 2 ranks"
        timeout 120 "$dir/braid" run -n 2 -- python3 "$dir/python/tests/test_cuda.py" || failed=1
    fi
    if has nccl; then
        for ranks in 2 4; do
            echo "== braid vs NCCL all-reduce, $ranks ranks on one GPU"
            SIZES=${NCCL_SIZES:-8:256M:8} timeout 120 "$dir/braid" run -n "$ranks" -- python3 "$dir/benches/nccl_compare.py" || failed=1
        done
    fi
    stop_mps
    echo "gpu-check: $([ $failed = 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s"
    return $failed
}

case "${1:-}" in
bundle) bundle "${2:?usage: gpu-check.sh bundle DIR}" ;;
run) run_bundle "${2:?usage: gpu-check.sh run DIR}" ;;
"")
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    bundle "$tmp"
    run_bundle "$tmp"
    ;;
*)
    echo "usage: gpu-check.sh [bundle DIR | run DIR]" >&2
    exit 2
    ;;
esac
