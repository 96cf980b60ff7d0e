#!/usr/bin/env bash
# Runs a command inside a throw-away QEMU guest that has a real RDMA verbs stack (Soft-RoCE, rdma_rxe).
#
#   guest.sh prepare
#   guest.sh run [--timeout SECONDS] [--hosts 1|2] [--share DIR]... [--env NAME]... -- COMMAND [ARGS...]
#
# `prepare` fetches Debian's kernel package (linux-image-amd64's current version) into the cache, never
# installing it, and builds the guest's initramfs (busybox and the modules it needs). Both are kept and
# reused: the kernel by package version, the initramfs by a hash of what goes into it.
#
# `run` prepares if needed and boots the guest (TCG, no network card). The guest sees the host's /
# read-only, with a tmpfs over it that takes its writes, and mounts every --share DIR read-write at the
# same path. It makes a veth pair braid0 (198.18.100.1/24) and braid1 (198.18.100.2/24), adds rxe0 on
# braid0 and, with --hosts 2, rxe1 on braid1, waits for them to be ACTIVE with a RoCE v2 IPv4 GID, and
# runs COMMAND in the caller's working directory, with stdin from /dev/null, its stdout on this
# script's stdout and its stderr on this script's stderr. Then the guest powers off.
#
# COMMAND gets PATH, HOME, USER, LOGNAME, TERM, LANG, LC_*, TZ, every BRAID_*, RUST_* and CARGO_*
# variable, each --env NAME, and these:
#   BRAID_GUEST=1
#   BRAID_GUEST_RDMA_DEVICES   "rxe0" or "rxe0 rxe1"
#   BRAID_GUEST_NETDEVS        the devices' netdevs, in the same order: "braid0" or "braid0 braid1"
#   BRAID_GUEST_ADDRS          their IPv4 addresses, in the same order
#   BRAID_GUEST_GID_INDEX      the GID index of the RoCE v2 IPv4 GID (the same on every device)
#
#   --timeout SECONDS  from qemu's start to the guest's end (default $BRAID_GUEST_TIMEOUT or 600).
#   --hosts 1|2        how many rxe devices (default 1).
#   --share DIR        a host folder the command may write (repeatable); created if missing.
#   --env NAME         pass one more variable (repeatable).
#
# Environment: BRAID_GUEST_CACHE (default <repo>/target/rdma-guest), BRAID_GUEST_VERBOSE=1 (kernel
# messages and each step of the guest's set-up, on stderr), BRAID_GUEST_ACCEL (tcg, the default, or
# kvm), BRAID_GUEST_CPUS (2), BRAID_GUEST_MEMORY (MiB, 2048), BRAID_GUEST_KERNEL_DEB (a kernel .deb to
# use instead of downloading linux-image-amd64's), BRAID_GUEST_APPEND (more words for the kernel's
# command line).
#
# Exit status: COMMAND's; 124 if the timeout ran out (qemu is killed); 77 if the guest cannot run here
# (a tool or the kernel package is missing: the message says which), 1 instead when BRAID_REQUIRE_TOOLS=1;
# 125 if the guest failed before reporting COMMAND's status; 2 bad usage.
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
readonly SELF
HERE=$(dirname "$SELF")
readonly HERE
readonly INIT_SCRIPT=$HERE/initramfs-init.sh

# The modules the guest loads, with their dependencies (taken from the kernel's modules.dep):
# the virtio PCI transport and 9p for the shares, overlayfs for the writable root, veth for the
# netdevs, rxe and the RDMA CM's user interface (/dev/infiniband/rdma_cm, for librdmacm). rxe asks the
# crypto API for "crc32" by name, which no dependency brings in, so crc32_generic is listed too.
readonly MODULES="virtio_pci 9pnet_virtio 9p overlay veth crc32_generic rdma_rxe rdma_ucm"

readonly EXIT_CANNOT_RUN=77 EXIT_TIMEOUT=124 EXIT_GUEST_FAILED=125

