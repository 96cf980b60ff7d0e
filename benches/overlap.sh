#!/usr/bin/env bash
# Overlap of gradient all-reduce with the backward pass (benches/torch_overlap.py) on HOSTS namespaced
# hosts, one rank each, joined by a link shaped to RATE: compute alone, communication alone, the two one
# after the other, braid.torch.GradientBuckets overlapping them, and DDP over gloo against DDP over braid,
# in one run. Writes each rank's BRAID_TIMELINE and draws it with `braid timeline --png`.
#
#   benches/overlap.sh [HOSTS] [RATE] [OUTDIR]        (defaults: 2 1gbit ./overlap-out)
#   MODEL=gpt2-mini STEPS=2 benches/overlap.sh        # a small model, for a quick look
#
# Needs root (tests/netns/hosts.sh) and PyTorch; builds braid in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
hosts=${1:-2}
rate=${2:-1gbit}
outdir=${3:-$PWD/overlap-out}
prefix="braido-$$"
if ! python3 -c 'import torch' 2>/dev/null; then
  echo "overlap: skipped: PyTorch is not installed (pip install torch)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "overlap: needs root for the namespaced hosts (tests/netns/hosts.sh)" >&2
  exit 1
fi
cargo build --release -q -p braid-capi -p braid-cli
target=${CARGO_TARGET_DIR:-$PWD/target}/release
mkdir -p "$outdir"
rm -f "$outdir"/trace.rank*.json
cleanup() { tests/netns/hosts.sh down --prefix "$prefix" >/dev/null 2>&1 || true; }
trap cleanup EXIT
tests/netns/hosts.sh up "$hosts" --prefix "$prefix" --rate "$rate" >/dev/null
pids=()
for ((r = 0; r < hosts; r++)); do
  ip netns exec "$prefix-h$r" env RANK=$r WORLD_SIZE=$hosts LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
    MASTER_ADDR=198.18.0.1 MASTER_PORT=29500 GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
    BRAID_LIBRARY="$target/libbraid.so" BRAID_TIMELINE="$outdir/trace.json" \
    python3 benches/torch_overlap.py >"$outdir/rank$r.txt" 2>&1 &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if [ "$fail" = 1 ]; then tail -n 30 "$outdir"/rank*.txt; exit 1; fi
line=$(grep '^{' "$outdir/rank0.txt")
echo "$line" >"$outdir/result.json"
python3 - "$line" "$rate" <<'PY'
import json, sys
r, rate = json.loads(sys.argv[1]), sys.argv[2]
print(f"{r['model']} ({r['params'] / 1e6:.1f}M parameters, {r['gradient_mb']:.0f} MB of gradient), {r['ranks']} hosts, "
      f"links shaped to {rate}, batch {r['batch']} x {r['seq']} tokens")
for k in ("compute_s", "comm_s", "sequential_s", "overlapped_s", "ddp_gloo_s", "ddp_braid_s"):
    print(f"  {k[:-2]:<12} {r[k] * 1e3:10.1f} ms")
print(f"  overlap efficiency (T_compute + T_comm - T_step) / min: {r['overlap_efficiency']:.2f}")
print(f"  overlapped / sequential step: {r['overlapped_over_sequential']:.2f}")
print(f"  DDP step, braid / gloo: {r['ddp_braid_over_gloo']:.2f}")
PY
"$target/braid" timeline "$outdir"/trace.rank*.json --merge "$outdir/trace.json" --png "$outdir/timeline.png"
