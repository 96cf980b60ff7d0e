#!/usr/bin/env bash
# Checks the RDMA guest end to end, in one boot of guest.sh with two rxe devices:
#
#   ibv_devices and ibv_devinfo see rxe0 and rxe1, ACTIVE, with their RoCE v2 IPv4 GIDs;
#   ibv_rc_pingpong between two processes on rxe0;
#   ib_write_bw with 4 MiB messages, rxe0 to rxe0 and rxe1 to rxe0 (the latter through the veth pair);
#   ib_write_lat, rxe0 to rxe0 and rxe1 to rxe0.
#
#   selftest.sh [--iters N]     (ib_write_bw's iterations, default 200)
#
# Prints each check as it ends, the figures measured, and 'N passed, N failed'. Exit status: 0 all
# passed, 1 a check failed, and guest.sh's 77 / 124 / 125 when the guest could not run or finish
# (77 becomes 1 with BRAID_REQUIRE_TOOLS=1).
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
readonly SELF
readonly GUEST=${SELF%/*}/guest.sh

host() {
  local iters=200
  while (($#)); do
    case $1 in
      --iters) iters=${2:?--iters needs N} && shift 2 ;;
      *) sed -n '2,10p' "$SELF" | sed 's/^# \{0,1\}//' >&2 && exit 2 ;;
    esac
  done
  [[ $iters =~ ^[1-9][0-9]*$ ]] || { echo "selftest.sh: --iters needs a positive number" >&2 && exit 2; }
  # The verbs tools run in the guest from the host's /: check them here, before booting.
  local tool missing=()
  for tool in ibv_devices:ibverbs-utils ibv_devinfo:ibverbs-utils ibv_rc_pingpong:ibverbs-utils \
    ib_write_bw:perftest ib_write_lat:perftest ss:iproute2 timeout:coreutils; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool%%:*} (package ${tool#*:})")
  done
  if ((${#missing[@]})); then
    local IFS=,
    echo "selftest.sh: cannot run: missing: ${missing[*]}" >&2
    [[ ${BRAID_REQUIRE_TOOLS:-} == 1 ]] && exit 1
    exit 77
  fi
  local start=$SECONDS status=0
  "$GUEST" run --hosts 2 --timeout "${BRAID_GUEST_TIMEOUT:-900}" -- "$SELF" __inside "$iters" || status=$?
  echo "selftest: the guest ran for $((SECONDS - start)) s (boot included)"
  exit "$status"
}

# ---------------------------------------------------------------------------------------------------
# In the guest.

PASSED=0 FAILED=0
FIGURES=()
LOG=

pass() {
  PASSED=$((PASSED + 1))
  echo "ok   $1"
}
fail() {
  FAILED=$((FAILED + 1))
  echo "FAIL $1"
  shift
  local f
  for f in "$@"; do
    [[ -s $f ]] || continue
    echo "  --- ${f##*/}"
    sed 's/^/  | /' "$f"
  done
}

# Waits (at most 20 s) until something listens on the TCP port.
wait_listen() {
  local port=$1 deadline=$((SECONDS + 20))
  until [[ -n $(ss -Hltn "sport = :$port") ]]; do
    ((SECONDS < deadline)) || return 1
    sleep 0.1
  done
}

# A server on rxe0 and a client on CLIENT_DEV, both given the rest of the arguments; the client
# connects to rxe0's address over TCP to swap the queue pairs' details, then runs over verbs.
# Leaves their output in $LOG/NAME.server and $LOG/NAME.client.
pair() {
  local name=$1 port=$2 client_dev=$3 tool=$4
  shift 4
  local server status=0
  timeout 300 "$tool" -d rxe0 -p "$port" "$@" >"$LOG/$name.server" 2>&1 &
  server=$!
  if ! wait_listen "$port"; then
    echo "the server did not listen on port $port within 20 s" >"$LOG/$name.client"
    kill "$server" 2>/dev/null || true
    wait "$server" || true
    return 1
  fi
  timeout 300 "$tool" -d "$client_dev" -p "$port" "$@" "$SERVER_ADDR" >"$LOG/$name.client" 2>&1 || status=$?
  wait "$server" || status=$?
  return "$status"
}

# The value in a column of perftest's result line (the line after the header that names it).
perftest_column() {
  local file=$1 header=$2 column=$3
  awk -v h="$header" -v c="$column" '
    index($0, h) { found = 1; next }
    found && $1 ~ /^[0-9]+$/ { print $c; exit }
  ' "$file"
}

rx_packets() { cat "/sys/class/net/$1/statistics/rx_packets"; }