say() { echo "guest.sh: $*" >&2; }
die() {
  say "$*"
  exit 1
}
usage() {
  sed -n '2,5p' "$SELF" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
# The guest cannot run here: 77, or a failure where the caller requires the tools.
cannot_run() {
  say "cannot run the guest: $*"
  if [[ ${BRAID_REQUIRE_TOOLS:-} == 1 ]]; then
    say "BRAID_REQUIRE_TOOLS=1: this is a failure"
    exit 1
  fi
  exit "$EXIT_CANNOT_RUN"
}

# Removed on exit: temporary folders, and processes this script started and has not yet seen end
# (each stopped by its own pid).
TEMP_DIRS=()
PIDS=()
forget_pid() {
  local keep=() pid
  for pid in "${PIDS[@]}"; do
    [[ $pid == "$1" ]] || keep+=("$pid")
  done
  PIDS=("${keep[@]}")
}
cleanup() {
  local pid deadline
  for pid in "${PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  deadline=$((SECONDS + 5))
  for pid in "${PIDS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
  done
  if ((${#TEMP_DIRS[@]})); then
    rm -rf "${TEMP_DIRS[@]}"
  fi
}

# ---------------------------------------------------------------------------------------------------
# Host side: prepare

cache_dir() {
  if [[ -n ${BRAID_GUEST_CACHE:-} ]]; then
    echo "$BRAID_GUEST_CACHE"
  else
    echo "$(cd "$HERE/../.." && pwd)/target/rdma-guest"
  fi
}

# Every tool is checked before anything is done, and every missing one named with its package.
check_tools() {
  local what=$1 missing=()
  need() { command -v "$1" >/dev/null 2>&1 || missing+=("$1 (package $2)"); }
  need gzip gzip
  need sha256sum coreutils
  need flock util-linux
  need busybox busybox-static
  # The initramfs has no libraries: its busybox must be linked statically.
  if command -v busybox >/dev/null 2>&1 && command -v ldd >/dev/null 2>&1 &&
    [[ $(ldd "$(command -v busybox)" 2>&1 || true) != *"not a dynamic executable"* ]]; then
    missing+=("a static busybox (package busybox-static)")
  fi
  if [[ $what == run ]]; then
    need qemu-system-x86_64 qemu-system-x86
    need ip iproute2
    need rdma iproute2
    [[ -e /etc/libibverbs.d/rxe.driver ]] || missing+=("rxe's verbs provider (package ibverbs-providers)")
  fi
  if ((${#missing[@]})); then
    local IFS=,
    cannot_run "missing: ${missing[*]}"
  fi
}

# Sets KDIR to the cached kernel's folder, fetching the package first if needed. The folder holds the
# package (kernel.deb), the kernel (vmlinuz, and vmlinux where it could be unpacked) and its release
# (release, e.g. 6.1.0-57-amd64).
fetch_kernel() {
  local cache=$1 deb pkg version key tmp
  if [[ -n ${BRAID_GUEST_KERNEL_DEB:-} ]]; then
    deb=$BRAID_GUEST_KERNEL_DEB
    [[ -f $deb ]] || die "BRAID_GUEST_KERNEL_DEB: no such file: $deb"
    key=$(basename "$deb" .deb)
  else
    pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-/ { print $2; exit }' || true)
    version=
    if [[ -n $pkg ]]; then
      version=$(apt-cache show --no-all-versions "$pkg" 2>/dev/null | awk '$1 == "Version:" { print $2; exit }' || true)
    fi
    if [[ -z $version ]]; then
      # Offline, or apt's lists are missing: any kernel fetched before will do.
      key=$(find "$cache/kernel" -mindepth 2 -maxdepth 2 -name complete -printf '%T@ %h\n' 2>/dev/null |
        sort -rn | awk 'NR == 1 { print $2 }' || true)
      if [[ -n $key ]]; then
        KDIR=$key
        return
      fi
      cannot_run "apt knows no package linux-image-amd64 and none is cached (run apt-get update)"
    fi
    key=${pkg}_$version
  fi
  local dir=$cache/kernel/$key
  KDIR=$dir
  [[ ! -f $dir/complete ]] || return 0
  for tool in dpkg-deb apt-get; do
    command -v "$tool" >/dev/null 2>&1 || cannot_run "missing: $tool (package ${tool%%-*})"
  done
  say "fetching the kernel: $key"
  rm -rf "$dir"
  mkdir -p "$cache/kernel"
  tmp=$(mktemp -d "$cache/kernel/.fetch.XXXXXX")
  TEMP_DIRS+=("$tmp")
  if [[ -n ${BRAID_GUEST_KERNEL_DEB:-} ]]; then
    cp "$deb" "$tmp/kernel.deb"
  else
    # As root, apt would drop to the _apt user, who cannot write into this folder.
    if ! (cd "$tmp" && apt-get download -q -o "APT::Sandbox::User=$(id -un)" "$pkg=$version" >&2); then
      cannot_run "apt-get download $pkg=$version failed"
    fi
    mv "$tmp"/*.deb "$tmp/kernel.deb"
  fi
  dpkg-deb --fsys-tarfile "$tmp/kernel.deb" | tar -x -C "$tmp" --wildcards './boot/vmlinuz-*'
  local vmlinuz
  vmlinuz=$(find "$tmp/boot" -name 'vmlinuz-*' | head -n 1)
  [[ -n $vmlinuz ]] || die "$key has no /boot/vmlinuz-*"
  basename "$vmlinuz" | sed 's/^vmlinuz-//' >"$tmp/release"
  mv "$vmlinuz" "$tmp/vmlinuz"
  rm -rf "${tmp:?}/boot"
  unpack_vmlinux "$tmp"
  touch "$tmp/complete"
  mv "$tmp" "$dir"
}

# Unpacks the ELF kernel (vmlinux) out of DIR/vmlinuz, where it is packed with xz as in Debian's:
# QEMU boots it directly through its PVH entry point, which spares the guest decompressing itself
# (under emulation that saves 2.5-3 s a boot). Where it cannot, the guest boots vmlinuz.
unpack_vmlinux() {
  local dir=$1 offset
  command -v xz >/dev/null 2>&1 || return 0
  offset=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$dir/vmlinuz" | head -n 1 | cut -d: -f1 || true)
  [[ -n $offset ]] || return 0
  # xz stops reading at the end of its stream, and tail may then die of SIGPIPE: only xz's status
  # counts.
  if (set +o pipefail && tail -c "+$((offset + 1))" "$dir/vmlinuz" | xz -dc --single-stream >"$dir/vmlinux.part" 2>/dev/null) &&
    [[ $(head -c 4 "$dir/vmlinux.part" | od -An -c | tr -d ' ') == 177ELF ]]; then
    mv "$dir/vmlinux.part" "$dir/vmlinux"
  else
    rm -f "$dir/vmlinux.part"
  fi
}

# Prints, in load order, the path (relative to the modules' folder) of each module in MODULES and
# of each of their dependencies, read from modules.dep.
resolve_modules() {
  local moddir=$1 line path deps name
  declare -A path_of=() deps_of=() seen=()
  while IFS= read -r line; do
    path=${line%%:*}
    deps=${line#*:}
    module_name "$path"
    path_of[$REPLY]=$path
    deps_of[$REPLY]=$deps
  done <"$moddir/modules.dep"
  visit() {
    local m dep
    module_name "$1"
    m=$REPLY
    [[ -z ${seen[$m]:-} ]] || return 0
    seen[$m]=1
    [[ -n ${path_of[$m]:-} ]] || die "the kernel has no module $m"
    for dep in ${deps_of[$m]}; do
      visit "$dep"
    done
    echo "${path_of[$m]}"
  }
  for name in $MODULES; do
    visit "$name"
  done
}
# Sets REPLY to a module's name: kernel/fs/9p/9p.ko -> 9p (modprobe treats - and _ alike).
module_name() {
  REPLY=${1##*/}
  REPLY=${REPLY%%.ko*}
  REPLY=${REPLY//-/_}
}

# Sets INITRAMFS to the initramfs for the kernel in KDIR, building it if needed.
build_initramfs() {
  local cache=$1 kdir=$2 release busybox key out tmp
  release=$(<"$kdir/release")
  busybox=$(command -v busybox)
  key=$( (
    echo "$release $MODULES"
    cat "$INIT_SCRIPT"
    sha256sum <"$busybox"
  ) | sha256sum | cut -c1-16)
  out=$cache/initramfs/$release-$key.cpio.gz
  INITRAMFS=$out
  [[ ! -f $out ]] || return 0
  say "building the initramfs for $release"
  mkdir -p "$cache/initramfs"
  tmp=$(mktemp -d "$cache/initramfs/.build.XXXXXX")
  TEMP_DIRS+=("$tmp")
  mkdir "$tmp/k"
  dpkg-deb -x "$kdir/kernel.deb" "$tmp/k"
  local moddir base
  for moddir in "$tmp/k/lib/modules/$release" "$tmp/k/usr/lib/modules/$release" ""; do
    [[ -z $moddir || -d $moddir ]] && break
  done
  [[ -n $moddir ]] || die "the kernel package has no modules for $release"
  base=${moddir%/lib/modules/"$release"}
  # The package ships no modules.dep: make it (kmod's depmod, or busybox's where kmod is missing).
  if command -v depmod >/dev/null 2>&1; then
    depmod -b "$base" "$release"
  else
    busybox depmod -b "$base" "$release"
  fi
  local root=$tmp/root path name
  mkdir -p "$root"/{bin,dev,proc,sys,mnt,newroot,lib/modules}
  cp "$busybox" "$root/bin/busybox"
  for name in $("$busybox" --list); do
    [[ $name == busybox ]] || ln -s busybox "$root/bin/$name"
  done
  resolve_modules "$moddir" >"$tmp/load-order"
  while IFS= read -r path; do
    module_name "$path"
    name=$REPLY
    case $path in
      *.ko) cp "$moddir/$path" "$root/lib/modules/$name.ko" ;;
      *.ko.xz) busybox xz -dc "$moddir/$path" >"$root/lib/modules/$name.ko" ;;
      *) die "cannot load a module packed as ${path##*/}" ;;
    esac
    echo "$name" >>"$root/modules.list"
  done <"$tmp/load-order"
  cp "$INIT_SCRIPT" "$root/init"
  chmod 0755 "$root/init"
  (cd "$root" && find . | busybox cpio -o -H newc -R 0:0 2>/dev/null) | gzip -1 >"$tmp/initramfs.cpio.gz"
  mv "$tmp/initramfs.cpio.gz" "$out"
}

# Sets KERNEL and INITRAMFS, fetching and building what the cache lacks.
prepare() {
  local cache lockfd
  check_tools "$1"
  cache=$(cache_dir)
  mkdir -p "$cache"
  exec {lockfd}>"$cache/lock"
  flock -w 600 "$lockfd" || die "the cache $cache stayed locked for 600 s"
  fetch_kernel "$cache"
  KERNEL=$KDIR/vmlinuz
  [[ ! -f $KDIR/vmlinux ]] || KERNEL=$KDIR/vmlinux
  build_initramfs "$cache" "$KDIR"
  exec {lockfd}>&-
}

# ---------------------------------------------------------------------------------------------------
# Host side: run

# QEMU splits its options at commas; a comma in a path is written twice.
qemu_escape() { echo "${1//,/,,}"; }

run() {
  local timeout=${BRAID_GUEST_TIMEOUT:-600} hosts=1 shares=() extra_env=()
  while (($#)); do
    case $1 in
      --timeout) timeout=${2:?--timeout needs SECONDS} && shift 2 ;;
      --hosts) hosts=${2:?--hosts needs 1 or 2} && shift 2 ;;
      --share) shares+=("${2:?--share needs a folder}") && shift 2 ;;
      --env) extra_env+=("${2:?--env needs a NAME}") && shift 2 ;;
      --) shift && break ;;
      *) usage ;;
    esac
  done
  (($#)) || usage
  [[ $timeout =~ ^[0-9]+$ ]] || usage
  [[ $hosts == 1 || $hosts == 2 ]] || usage
  local accel=${BRAID_GUEST_ACCEL:-tcg}
  [[ $accel == tcg || $accel == kvm ]] || die "BRAID_GUEST_ACCEL must be tcg or kvm, not $accel"

  prepare run

  local io
  io=$(mktemp -d "${TMPDIR:-/tmp}/braid-guest.XXXXXX")
  TEMP_DIRS+=("$io")
  printf '%s' "$io" >"$io/path"
  printf '%s' "$SELF" >"$io/entry"
  printf '%s' "$PWD" >"$io/cwd"
  printf '%s' "$hosts" >"$io/hosts"
  printf '%s\0' "$@" >"$io/argv"
  local name
  : >"$io/env"
  for name in $(compgen -e); do
    case $name in
      PATH | HOME | USER | LOGNAME | TERM | LANG | LC_* | TZ | BRAID_* | RUST_* | CARGO_*) ;;
      *) continue ;;
    esac
    printf '%s=%s\0' "$name" "${!name}" >>"$io/env"
  done
  for name in "${extra_env[@]}"; do
    [[ -v $name ]] && printf '%s=%s\0' "$name" "${!name}" >>"$io/env"
  done

  # The guest's console (the kernel's messages, the set-up's and any error) is ttyS1, this script's
  # stderr, with BRAID_GUEST_VERBOSE=1; otherwise ttyS2, kept in a file that is shown if the guest
  # fails, so that stderr carries only the command's.
  local verbose=${BRAID_GUEST_VERBOSE:-0} cmdline console
  # mitigations=off: the guest runs only the caller's command, and the CPU mitigations cost much
  # under emulation.
  cmdline="panic=-1 rdinit=/init mitigations=off ${BRAID_GUEST_APPEND:-}"
  # shellcheck disable=SC2054 # the commas are QEMU's
  if [[ $verbose == 1 ]]; then
    cmdline+=" console=ttyS1 loglevel=7 braid.verbose=1"
    console=(-chardev null,id=console)
  else
    cmdline+=" console=ttyS2 quiet loglevel=4"
    console=(-chardev "file,id=console,path=$(qemu_escape "$io/console.log")")
  fi

  # shellcheck disable=SC2054 # the commas are QEMU's
  local args=(
    -nodefaults -no-user-config -display none -no-reboot
    -machine pc -accel "$accel" -smp "${BRAID_GUEST_CPUS:-2}" -m "${BRAID_GUEST_MEMORY:-2048}"
    -kernel "$KERNEL" -initrd "$INITRAMFS" -append "$cmdline"
    # ttyS0 carries the command's stdout, ttyS1 its stderr, ttyS2 the console when not verbose.
    -chardev "file,id=out,path=$(qemu_escape "$io/stdout.fifo")" -serial chardev:out
    -chardev "file,id=err,path=$(qemu_escape "$io/stderr.fifo")" -serial chardev:err
    "${console[@]}" -serial chardev:console
    -fsdev "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap"
    -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot
    -fsdev "local,id=braidio,path=$(qemu_escape "$io"),security_model=none"
    -device virtio-9p-pci,fsdev=braidio,mount_tag=braidio
  )
  if [[ $accel == tcg ]]; then
    args+=(-cpu max)
  else
    args+=(-cpu host)
  fi
  local i=0 dir
  : >"$io/shares"
  for dir in "${shares[@]}"; do
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    printf '%s\0' "$dir" >>"$io/shares"
    args+=(-fsdev "local,id=share$i,path=$(qemu_escape "$dir"),security_model=none"
      -device "virtio-9p-pci,fsdev=share$i,mount_tag=braidshare$i")
    i=$((i + 1))
  done

  # The serial ports write into FIFOs; a cat copies each onto this script's stdout or stderr (so
  # the output shares their file offsets, whatever they are).
  mkfifo "$io/stdout.fifo" "$io/stderr.fifo"
  local out_cat err_cat
  cat "$io/stdout.fifo" &
  out_cat=$!
  cat "$io/stderr.fifo" >&2 &
  err_cat=$!
  PIDS+=("$out_cat" "$err_cat")

  local start=$SECONDS qemu
  qemu-system-x86_64 "${args[@]}" </dev/null &
  qemu=$!
  PIDS+=("$qemu")
  while kill -0 "$qemu" 2>/dev/null; do
    if ((SECONDS - start >= timeout)); then
      say "timed out after $timeout s: killing the guest (qemu pid $qemu)"
      exit "$EXIT_TIMEOUT"
    fi
    sleep 0.2
  done
  local qemu_status=0
  wait "$qemu" || qemu_status=$?
  forget_pid "$qemu"
  # qemu has closed the FIFOs (or never opened them, if it failed early): opening each once more
  # read-write, which does not block, and closing it lets its cat see the end once it has copied
  # what is left.
  : <>"$io/stdout.fifo"
  : <>"$io/stderr.fifo"
  local pid deadline=$((SECONDS + 10))
  for pid in "$out_cat" "$err_cat"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
      sleep 0.05
    done
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" || true
      forget_pid "$pid"
    fi
  done
  if [[ ! -s $io/status ]]; then
    if [[ -s $io/console.log ]]; then
      say "the guest's console (its last 40 lines):"
      tail -n 40 "$io/console.log" | tr -d '\r' >&2
    fi
    say "the guest ended (qemu status $qemu_status) without reporting the command's status"
    exit "$EXIT_GUEST_FAILED"
  fi
  [[ $verbose == 1 ]] && say "guest ran for $((SECONDS - start)) s"
  exit "$(<"$io/status")"
}

