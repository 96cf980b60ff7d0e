#!/usr/bin/env bash
# Hierarchical vs flat-ring all-reduce across namespaced hosts joined by a throttled link.
#
#   benches/multihost.sh [HOSTS] [RANKS_PER_HOST] [RATE] [SIZE]     (defaults: 2 2 1gbit 64M)
#
# Brings up HOSTS network namespaces (tests/netns/hosts.sh) whose links are shaped to RATE, starts
# RANKS_PER_HOST `braid perf` ranks in each (shared memory inside a host, TCP between hosts), and
# measures the ring and the hierarchical all-reduce side by side at SIZE, then the link itself with a
# bulk TCP transfer between two hosts. Prints the time ratio and the ring's busbw as a fraction of the
# link bound. Needs root; builds braid in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
hosts=${1:-2}
per=${2:-2}
rate=${3:-1gbit}
size=${4:-64M}
iters=${ITERS:-5}
world=$((hosts * per))
prefix="braidb-$$"

cargo build --release -q -p braid-cli
braid=$PWD/target/release/braid
out=$(mktemp -d)
cleanup() { tests/netns/hosts.sh down --prefix "$prefix" >/dev/null 2>&1 || true; rm -rf "$out"; }
trap cleanup EXIT
tests/netns/hosts.sh up "$hosts" --prefix "$prefix" --rate "$rate" --mtu 9000 >/dev/null

pids=()
for ((r = 0; r < world; r++)); do
  h=$((r % hosts))
  ip netns exec "$prefix-h$h" env BRAID_RANK=$r BRAID_WORLD_SIZE=$world \
    BRAID_ROOT=198.18.0.1:29600 BRAID_SECRET=0123456789abcdef0123456789abcdef BRAID_TIMEOUT_MS=600000 \
    "$braid" perf -b "$size" -e "$size" -n "$iters" -w 1 --algo ring,hier --json "$out/perf.json" \
    >"$out/rank$r.txt" 2>&1 &
  pids+=($!)
done
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if [ "$fail" = 1 ]; then tail -n 20 "$out"/rank*.txt; exit 1; fi
cat "$out/rank0.txt"

# The link bound: one bulk TCP stream between two hosts, measured with the same binary's peers.
bytes=$((256 << 20))
ip netns exec "$prefix-h1" python3 -c "
import socket,time
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('198.18.0.2', 29700)); s.listen(1)
c,_=s.accept(); n=0
while True:
    b=c.recv(1<<20)
    if not b: break
    n+=len(b)
print(n)" >"$out/sink.txt" &
sink=$!
sleep 0.5
link=$(ip netns exec "$prefix-h0" python3 -c "
import socket,time
c=socket.create_connection(('198.18.0.2', 29700)); buf=b'x'*(1<<20); t=time.time()
for _ in range($bytes >> 20): c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); print($bytes/(time.time()-t))")
wait "$sink"
python3 - "$out/perf.json" "$link" "$hosts" "$per" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1]))
link = float(sys.argv[2]); hosts = int(sys.argv[3]); per = int(sys.argv[4])
n = hosts * per
row = rep["algos"][-1]
ring, hier = row["algos"]["ring"], row["algos"]["hier"]
# The ring visits hosts in turn, so each host's link carries one ring edge: 2(n-1)/n of the data each
# way, which makes the link rate itself the bound on the ring's busbw. Hier sends 2(H-1)/H of the data
# through each host's link, so it can be at most (n-1)/n · H/(H-1) times faster.
cap = (n - 1) / n * hosts / (hosts - 1)
print(f"size {row['size']} B, {hosts} hosts x {per} ranks")
print(f"link (one TCP stream between hosts): {link/1e9:.3f} GB/s")
print(f"ring: {ring['time_us']/1e3:.1f} ms, busbw {ring['busbw']:.3f} GB/s = {ring['busbw']*1e9/link:.0%} of the link bound")
print(f"hier: {hier['time_us']/1e3:.1f} ms, busbw {hier['busbw']:.3f} GB/s")
print(f"hier / ring speed: {ring['time_us']/hier['time_us']:.2f}x (the link-bound limit for this shape is {cap:.2f}x)")
PY