inside() {
  local iters=$1 g=$BRAID_GUEST_GID_INDEX
  LOG=$(mktemp -d)
  read -r SERVER_ADDR _ <<<"$BRAID_GUEST_ADDRS"
  echo "devices: $BRAID_GUEST_RDMA_DEVICES on $BRAID_GUEST_NETDEVS ($BRAID_GUEST_ADDRS), RoCE v2 IPv4 GID index $g"

  if ibv_devices >"$LOG/ibv_devices" 2>&1 && grep -qw rxe0 "$LOG/ibv_devices" && grep -qw rxe1 "$LOG/ibv_devices"; then
    pass "ibv_devices lists rxe0 and rxe1"
  else
    fail "ibv_devices lists rxe0 and rxe1" "$LOG/ibv_devices"
  fi

  local dev addr ok
  for dev in rxe0 rxe1; do
    addr=$(awk -v i=$((${dev#rxe} + 1)) '{ print $i }' <<<"$BRAID_GUEST_ADDRS")
    ok=1
    ibv_devinfo -v -d "$dev" >"$LOG/ibv_devinfo.$dev" 2>&1 || ok=0
    grep -q 'state:.*PORT_ACTIVE' "$LOG/ibv_devinfo.$dev" || ok=0
    grep -Eq "GID\[ *$g\]:.*::ffff:$addr, RoCE v2" "$LOG/ibv_devinfo.$dev" || ok=0
    if ((ok)); then
      pass "ibv_devinfo: $dev PORT_ACTIVE, GID[$g] ::ffff:$addr RoCE v2"
    else
      fail "ibv_devinfo: $dev PORT_ACTIVE, GID[$g] ::ffff:$addr RoCE v2" "$LOG/ibv_devinfo.$dev"
    fi
  done

  if pair pingpong 18515 rxe0 ibv_rc_pingpong -g "$g" -n 1000 &&
    grep -q 'iters in' "$LOG/pingpong.client"; then
    pass "ibv_rc_pingpong rxe0 <-> rxe0 (1000 round trips of 4 KiB)"
    FIGURES+=("ibv_rc_pingpong rxe0<->rxe0: $(grep 'iters in' "$LOG/pingpong.client" | sed 's/.*= //')")
  else
    fail "ibv_rc_pingpong rxe0 <-> rxe0" "$LOG/pingpong.server" "$LOG/pingpong.client"
  fi

  # -F: a guest's CPU frequency is unknown to perftest and it would stop on that.
  local port=18516 client name before after bw lat
  for client in rxe0 rxe1; do
    name=write_bw.$client
    before=$(rx_packets braid0)
    if pair "$name" "$port" "$client" ib_write_bw -x "$g" -F -s 4194304 -n "$iters" &&
      bw=$(perftest_column "$LOG/$name.client" 'BW average' 4) && [[ -n $bw ]]; then
      after=$(rx_packets braid0)
      # From rxe1 the data reaches rxe0 through braid0: at least one packet per 4 KiB (the largest
      # RoCE MTU) must have arrived there.
      if [[ $client == rxe1 ]] && ((after - before < iters * 1024)); then
        fail "ib_write_bw $client -> rxe0: braid0 received only $((after - before)) packets: the data did not cross the veth pair" \
          "$LOG/$name.client"
      else
        pass "ib_write_bw $client -> rxe0, 4 MiB x $iters"
        FIGURES+=("ib_write_bw 4 MiB $client->rxe0: BW average $bw MB/sec")
      fi
    else
      fail "ib_write_bw $client -> rxe0, 4 MiB x $iters" "$LOG/$name.server" "$LOG/$name.client"
    fi
    port=$((port + 1))
  done

  for client in rxe0 rxe1; do
    name=write_lat.$client
    if pair "$name" "$port" "$client" ib_write_lat -x "$g" -F -n 1000 &&
      lat=$(perftest_column "$LOG/$name.client" 't_avg' 6) && [[ -n $lat ]]; then
      pass "ib_write_lat $client -> rxe0, 2 B x 1000"
      FIGURES+=("ib_write_lat 2 B $client->rxe0: t_avg $lat usec")
    else
      fail "ib_write_lat $client -> rxe0" "$LOG/$name.server" "$LOG/$name.client"
    fi
    port=$((port + 1))
  done

  local f
  echo "figures (under emulation: they show that verbs work, not how fast):"
  for f in "${FIGURES[@]}"; do
    echo "  $f"
  done
  echo "selftest: $PASSED passed, $FAILED failed"
  rm -rf "$LOG"
  ((FAILED == 0))
}

if [[ ${1:-} == __inside ]]; then
  inside "$2"
else
  host "$@"
fi
