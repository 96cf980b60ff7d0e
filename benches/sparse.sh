#!/usr/bin/env bash
# Top-k's sparse all-reduce: the all-gather of pairs, the reduce-scatter by range and a dense all-reduce
# of the same gradient, side by side in one `braid compress-bench` run, on 4 local processes and on
# HOSTS namespaced hosts x RANKS_PER_HOST ranks joined by a link shaped to RATE.
#
#   benches/sparse.sh [HOSTS] [RANKS_PER_HOST] [RATE] [SIZE] [CODECS]
#                                          (defaults: 2 2 1gbit 64M topk:0.1,topk:0.01)
#
# Prints each run's table (time, speed-up over dense, the busiest rank's bytes against dense), then the
# reduce-scatter's speed against the all-gather's and dense's for each codec (above 1: faster). ITERS rounds (default 5).
# The namespaced part needs root (tests/netns/hosts.sh); without it only the local run is made. Builds
# braid in release mode (in $CARGO_TARGET_DIR, default target/).
set -euo pipefail
cd "$(dirname "$0")/.."
hosts=${1:-2}
per=${2:-2}
rate=${3:-1gbit}
size=${4:-64M}
codecs=${5:-topk:0.1,topk:0.01}
iters=${ITERS:-5}
world=$((hosts * per))
prefix="braids-$$"

cargo build --release -q -p braid-cli
braid=${CARGO_TARGET_DIR:-$PWD/target}/release/braid
out=$(mktemp -d)
cleanup() { tests/netns/hosts.sh down --prefix "$prefix" >/dev/null 2>&1 || true; rm -rf "$out"; }
trap cleanup EXIT
args=(compress-bench -s "$size" --codecs "$codecs" --sparse allgather,reducescatter -n "$iters")

ratios() {
  python3 - "$1" <<'PY'
import re, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"\s+(\S+)(?: (allgather|reducescatter))?\s+(\S+)\s+([\d.]+)\s+[\d.]+x\s+([\d.]+)", line)
    if m:
        rows[(m.group(1), m.group(2))] = (float(m.group(4)), float(m.group(5)))
dense = rows.get(("dense", None))
for (codec, path), (t, mib) in rows.items():
    if path != "reducescatter":
        continue
    ag = rows.get((codec, "allgather"))
    print(f"{codec}: reduce-scatter {t:.1f} ms, {mib:.2f} MiB; speed vs dense {dense[0] / t:.2f}x "
          f"({mib / dense[1]:.1%} of its bytes), vs all-gather {ag[0] / t:.2f}x ({mib / ag[1]:.1%} of its bytes)")
PY
}

echo "## $world local processes (shared memory)"
"$braid" "${args[@]}" --ranks "$world" | tee "$out/local.txt"
ratios "$out/local.txt"

if [ "$(id -u)" != 0 ]; then
  echo "## skipping $hosts namespaced hosts: needs root"
  exit 0
fi
tests/netns/hosts.sh up "$hosts" --prefix "$prefix" --rate "$rate" --mtu 9000 >/dev/null
pids=()
for ((r = 0; r < world; r++)); do
  h=$((r % hosts))
  ip netns exec "$prefix-h$h" env BRAID_RANK=$r BRAID_WORLD_SIZE=$world \
    BRAID_ROOT=198.18.0.1:29601 BRAID_SECRET=0123456789abcdef0123456789abcdef BRAID_TIMEOUT_MS=600000 \
    "$braid" "${args[@]}" >"$out/rank$r.txt" 2>&1 &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if [ "$fail" = 1 ]; then tail -n 20 "$out"/rank*.txt; exit 1; fi
echo "## $hosts namespaced hosts x $per ranks, links shaped to $rate"
cat "$out/rank0.txt"
ratios "$out/rank0.txt"
