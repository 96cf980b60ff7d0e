#!/usr/bin/env bash
# Several "hosts" on one machine: network namespaces joined by a switch.
#
#   hosts.sh up N [--prefix NAME] [--mtu BYTES] [--rate RATE] [--burst BYTES] [--delay TIME]
#   hosts.sh down [--prefix NAME | --all]
#   hosts.sh exec HOST_INDEX [--prefix NAME] -- CMD [ARGS...]
#   hosts.sh status [--prefix NAME]
#
# `up` makes namespaces NAME-h0 .. NAME-h{N-1} and NAME-sw. Host i has `lo` and `eth0`, with address
# 198.18.0.(1+i)/15 (the range set aside for benchmarks). The other end of each host's veth pair sits in
# NAME-sw as `hI`, a port of the bridge `br0`. Nothing is created in, or changed about, the namespace the
# script runs in: traffic between hosts never leaves the namespaces.
#
#   --mtu BYTES    MTU of every link (default 1500).
#   --rate RATE    shape each host's egress with a token bucket (tc tbf), e.g. 1gbit, 100mbit, 500kbit.
#   --burst BYTES  the bucket's size (default: 1 ms at RATE, at least 16 KiB and one packet).
#   --delay TIME   add a fixed delay to each host's egress (tc netem), e.g. 1ms, 250us.
#
# Without --prefix, `up` takes $BRAIDT_PREFIX, or else braidt- and six random hex digits (braidt-3fa91c),
# and prints it; the other commands take the prefix from
# --prefix, then from $BRAIDT_PREFIX, then from the only set of hosts up (they refuse to guess among
# several). `down` is idempotent; `down --all` removes every braidt-* set. A failed `up` removes what it
# made. Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2; --rate needs the kernel's sch_tbf,
# --delay its sch_netem.
#
# Exit status: 0 done, 1 failed, 2 bad usage.
set -euo pipefail

readonly NET=198.18.0
readonly PREFIXLEN=15

die() {
  echo "hosts.sh: $*" >&2
  exit 1
}
usage() {
  sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

valid_prefix() {
  [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$ ]] || die "prefix '$1': use letters, digits, '_', '.', '-' (at most 40)"
}

# Every namespace whose name is PREFIX-hI or PREFIX-sw.
namespaces_of() {
  local p=$1
  ip netns list 2>/dev/null | awk '{print $1}' | while read -r ns; do
    case "$ns" in
      "$p"-sw) echo "$ns" ;;
      "$p"-h*) [[ "${ns#"$p"-h}" =~ ^[0-9]+$ ]] && echo "$ns" ;;
    esac
  done || true
}

# The prefixes of every set of hosts up (those with a switch namespace named braidt-*-sw).
live_prefixes() {
  ip netns list 2>/dev/null | awk '{print $1}' | sed -n 's/^\(braidt-.*\)-sw$/\1/p' || true
}

# The prefix given, or $BRAIDT_PREFIX, or the only set of hosts up. Empty when none is up.
resolve_prefix() {
  local given=$1
  if [ -n "$given" ]; then
    echo "$given"
  elif [ -n "${BRAIDT_PREFIX:-}" ]; then
    echo "$BRAIDT_PREFIX"
  else
    local live
    live=$(live_prefixes)
    if [ "$(printf '%s\n' "$live" | grep -c .)" -gt 1 ]; then
      die "several sets of hosts are up ($(tr '\n' ' ' <<<"$live")); say which with --prefix"
    fi
    echo "$live"
  fi
}

remove_prefix() {
  local p=$1 ns pids
  for ns in $(namespaces_of "$p"); do
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
    [ -z "$pids" ] || echo "hosts.sh: $ns still has processes ($pids); it lives on until they end" >&2
    ip netns delete "$ns" 2>/dev/null || ! namespaces_of "$p" | grep -qFx "$ns" ||
      die "cannot delete namespace $ns"
  done
}

