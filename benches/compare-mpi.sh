#!/usr/bin/env bash
# Side-by-side all-reduce benchmark: braid against Open MPI on the same machine.
#
# Usage: benches/compare-mpi.sh [RANKS...]        (default: 2 4)
#
# Environment:
#   SIZES         size sweep passed to both tools (default "-b 8 -e 64M -f 2")
#   ITERS         timed iterations per size (default 20)
#   WARMUP        warm-up iterations per size (default 5)
#   MPIRUN_FLAGS  extra mpirun flags (default "--allow-run-as-root --oversubscribe")
#   LAT_ITERS     iterations of the 8-byte latency pass (default 50000; 0 skips the pass)
#   LAT_ROUNDS    alternated braid/MPI rounds of that pass (default 5)
#   BRAID_PERF_FLAGS  extra flags of braid perf, such as --shared (buffers from Communicator::alloc)
#
# Results go to target/bench/{braid,mpi}-N.json; see benches/README.md.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
    echo "compare-mpi: skipped: mpicc/mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    exit 0
fi

SIZES="${SIZES:--b 8 -e 64M -f 2}"
ITERS="${ITERS:-20}"
WARMUP="${WARMUP:-5}"
MPIRUN_FLAGS="${MPIRUN_FLAGS:---allow-run-as-root --oversubscribe}"
LAT_ITERS="${LAT_ITERS:-50000}"
LAT_ROUNDS="${LAT_ROUNDS:-5}"
BRAID_PERF_FLAGS="${BRAID_PERF_FLAGS:-}"

read -r -a size_args <<<"$SIZES"
read -r -a mpirun_flags <<<"$MPIRUN_FLAGS"
read -r -a braid_flags <<<"$BRAID_PERF_FLAGS"
if [ "$#" -gt 0 ]; then
    ranks_list=("$@")
else
    ranks_list=(2 4)
fi
for v in LAT_ITERS LAT_ROUNDS; do
    if ! [[ "${!v}" =~ ^[0-9]+$ ]]; then
        echo "compare-mpi: $v must be a non-negative integer, got '${!v}'" >&2
        exit 2
    fi
done
for n in "${ranks_list[@]}"; do
    if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
        echo "compare-mpi: rank count must be a positive integer, got '$n'" >&2
        exit 2
    fi
done

bench_dir=target/bench
harness="$bench_dir/allreduce_mpi"
braid_bin="${CARGO_TARGET_DIR:-target}/release/braid"
mkdir -p "$bench_dir"

echo "== building the MPI harness ($harness)"
mpicc -O2 -Wall -Wextra -Werror -o "$harness" benches/mpi/allreduce_mpi.c

echo "== building braid (cargo build --release --bin braid)"
cargo build --release --bin braid

# Some containers forbid the cross-process copies (CMA) Open MPI's shared
# memory transport uses by default; fall back to copy-in/copy-out then.
if ! mpirun "${mpirun_flags[@]}" -np 2 "$harness" -b 1M -e 1M -n 1 -w 0 >/dev/null 2>&1; then
    echo "compare-mpi: mpirun probe failed; retrying without single-copy (CMA)" >&2
    mpirun_flags+=(--mca btl_vader_single_copy_mechanism none)
    if ! mpirun "${mpirun_flags[@]}" -np 2 "$harness" -b 1M -e 1M -n 1 -w 0 >/dev/null; then
        echo "compare-mpi: mpirun does not work here (flags: ${mpirun_flags[*]})" >&2
        exit 1
    fi
fi

status=0
# Runs a step that writes $1; a non-zero exit is tolerated (and remembered)
# when the JSON was still written, e.g. a run that reported wrong results.
run_step() {
    local json="$1"
    shift
    rm -f "$json"
    if "$@"; then
        return 0
    fi
    if [ -s "$json" ]; then
        echo "compare-mpi: '$1' failed; comparing what it wrote" >&2
        status=1
        return 0
    fi
    echo "compare-mpi: '$1' failed without writing $json" >&2
    exit 1
}

for n in "${ranks_list[@]}"; do
    braid_json="$bench_dir/braid-$n.json"
    mpi_json="$bench_dir/mpi-$n.json"
    echo
    echo "================ $n ranks: $SIZES, iters $ITERS, warmup $WARMUP ================"
    echo "---- braid"
    run_step "$braid_json" "$braid_bin" perf --ranks "$n" "${size_args[@]}" \
        -n "$ITERS" -w "$WARMUP" "${braid_flags[@]}" --json "$braid_json"
    echo "---- Open MPI (mpirun ${mpirun_flags[*]} -np $n)"
    run_step "$mpi_json" mpirun "${mpirun_flags[@]}" -np "$n" "$harness" "${size_args[@]}" \
        -n "$ITERS" -w "$WARMUP" -j "$mpi_json"
    echo "---- braid vs Open MPI, $n ranks"
    python3 benches/compare.py "$braid_json" "$mpi_json" || status=1
done

# The sweep's few iterations time an 8-byte call over microseconds: noise. Latency gets its own pass,
# many iterations per run, braid and MPI alternated round by round so that both see the same machine.
if [ "$LAT_ITERS" -gt 0 ] && [ "$LAT_ROUNDS" -gt 0 ]; then
    for n in "${ranks_list[@]}"; do
        echo
        echo "================ $n ranks: 8-byte all-reduce latency, $LAT_ROUNDS alternated rounds of $LAT_ITERS iterations ================"
        lat_dir="$bench_dir/latency-$n"
        rm -rf "$lat_dir"
        mkdir -p "$lat_dir"
        for r in $(seq 1 "$LAT_ROUNDS"); do
            run_step "$lat_dir/braid-$r.json" "$braid_bin" perf --ranks "$n" -b 8 -e 8 \
                -n "$LAT_ITERS" -w 1000 "${braid_flags[@]}" --json "$lat_dir/braid-$r.json" >/dev/null
            run_step "$lat_dir/mpi-$r.json" mpirun "${mpirun_flags[@]}" -np "$n" "$harness" -b 8 -e 8 \
                -n "$LAT_ITERS" -w 1000 -j "$lat_dir/mpi-$r.json" >/dev/null
        done
        python3 benches/compare.py --latency "$lat_dir" || status=1
    done
fi

exit "$status"
