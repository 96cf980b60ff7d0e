#!/usr/bin/env bash
# RDMA side by side, in one run of the Soft-RoCE guest (tests/rdma/guest.sh):
#
#   1. point to point at 4 MiB messages on rxe0: perftest's ib_write_bw against braid's two-rank
#      broadcast over rdma (one 4 MiB slot per message, from the staging ring and from a registered
#      send buffer, and the default 128 KiB slots);
#   2. all-reduce busbw on RANKS ranks over rdma against tcp, one sweep each;
#   3. the same all-reduce under Open MPI over UCX (rc_verbs) and over the openib BTL, where they run.
#
#   benches/rdma.sh [RANKS]        (default 4; ITERS timed iterations per size, default 20)
#
# Figures under emulation (QEMU TCG, rxe in software) show how the transports compare within one run;
# their absolute values say nothing about a real NIC. Builds braid in release mode with the rdma
# feature (in $CARGO_TARGET_DIR, default target/); needs what tests/rdma/guest.sh needs, plus perftest
# (and openmpi-bin, libopenmpi-dev for the MPI rows).
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-4}
iters=${ITERS:-20}

cargo build --release -q -p braid-cli --features rdma
braid=${CARGO_TARGET_DIR:-$PWD/target}/release/braid
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mpi=""
if command -v mpicc >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1; then
  mpicc -O2 -o "$out/allreduce_mpi" benches/mpi/allreduce_mpi.c && mpi="$out/allreduce_mpi"
fi

cat >"$out/inside.sh" <<'GUEST'
set -uo pipefail
braid=$1 out=$2 ranks=$3 iters=$4 mpi=$5
g=$BRAID_GUEST_GID_INDEX
read -r addr _ <<<"$BRAID_GUEST_ADDRS"
echo "== devices: $BRAID_GUEST_RDMA_DEVICES ($BRAID_GUEST_ADDRS), RoCE v2 GID $g"

echo "== ib_write_bw rxe0 -> rxe0, 4 MiB x 200"
timeout 300 ib_write_bw -d rxe0 -x "$g" -F -s 4194304 -n 200 -p 18600 >"$out/bw.server" 2>&1 &
server=$!
for _ in $(seq 200); do ss -Hltn "sport = :18600" | grep -q . && break; sleep 0.1; done
timeout 300 ib_write_bw -d rxe0 -x "$g" -F -s 4194304 -n 200 -p 18600 "$addr" >"$out/bw.client" 2>&1
wait "$server"
grep -A2 'BW average' "$out/bw.client"

echo "== braid broadcast over rdma, 2 ranks, 4 MiB: one 4 MiB slot per message"
BRAID_TRANSPORT=rdma BRAID_IB_HCA==rxe0 BRAID_CHUNK_BYTES=4194304 BRAID_SLOTS=4 \
  "$braid" perf --ranks 2 --collective broadcast -b 4M -e 4M -n "$iters" --json "$out/p2p-4m.json" 2>"$out/p2p-4m.err" | grep -v '^#  '
echo "== braid broadcast over rdma, 2 ranks, 4 MiB: one 4 MiB slot per message, from a registered buffer"
BRAID_TRANSPORT=rdma BRAID_IB_HCA==rxe0 BRAID_CHUNK_BYTES=4194304 BRAID_SLOTS=4 \
  "$braid" perf --ranks 2 --collective broadcast -b 4M -e 4M -n "$iters" --register --json "$out/p2p-4m-reg.json" 2>"$out/p2p-4m-reg.err" | grep -v '^#  '
echo "== braid broadcast over rdma, 2 ranks, 4 MiB: 128 KiB slots (the default)"
BRAID_TRANSPORT=rdma BRAID_IB_HCA==rxe0 \
  "$braid" perf --ranks 2 --collective broadcast -b 4M -e 4M -n "$iters" --json "$out/p2p-128k.json" 2>"$out/p2p-128k.err" | grep -v '^#  '

for t in rdma tcp; do
  echo "== braid all-reduce over $t, $ranks ranks"
  BRAID_TRANSPORT=$t BRAID_IB_HCA==rxe0 \
    "$braid" perf --ranks "$ranks" -b 64K -e 16M -f 4 -n "$iters" --json "$out/ar-$t.json" 2>"$out/ar-$t.err" | grep -v '^#  '