# ---------------------------------------------------------------------------------------------------
# Guest side: `guest.sh __guest IO_DIR` runs as PID 1 after the initramfs has switched to the overlay.

readonly NET=198.18.100

guest() {
  local io=$1
  export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  local verbose=0
  [[ " $(</proc/cmdline) " == *" braid.verbose=1 "* ]] && verbose=1
  # Each line with the guest's uptime, as the kernel's have.
  glog() {
    local up _
    if ((verbose)); then
      read -r up _ </proc/uptime
      echo "[$up] guest: $*" >&2
    fi
  }
  glog "guest.sh started"
  # Whatever happens, the guest powers off: the host reads the status file, if any.
  trap 'sync; echo o >/proc/sysrq-trigger; sleep 30' EXIT

  # The initramfs has mounted /dev/pts and /dev/shm and set the serial ports raw. Each program
  # started here is read from the host over 9p, slowly under emulation: few are.
  local i=0 dir
  local -a shares
  mapfile -d '' -t shares <"$io/shares"
  for dir in "${shares[@]}"; do
    mkdir -p "$dir"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none "braidshare$i" "$dir"
    glog "share $dir"
    i=$((i + 1))
  done

  local hosts
  hosts=$(<"$io/hosts")
  guest_network "$hosts"

  local -a envs argv
  mapfile -d '' -t envs <"$io/env"
  mapfile -d '' -t argv <"$io/argv"
  local cwd
  cwd=$(<"$io/cwd")
  local status=0
  (
    cd "$cwd"
    for e in "${envs[@]}"; do
      export "${e?}"
    done
    exec "${argv[@]}"
  ) </dev/null >/dev/ttyS0 2>/dev/ttyS1 || status=$?
  glog "command exited with status $status"
  echo "$status" >"$io/status"
}

