#!/usr/bin/env bash
# Start libvirt's daemons when no init system runs them (containers, CI machines without
# systemd). On a host where libvirtd already answers, this does nothing.
#
# libvirtd runs under `tini -s`, a child subreaper: QEMU processes that libvirt double-forks are
# reaped at once instead of by a slow PID 1 (destroy then takes ~0.2 s instead of ~2 s).
set -eu -o pipefail

URI=${KERNELHOST_LIBVIRT_URI:-qemu:///system}
LOG_DIR=${KERNELHOST_LOG_DIR:-/var/log/kernelhost}

answers() { timeout 10 virsh -c "$URI" version >/dev/null 2>&1; }
# a live process of that name (pgrep alone also finds one that died and awaits reaping)
running() {
  local pid
  for pid in $(pgrep -x "$1"); do
    [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ] && return 0
  done
  return 1
}

# Without udev, /dev/kvm stays root-only (0600). libvirt then finds KVM "enabled when probed but
# not available now" for its qemu user and re-probes every QEMU binary on each domain start
# (about 9 s). Give it the group and mode udev gives it on a normal host (root:kvm 0660).
if [ "$(id -u)" -eq 0 ] && [ -c /dev/kvm ] && getent group kvm >/dev/null; then
  chgrp kvm /dev/kvm && chmod 0660 /dev/kvm
fi
# Live checkpoints (docs/checkpoints.md), only when asked for (KERNELHOST_LIVE_CHECKPOINTS=on):
# QEMU, running as libvirt's unprivileged user, may use userfaultfd only when this is 1.
if [ "$(id -u)" -eq 0 ] && [ "${KERNELHOST_LIVE_CHECKPOINTS:-off}" = on ] \
  && [ "$(cat /proc/sys/vm/unprivileged_userfaultfd 2>/dev/null)" = 0 ]; then
  echo 1 > /proc/sys/vm/unprivileged_userfaultfd \
    && echo "start-libvirt: set vm.unprivileged_userfaultfd=1 for live checkpoints" >&2 || true
fi
# virtlogd writes every VM's console log: a domain cannot start without it, even while libvirtd
# answers (it may have died or been stopped on its own)
if [ "$(id -u)" -eq 0 ] && ! running virtlogd; then
  mkdir -p /run/libvirt
  virtlogd -d
fi
if answers; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "libvirtd is not running at $URI and starting it needs root: run 'sudo $0'" >&2
  exit 1
fi
mkdir -p "$LOG_DIR" /run/libvirt
if ! running libvirtd; then
  echo "==> starting libvirtd (log: $LOG_DIR/libvirtd.log)"
  setsid tini -s -- libvirtd >>"$LOG_DIR/libvirtd.log" 2>&1 </dev/null &
fi
for _ in $(seq 1 100); do
  if answers; then
    exit 0
  fi
  sleep 0.2
done
echo "libvirtd did not answer at $URI within 20 s; see $LOG_DIR/libvirtd.log" >&2
exit 1