# Bytes per second of a tc rate such as 1gbit, 100mbit, 500kbit, 8000bit.
rate_bytes() {
  local r=${1,,} n unit
  [[ "$r" =~ ^([0-9]+)(bit|kbit|mbit|gbit)$ ]] || die "rate '$1': write it as <integer>bit|kbit|mbit|gbit"
  n=$((10#${BASH_REMATCH[1]}))
  [ "$n" -gt 0 ] || die "rate '$1': must be more than 0"
  unit=${BASH_REMATCH[2]}
  case $unit in
    bit) echo $((n / 8)) ;;
    kbit) echo $((n * 1000 / 8)) ;;
    mbit) echo $((n * 1000000 / 8)) ;;
    gbit) echo $((n * 1000000000 / 8)) ;;
  esac
}

cmd_up() {
  local n="" prefix="" mtu=1500 rate="" burst="" delay=""
  while [ $# -gt 0 ]; do
    case $1 in
      --prefix) prefix=${2:?--prefix needs a value}; shift 2 ;;
      --mtu) mtu=${2:?--mtu needs a value}; shift 2 ;;
      --rate) rate=${2:?--rate needs a value}; shift 2 ;;
      --burst) burst=${2:?--burst needs a value}; shift 2 ;;
      --delay) delay=${2:?--delay needs a value}; shift 2 ;;
      -*) usage ;;
      *) [ -z "$n" ] || usage; n=$1; shift ;;
    esac
  done
  if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt 254 ]; then die "up: N must be 1..254"; fi
  if ! [[ "$mtu" =~ ^[0-9]+$ ]] || [ "$mtu" -lt 68 ] || [ "$mtu" -gt 65535 ]; then
    die "--mtu must be 68..65535"
  fi
  if [ -z "$prefix" ]; then
    prefix=${BRAIDT_PREFIX:-braidt-$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')}
  fi
  valid_prefix "$prefix"
  command -v ip >/dev/null || die "no 'ip' command (install iproute2)"
  [ -z "$rate$delay" ] || command -v tc >/dev/null || die "no 'tc' command (install iproute2)"
  [ -z "$(namespaces_of "$prefix")" ] || die "hosts with prefix $prefix are already up (hosts.sh down --prefix $prefix)"

  local qdisc_args=""
  if [ -n "$rate" ]; then
    local bps
    bps=$(rate_bytes "$rate")
    if [ -z "$burst" ]; then
      # 1 ms of traffic keeps the rate honest over short spans; a bucket must hold a full packet.
      burst=$((bps / 1000))
      [ "$burst" -ge 16384 ] || burst=16384
      [ "$burst" -ge $((mtu + 64)) ] || burst=$((mtu + 64))
    fi
    [[ "$burst" =~ ^[0-9]+$ ]] || die "--burst must be a number of bytes"
    # Packets wait at most 50 ms in the bucket's queue; beyond that they are dropped, as on a real link.
    qdisc_args="tbf rate $rate burst $burst latency 50ms"
  elif [ -n "$burst" ]; then
    die "--burst goes with --rate"
  fi

  local ok=0
  # shellcheck disable=SC2317  # run by the trap
  cleanup_failed_up() {
    if [ "$ok" != 1 ]; then
      echo "hosts.sh: up failed; removing what it made" >&2
      remove_prefix "$prefix" || true
    fi
  }
  trap cleanup_failed_up EXIT
  trap 'exit 1' INT TERM

  local sw="$prefix-sw" i h
  ip netns add "$sw"
  ip -n "$sw" link set lo up
  ip -n "$sw" link add br0 type bridge forward_delay 0 stp_state 0
  ip -n "$sw" link set br0 mtu "$mtu" up
  for ((i = 0; i < n; i++)); do
    h="$prefix-h$i"
    ip netns add "$h"
    ip -n "$h" link set lo up
    # Both ends are made from the switch's side, so the pair never appears in this namespace.
    ip -n "$sw" link add "h$i" mtu "$mtu" type veth peer name eth0 mtu "$mtu" netns "$h"
    ip -n "$sw" link set "h$i" master br0 up
    ip -n "$h" addr add "$NET.$((1 + i))/$PREFIXLEN" dev eth0
    ip -n "$h" link set eth0 up
    if [ -n "$delay" ]; then
      ip netns exec "$h" tc qdisc add dev eth0 root handle 1: netem delay "$delay" ||
        die "cannot add a netem qdisc (the kernel may lack sch_netem)"
      if [ -n "$qdisc_args" ]; then
        # shellcheck disable=SC2086
        ip netns exec "$h" tc qdisc add dev eth0 parent 1:1 handle 10: $qdisc_args ||
          die "cannot add a tbf qdisc (the kernel may lack sch_tbf)"
      fi
    elif [ -n "$qdisc_args" ]; then
      # shellcheck disable=SC2086
      ip netns exec "$h" tc qdisc add dev eth0 root handle 1: $qdisc_args ||
        die "cannot add a tbf qdisc (the kernel may lack sch_tbf)"
    fi
  done

  # Links come up asynchronously: wait (5 s at most) until every host's eth0 has its carrier.
  local deadline=$((SECONDS + 5))
  for ((i = 0; i < n; i++)); do
    until ip -n "$prefix-h$i" -o link show eth0 | grep -q 'LOWER_UP'; do
      [ "$SECONDS" -lt "$deadline" ] || die "eth0 of $prefix-h$i has no carrier after 5 s"
      sleep 0.05
    done
  done
  ok=1
  trap - EXIT INT TERM
  echo "prefix=$prefix hosts=$n mtu=$mtu${rate:+ rate=$rate burst=$burst}${delay:+ delay=$delay}"
}