# The veth pair braid0 (.1) -- braid1 (.2), one rxe device per host.
#
# Both ends are in the initial namespace (rxe works in no other). rxe looks up its routes bound to
# its own netdev, so a packet from rxe0 for .2 leaves through braid0 rather than lo and arrives on
# braid1; there its source .1 is an address of this machine, which the kernel drops as a martian
# unless accept_local is set. rp_filter is off (the kernel's default) for the same reason.
guest_network() {
  local hosts=$1 n
  glog "network"
  ip -batch - <<EOF
link set lo up
link add braid0 type veth peer name braid1
addr add $NET.1/24 dev braid0
addr add $NET.2/24 dev braid1
EOF
  for n in all braid0 braid1; do
    echo 0 >"/proc/sys/net/ipv4/conf/$n/rp_filter"
    echo 1 >"/proc/sys/net/ipv4/conf/$n/accept_local"
  done
  ip -batch - <<EOF
link set braid0 up
link set braid1 up
EOF

  local devs=(rxe0) netdevs=(braid0) addrs=("$NET.1") k
  if ((hosts == 2)); then
    devs+=(rxe1) netdevs+=(braid1) addrs+=("$NET.2")
  fi
  for k in "${!devs[@]}"; do
    echo "link add ${devs[k]} type rxe netdev ${netdevs[k]}"
  done | rdma -b -
  glog "rdma link add ${devs[*]}"
  # Wait (with a deadline) for each port to be ACTIVE and to have its RoCE v2 IPv4 GID.
  local deadline=$((SECONDS + 30)) port state want gid_index=
  for k in "${!devs[@]}"; do
    port=/sys/class/infiniband/${devs[k]}/ports/1
    guest_ipv4_gid "${addrs[k]}"
    want=$REPLY
    while :; do
      state=
      read -r state <"$port/state" 2>/dev/null || true
      if [[ $state == *ACTIVE* ]] && guest_find_gid "$port" "$want"; then
        break
      fi
      if ((SECONDS >= deadline)); then
        echo "guest: ${devs[k]} on ${netdevs[k]} has no ACTIVE port with GID $want after 30 s" >&2
        exit 1
      fi
      sleep 0.1
    done
    glog "${devs[k]} on ${netdevs[k]} (${addrs[k]}): ACTIVE, RoCE v2 GID $want at index $REPLY"
    if [[ -n $gid_index && $gid_index != "$REPLY" ]]; then
      echo "guest: the RoCE v2 IPv4 GID has index $gid_index on rxe0 but $REPLY on ${devs[k]}" >&2
      exit 1
    fi
    gid_index=$REPLY
  done
  export BRAID_GUEST=1
  export BRAID_GUEST_RDMA_DEVICES="${devs[*]}"
  export BRAID_GUEST_NETDEVS="${netdevs[*]}"
  export BRAID_GUEST_ADDRS="${addrs[*]}"
  export BRAID_GUEST_GID_INDEX=$gid_index
}

# Sets REPLY to an IPv4 address's GID as sysfs writes it:
# 198.18.100.1 -> 0000:0000:0000:0000:0000:ffff:c612:6401.
guest_ipv4_gid() {
  local a b c d
  IFS=. read -r a b c d <<<"$1"
  printf -v REPLY '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' "$a" "$b" "$c" "$d"
}

# Sets REPLY to the index of the port's RoCE v2 GID equal to WANT; fails if there is none. Builtins
# only: the table has 1024 entries.
guest_find_gid() {
  local port=$1 want=$2 f n gid type
  for f in "$port"/gids/*; do
    read -r gid <"$f" || continue
    [[ $gid == "$want" ]] || continue
    n=${f##*/}
    read -r type <"$port/gid_attrs/types/$n" || continue
    [[ $type == "RoCE v2" ]] || continue
    REPLY=$n
    return 0
  done
  return 1
}

# ---------------------------------------------------------------------------------------------------

case ${1:-} in
  prepare)
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    prepare prepare
    echo "kernel:    $KERNEL"
    echo "initramfs: $INITRAMFS"
    ;;
  run)
    shift
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    run "$@"
    ;;
  __guest)
    guest "$2"
    ;;
  *) usage ;;
esac
