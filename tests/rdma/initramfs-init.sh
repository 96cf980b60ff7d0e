#!/bin/sh
# /init of the guest's initramfs, run by busybox sh as PID 1.
#
# Loads the modules listed in /modules.list (in that order), mounts the host's / read-only over 9p
# (tag hostroot) under a tmpfs overlay, mounts the run's read-write folder (tag braidio) at the same
# path it has on the host, and hands over to the host's guest.sh (`guest.sh __guest IO_DIR`), which
# sets up the RDMA devices and runs the command. Anything that fails powers the guest off: the host
# then finds no exit status in the run's folder and reports it.
#
# The run's folder holds `path` (its own path on the host) and `entry` (the path of guest.sh).
# The kernel's command line may carry braid.verbose=1 to list each step.
PATH=/bin

# No /dev/console in the archive: mount devtmpfs first, then take the console as stdio.
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys

verbose=0
case " $(cat /proc/cmdline) " in *" braid.verbose=1 "*) verbose=1 ;; esac
log() {
  [ "$verbose" = 1 ] && echo "[$(cat /proc/uptime /newroot/proc/uptime 2>/dev/null | cut -d' ' -f1 | head -n 1)] guest init: $*"
  return 0
}
fail() {
  echo "guest init: $*"
  echo o >/proc/sysrq-trigger
  sleep 30
  exit 1
}

while read -r module; do
  log "insmod $module"
  insmod "/lib/modules/$module.ko" || fail "insmod $module failed"
done </modules.list

# Large 9p messages make reading the host's files much faster; the host's / is cached loosely
# (it is read-only here and a run is short), the run's folder not at all (both sides write to it).
opts=trans=virtio,version=9p2000.L,msize=512000
mkdir -p /mnt/host /mnt/io /mnt/rw /newroot
mount -t 9p -o "$opts,ro,cache=loose" hostroot /mnt/host || fail "cannot mount the host's / (9p tag hostroot)"
mount -t 9p -o "$opts,cache=none" braidio /mnt/io || fail "cannot mount the run's folder (9p tag braidio)"
mount -t tmpfs -o mode=0755 overlay-rw /mnt/rw
mkdir /mnt/rw/upper /mnt/rw/work
mount -t overlay -o lowerdir=/mnt/host,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work overlay /newroot ||
  fail "cannot mount the overlay over the host's /"
log "root: host / (read-only) under a tmpfs overlay"

io=$(cat /mnt/io/path) || fail "the run's folder has no file 'path'"
entry=$(cat /mnt/io/entry) || fail "the run's folder has no file 'entry'"
for d in dev proc sys; do
  mount --move "/$d" "/newroot/$d"
done
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
echo braid-guest >/newroot/proc/sys/kernel/hostname
# ttyS0 and ttyS1 carry the command's stdout and stderr: bytes as they are (no \n to \r\n).
stty -F /newroot/dev/ttyS0 raw -echo
stty -F /newroot/dev/ttyS1 raw -echo
mkdir -p "/newroot$io"
mount --move /mnt/io "/newroot$io"
log "run folder at $io; handing over to $entry"
exec switch_root /newroot /bin/bash "$entry" __guest "$io"