cmd_down() {
  local prefix="" all=0
  while [ $# -gt 0 ]; do
    case $1 in
      --prefix) prefix=${2:?--prefix needs a value}; shift 2 ;;
      --all) all=1; shift ;;
      *) usage ;;
    esac
  done
  command -v ip >/dev/null || die "no 'ip' command (install iproute2)"
  if [ "$all" = 1 ]; then
    local p
    for p in $(live_prefixes); do remove_prefix "$p"; done
    return
  fi
  prefix=$(resolve_prefix "$prefix")
  [ -n "$prefix" ] || return 0
  valid_prefix "$prefix"
  remove_prefix "$prefix"
}

cmd_exec() {
  local idx=${1:-} prefix=""
  [ $# -gt 0 ] || usage
  shift
  while [ $# -gt 0 ]; do
    case $1 in
      --prefix) prefix=${2:?--prefix needs a value}; shift 2 ;;
      --) shift; break ;;
      *) usage ;;
    esac
  done
  [ $# -gt 0 ] || usage
  prefix=$(resolve_prefix "$prefix")
  [ -n "$prefix" ] || die "no hosts are up"
  local ns
  if [ "$idx" = sw ]; then ns="$prefix-sw"; else
    [[ "$idx" =~ ^[0-9]+$ ]] || die "exec: HOST_INDEX must be a number (or sw)"
    ns="$prefix-h$idx"
  fi
  namespaces_of "$prefix" | grep -qFx "$ns" || die "no namespace $ns"
  exec ip netns exec "$ns" "$@"
}

cmd_status() {
  local prefix=""
  while [ $# -gt 0 ]; do
    case $1 in
      --prefix) prefix=${2:?--prefix needs a value}; shift 2 ;;
      *) usage ;;
    esac
  done
  prefix=$(resolve_prefix "$prefix")
  if [ -z "$prefix" ]; then
    echo "no hosts are up"
    return
  fi
  local nss ns
  nss=$(namespaces_of "$prefix")
  if [ -z "$nss" ]; then
    echo "no hosts with prefix $prefix"
    return
  fi
  echo "prefix $prefix"
  for ns in $(echo "$nss" | grep -- '-h' | sort -V); do
    echo "$ns:"
    ip -n "$ns" -br addr show dev eth0 | sed 's/^/  /'
    ip -n "$ns" -o link show eth0 | grep -o 'mtu [0-9]*' | sed 's/^/  /'
    ip netns exec "$ns" tc qdisc show dev eth0 | sed 's/^/  /'
    local pids
    pids=$(ip netns pids "$ns" | tr '\n' ' ')
    [ -z "$pids" ] || echo "  processes: $pids"
  done
  if echo "$nss" | grep -qx -- "$prefix-sw"; then
    echo "$prefix-sw: bridge br0, ports $(ip -n "$prefix-sw" -o link show master br0 | awk -F': ' '{print $2}' | cut -d@ -f1 | tr '\n' ' ')"
  fi
}

[ $# -gt 0 ] || usage
sub=$1
shift
case $sub in
  up) cmd_up "$@" ;;
  down) cmd_down "$@" ;;
  exec) cmd_exec "$@" ;;
  status) cmd_status "$@" ;;
  -h | --help | help) usage ;;
  *) usage ;;
esac
