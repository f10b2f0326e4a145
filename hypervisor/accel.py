"""Choose the accelerator by booting a real probe guest, never by looking at /dev/kvm.

On some hosts /dev/kvm exists but cannot run a normal guest (nested or PVM-style KVM: the guest
kernel hangs, or ``-cpu host`` aborts). The probe boots the template's own kernel and initramfs
under KVM with ``kh.probe`` on the command line; the initramfs then prints a marker and powers
off. Only a guest that gets that far proves KVM usable. The answer is cached per host kernel,
QEMU and libvirt version (in the host's image cache: ``Settings.accel_cache_file``), so the
probe (at most ``timeout`` seconds) runs once per host, not once per service's state dir.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import libvirt

from .errors import HypervisorError
from .host import Hypervisor
from .images import GuestImage

PROBE_MARKER = "KERNELHOST-PROBE-OK"
MODES = ("auto", "kvm", "tcg")


def choose_accel(
    hv: Hypervisor, image: GuestImage, mode: str, cache_file: Path, timeout: float = 20.0
) -> tuple[str, str]:
    """Return (accel, reason): accel is "kvm" or "tcg"."""
    if mode not in MODES:
        raise ValueError(f"accel must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "tcg":
        return "tcg", "configured"
    fingerprint = {"kernel": platform.release(), **hv.versions()}
    cached = _read_cache(cache_file)
    if mode == "auto" and cached.get("fingerprint") == fingerprint:
        return str(cached["accel"]), f"cached probe: {cached.get('reason')}"
    ok, reason = probe_kvm(hv, image, timeout)
    if mode == "kvm" and not ok:
        raise RuntimeError(f"accel=kvm was configured but KVM cannot boot a guest here: {reason}")
    accel = "kvm" if ok else "tcg"
    try:  # a cache that cannot be written costs the next start a probe, nothing else
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps({"fingerprint": fingerprint, "accel": accel, "reason": reason}))
    except OSError:
        pass
    return accel, reason


def _read_cache(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def probe_kvm(hv: Hypervisor, image: GuestImage, timeout: float) -> tuple[bool, str]:
    """Boot a probe guest under KVM; (True, why) if it reached the initramfs."""
    if not os.path.exists("/dev/kvm"):
        return False, "no /dev/kvm"
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
        os.close(fd)
    except OSError as exc:
        return False, f"/dev/kvm cannot be opened: {exc}"
    name = f"{hv.prefix}probe-{os.getpid()}"
    spec = hv.spec_for(name, image, accel="kvm", memory_mib=256, vcpus=1, cmdline_extra="kh.probe")
    t0 = time.monotonic()
    try:
        try:
            hv.start(spec)
        except (libvirt.libvirtError, HypervisorError, OSError) as exc:  # KVM is not usable
            return False, f"KVM guest did not start: {exc}"
        while time.monotonic() - t0 < timeout:
            if _marker_seen(spec.console_log):
                return True, f"KVM probe guest booted in {time.monotonic() - t0:.2f}s"
            if not hv.is_running(name):
                break
            time.sleep(0.1)
        if _marker_seen(spec.console_log):
            return True, f"KVM probe guest booted in {time.monotonic() - t0:.2f}s"
        return False, f"KVM probe guest did not reach its initramfs within {timeout:.0f}s"
    finally:
        try:
            hv.destroy(name)
        except libvirt.libvirtError:
            hv.cleanup_files(name)


def _marker_seen(log: Path) -> bool:
    try:
        return PROBE_MARKER in log.read_text(errors="replace")
    except OSError:
        return False
