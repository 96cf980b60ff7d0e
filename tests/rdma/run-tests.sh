#!/usr/bin/env bash
# The RDMA tests, for real on Soft-RoCE: builds braid with the cargo feature rdma here, then boots the
# guest of guest.sh (two rxe devices) and runs in it the rdma harness (every collective × algorithm on
# 2, 3 and 4 ranks over one device, two hosts on two devices, striping, a wrong key) and the fault
# harness over rdma (a peer killed, terminated, exiting or stopped mid-collective, abort from another
# thread, destroy after each, a bounded soak).
#
#   tests/rdma/run-tests.sh [--timeout SECONDS]
#
# Exit status: the tests'; 77 when the guest cannot run here (guest.sh says why), 1 instead under
# BRAID_REQUIRE_TOOLS=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
timeout=${1:-}
if [ "$timeout" = "--timeout" ]; then timeout=$2; else timeout=1500; fi

echo "== building the rdma tests (cargo feature rdma)"
# The test binaries and target/debug/braid, which the harnesses launch ranks through.
json=$(cargo test -p braid-cli --features rdma --test rdma --test faults --no-run --message-format=json 2>/dev/null)
bins=$(printf '%s\n' "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
')
rdma_bin=$(printf '%s\n' "$bins" | awk '$1 == "rdma" {print $2}')
faults_bin=$(printf '%s\n' "$bins" | awk '$1 == "faults" {print $2}')
if [ -z "$rdma_bin" ] || [ -z "$faults_bin" ]; then
  echo "run-tests.sh: building the rdma tests failed:" >&2
  cargo test -p braid-cli --features rdma --test rdma --test faults --no-run >&2
  exit 1
fi
cargo build -p braid-cli --features rdma --quiet

echo "== in the guest"
export BRAID_REQUIRE_TOOLS=${BRAID_REQUIRE_TOOLS:-1}
# Under emulation a 16 MiB all-reduce takes about a second: the fault scenarios use 4 MiB ones, so
# that the collectives before a fault stay well inside the bounds the harness checks.
export BRAID_TEST_TRANSPORTS=rdma SOAK_OPS=${SOAK_OPS:-600} FAULTS_BIG_ELEMS=${FAULTS_BIG_ELEMS:-1048576}
exec tests/rdma/guest.sh run --hosts 2 --timeout "$timeout" --env SOAK_OPS --env FAULTS_BIG_ELEMS -- \
  bash -c "set -e; '$rdma_bin'; '$faults_bin'"
