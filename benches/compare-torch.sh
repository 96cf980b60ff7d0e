#!/usr/bin/env bash
# DDP with backend="braid" against backend="gloo", side by side in one run (benches/torch_ddp.py): the
# same model, data and rank count under torchrun, step time and one all-reduce of the whole gradient
# each, and braid's time over gloo's. Needs PyTorch; without it says why and exits 0.
#
#   benches/compare-torch.sh              # 2 and 4 ranks
#   WIDTH=2048 DEPTH=4 BATCH=8 benches/compare-torch.sh 2
# BRAID_LIBRARY (libbraid.so) defaults to target/release.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export BRAID_LIBRARY=${BRAID_LIBRARY:-$root/target/release/libbraid.so}
if ! python3 -c 'import torch' 2>/dev/null; then
    echo "compare-torch: skipped: PyTorch is not installed (pip install torch)"
    exit 0
fi
if [ ! -f "$BRAID_LIBRARY" ]; then
    (cd "$root" && cargo build --release -q -p braid-capi)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
printf '%6s %12s %14s %14s %14s %14s %10s %10s\n' ranks params "gloo step ms" "braid step ms" "gloo ar ms" \
    "braid ar ms" "step b/g" "ar b/g"
for n in "${@:-2 4}"; do
    declare -A line=()
    for backend in gloo braid; do
        line[$backend]=$(python3 -m torch.distributed.run --standalone --nproc_per_node "$n" \
            "$root/benches/torch_ddp.py" "$backend" 2>/dev/null | grep '^{')
    done
    python3 - "${line[gloo]}" "${line[braid]}" <<'EOF'
import json, sys
g, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"{b['ranks']:>6} {b['params']:>12} {g['step_median_s']*1e3:>14.2f} {b['step_median_s']*1e3:>14.2f} "
      f"{g['allreduce_s']*1e3:>14.2f} {b['allreduce_s']*1e3:>14.2f} "
      f"{b['step_median_s']/g['step_median_s']:>10.2f} {b['allreduce_s']/g['allreduce_s']:>10.2f}")
EOF
done
