"""``kernelhost doctor``'s checks, on libvirt's test driver and made-up probe answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernelhost.cli.doctor import _accel, _shm, run_checks
from kernelhost.config import Settings

pytestmark = pytest.mark.unit


def test_a_host_without_images_is_told_to_build_them(tmp_path: Path) -> None:
    settings = Settings.load(
        {},
        libvirt_uri="test:///default",
        image_dir=tmp_path / "none",
        state_dir=tmp_path / "state",
        run_dir=tmp_path / "run",
        ram_dir=tmp_path / "ram",
        api_keys=("unit-test-key-0123456789",),
    )
    checks = {c.name: c for c in run_checks(settings)}
    assert checks["libvirt"].ok and "test:///default" in checks["libvirt"].detail
    assert not checks["images"].ok and "make image" in checks["images"].line()
    assert not checks["acceleration"].ok and "not probed" in checks["acceleration"].detail
    assert checks["vm memory tmpfs"].name in {c.name for c in checks.values()}


def test_an_unreachable_libvirt_says_how_to_start_it(tmp_path: Path) -> None:
    settings = Settings.load(
        {},
        libvirt_uri="qemu+unix:///system?socket=/nonexistent/sock",
        image_dir=tmp_path,
        state_dir=tmp_path / "state",
        run_dir=tmp_path / "run",
        ram_dir=tmp_path / "ram",
        api_keys=("unit-test-key-0123456789",),
    )
    libvirt = next(c for c in run_checks(settings) if c.name == "libvirt")
    assert not libvirt.ok and "KERNELHOST_LIBVIRT_URI" in libvirt.line()


def test_acceleration_answers() -> None:
    assert _accel(lambda: ("kvm", "probe booted")).ok

    tcg = _accel(lambda: ("tcg", "KVM guest did not start:\nassertion failed"))
    assert not tcg.ok and tcg.warning and tcg.line().startswith("warn")
    assert "\n" not in tcg.detail

    def refused() -> tuple[str, str]:
        raise RuntimeError("accel=kvm was configured but KVM cannot boot a guest here")

    failed = _accel(refused)
    assert not failed.ok and not failed.warning and "KERNELHOST_ACCEL=auto" in failed.line()


def test_tmpfs_space(tmp_path: Path) -> None:
    assert _shm(tmp_path / "ram", vm_memory_mib=1).name == "vm memory tmpfs"
    too_big = _shm(tmp_path / "ram", vm_memory_mib=10**9)
    assert not too_big.ok and "need at least" in too_big.detail and "fix:" in too_big.line()


def test_live_checkpoints_warn_while_qemu_may_not_use_userfaultfd(tmp_path: Path) -> None:
    from kernelhost.cli.doctor import _live_checkpoints

    sysctl = tmp_path / "unprivileged_userfaultfd"
    sysctl.write_text("0\n")
    check = _live_checkpoints("on", sysctl)
    assert not check.ok and check.warning and "vm.unprivileged_userfaultfd=1" in check.fix
    sysctl.write_text("1\n")
    assert _live_checkpoints("on", sysctl).ok
    assert _live_checkpoints("off", tmp_path / "missing").ok
