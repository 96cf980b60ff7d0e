#!/usr/bin/env bash
# braid against NCCL all-reduce on one GPU, in one run per rank count (see benches/nccl_compare.py):
# several ranks share the GPU (NCCL_MULTI_RANK_GPU_ENABLE=1). Needs a GPU, PyTorch and the NCCL wheel
# (nvidia-nccl-cu12 or -cu13); without a GPU or torch it says why and exits 0.
#
#   benches/compare-nccl.sh            # 2 and 4 ranks
#   benches/compare-nccl.sh 2 8        # other rank counts
#   SIZES=1M:1G:4 ITERS=50 benches/compare-nccl.sh 4
# BRAID (the braid binary) and BRAID_LIBRARY (libbraid.so) default to target/release.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
braid=${BRAID:-$root/target/release/braid}
export BRAID_LIBRARY=${BRAID_LIBRARY:-$root/target/release/libbraid.so}
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "compare-nccl: skipped: no GPU visible to PyTorch (or PyTorch is not installed)"
    exit 0
fi
if [ ! -x "$braid" ] || [ ! -f "$BRAID_LIBRARY" ]; then
    (cd "$root" && cargo build --release -q -p braid-cli -p braid-capi)
fi
status=0
for n in "${@:-2 4}"; do
    for ranks in $n; do
        "$braid" run -n "$ranks" -- python3 "$root/benches/nccl_compare.py" || status=1
    done
done
exit $status