done

if [ -n "$mpi" ]; then
  flags=(--allow-run-as-root --oversubscribe -np "$ranks")
  echo "== Open MPI over UCX (rc_verbs on rxe0:1)"
  timeout 600 mpirun "${flags[@]}" --mca pml ucx --mca btl ^openib,vader,tcp \
    -x UCX_TLS=rc_verbs,self -x UCX_NET_DEVICES=rxe0:1 -x UCX_IB_GID_INDEX="$g" \
    "$mpi" -b 64K -e 16M -f 4 -n "$iters" -w 5 -j "$out/ar-mpi-ucx.json" >"$out/mpi-ucx.log" 2>&1 ||
    echo "Open MPI over UCX failed (exit $?): $(tail -3 "$out/mpi-ucx.log" | tr '\n' ' ')"
  echo "== Open MPI over the openib BTL (rxe0)"
  timeout 600 mpirun "${flags[@]}" --mca pml ob1 --mca btl openib,self --mca btl_openib_allow_ib 1 \
    --mca btl_openib_if_include rxe0 --mca btl_openib_gid_index "$g" --mca btl_openib_cpc_include rdmacm \
    "$mpi" -b 64K -e 16M -f 4 -n "$iters" -w 5 -j "$out/ar-mpi-openib.json" >"$out/mpi-openib.log" 2>&1 ||
    echo "Open MPI over openib failed (exit $?): $(tail -3 "$out/mpi-openib.log" | tr '\n' ' ')"
fi
GUEST

tests/rdma/guest.sh run --hosts 1 --timeout 1800 --share "$out" -- \
  bash "$out/inside.sh" "$braid" "$out" "$ranks" "$iters" "$mpi"

python3 - "$out" <<'PY'
import json, os, re, sys
out = sys.argv[1]

def rows(name):
    p = os.path.join(out, name)
    if not os.path.exists(p):
        return {}
    d = json.load(open(p))
    return {r["size"]: r for r in d.get("results", d if isinstance(d, list) else [])}

def busbw(r):
    for k in ("oop_busbw", "busbw"):
        if k in r:
            return r[k]
    oop = r.get("oop") or {}
    return oop.get("busbw")

text = open(os.path.join(out, "bw.client")).read() if os.path.exists(os.path.join(out, "bw.client")) else ""
m = re.search(r"BW average\[MB/sec\].*\n\s*\d+\s+\d+\s+[\d.]+\s+([\d.]+)", text)
perftest = float(m.group(1)) / 1000 if m else None  # MB/s -> GB/s (perftest's MB is 10^6 bytes)
print("\n== summary (emulated: ratios within this run, not absolute speed)")
if perftest:
    print(f"ib_write_bw 4 MiB: {perftest:.3f} GB/s")
    for name, label in (("p2p-4m.json", "4 MiB slots"), ("p2p-4m-reg.json", "4 MiB slots, registered send buffer"), ("p2p-128k.json", "128 KiB slots")):
        r = rows(name).get(4194304)
        if r and busbw(r):
            print(f"braid broadcast over rdma, {label}: {busbw(r):.3f} GB/s = {busbw(r) / perftest:.0%} of ib_write_bw")
tables = {k: rows(f"ar-{k}.json") for k in ("rdma", "tcp", "mpi-ucx", "mpi-openib")}
sizes = sorted(tables["rdma"])
print("all-reduce busbw (GB/s):")
print(f"{'size':>10} {'rdma':>8} {'tcp':>8} {'rdma/tcp':>9} {'MPI/UCX':>8} {'rdma/UCX':>9} {'MPI/openib':>10}")
for s in sizes:
    v = {k: busbw(t[s]) if s in t else None for k, t in tables.items()}
    f = lambda x: f"{x:8.3f}" if x else f"{'-':>8}"
    ratio = lambda a, b: f"{a / b:8.2f}x" if a and b else f"{'-':>9}"
    print(f"{s:>10} {f(v['rdma'])} {f(v['tcp'])} {ratio(v['rdma'], v['tcp'])} {f(v['mpi-ucx'])} {ratio(v['rdma'], v['mpi-ucx'])} {f(v['mpi-openib']):>10}")
PY
