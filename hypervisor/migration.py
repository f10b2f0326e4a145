"""Device-state save and load through QEMU's migration, driven by libvirt's QEMU passthrough.

A domain is frozen by pausing it and migrating to a file descriptor (``migrate fd:NAME``, the fd
handed over with ``getfd``; ``exec:`` is refused by libvirt's seccomp flags). With the
``x-ignore-shared`` capability, RAM blocks mapped shared from a file are skipped: the state is a
few hundred KiB and the RAM stays in its file, which clones then map privately. Without it, the
whole RAM goes into the state (hibernation, and the first step of a fork).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import libvirt
import libvirt_qemu

from .errors import HypervisorError

UNTHROTTLED = 64 * 2**30  # bytes/s


class LiveSaveUnavailable(HypervisorError):
    """QEMU refused a background snapshot: the host does not let it use userfaultfd."""


class MigrationFailed(HypervisorError):
    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"saving or loading the state of domain {name!r} failed: {detail}")
        self.name = name


def qmp(
    dom: libvirt.virDomain,
    command: str,
    files: list[int] | None = None,
    args: dict[str, Any] | None = None,
    **arguments: Any,
) -> Any:
    """Run one QMP command on the domain's monitor; returns its ``return`` value.

    Arguments come as keywords, or in ``args`` for names that are not identifiers."""
    arguments = {**(args or {}), **arguments}
    cmd = json.dumps({"execute": command, **({"arguments": arguments} if arguments else {})})
    try:
        if files:
            raw, _ = libvirt_qemu.qemuMonitorCommandWithFiles(dom, cmd, files, 0)
        else:
            raw = libvirt_qemu.qemuMonitorCommand(dom, cmd, 0)
    except libvirt.libvirtError as exc:
        raise MigrationFailed(dom.name(), f"{command}: {exc}") from exc
    reply = json.loads(raw)
    if "error" in reply:
        raise MigrationFailed(dom.name(), f"{command}: {reply['error'].get('desc', reply['error'])}")
    return reply.get("return")


def _set_ignore_shared(dom: libvirt.virDomain, on: bool) -> None:
    qmp(dom, "migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": on}])


def _hand_fd(dom: libvirt.virDomain, fd: int, fdname: str) -> None:
    qmp(dom, "getfd", files=[fd], fdname=fdname)


def _hand_new_file(dom: libvirt.virDomain, path: Path, fdname: str) -> None:
    """Create ``path`` (0600) and hand QEMU a descriptor of it named ``fdname``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        _hand_fd(dom, fd, fdname)
    finally:
        os.close(fd)  # QEMU holds its own copy now


#: run states QEMU keeps while it ends a migration: ``cont`` then fails ("Migration is not
#: finalized yet"), so a save or load is over only once the VM has left them
_MIGRATING_RUN_STATES = frozenset({"finish-migrate", "inmigrate"})


def _wait_migration(dom: libvirt.virDomain, timeout: float) -> dict[str, Any]:
    """Wait until the domain's migration is over: completed, and its run state settled.

    QEMU reports ``completed`` from its migration thread before the main loop moves the VM out
    of ``finish-migrate`` (to ``postmigrate``; a load's ``inmigrate`` to ``paused``); a resume in
    that window is refused, which CI met as a checkpoint's 503."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    done: dict[str, Any] | None = None
    while True:
        if done is None:
            info = qmp(dom, "query-migrate") or {}
            status = info.get("status")
            if status == "completed":
                done = dict(info)
        if done is not None:
            status = (qmp(dom, "query-status") or {}).get("status")
            if status not in _MIGRATING_RUN_STATES:
                return done
            status = f"completed, the VM still {status}"
        elif status in ("failed", "cancelled"):
            raise MigrationFailed(dom.name(), f"migration {status}: {info.get('error-desc', '')}")
        if time.monotonic() > deadline:
            raise MigrationFailed(dom.name(), f"migration still {status!r} after {timeout:.0f}s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def save_state(dom: libvirt.virDomain, path: Path, *, ignore_shared: bool, timeout: float = 120.0) -> int:
    """Write the paused domain's state to ``path``; returns its size in bytes."""
    if dom.info()[0] != libvirt.VIR_DOMAIN_PAUSED:
        raise MigrationFailed(dom.name(), "the domain must be paused before its state is saved")
    _set_ignore_shared(dom, ignore_shared)
    # QEMU throttles migration to 128 MiB/s by default; a paused VM writing to a local file
    # has no reason to wait
    qmp(dom, "migrate-set-parameters", args={"max-bandwidth": UNTHROTTLED})
    _hand_new_file(dom, path, "khsave")
    qmp(dom, "migrate", uri="fd:khsave")
    _wait_migration(dom, timeout)
    _set_ignore_shared(dom, False)
    return path.stat().st_size


def save_devices(dom: libvirt.virDomain, path: Path) -> None:
    """Write the paused domain's device state, without any RAM, to ``path`` (QEMU opens it;
    its directory must be QEMU's to write). Not a stream ``load_state`` takes as it is: it has no
    configuration section (``forkram.device_stream`` adds it)."""
    if dom.info()[0] != libvirt.VIR_DOMAIN_PAUSED:
        raise MigrationFailed(dom.name(), "the domain must be paused before its devices are saved")
    qmp(dom, "xen-save-devices-state", filename=str(path), live=False)


def load_state(dom: libvirt.virDomain, path: Path, *, ignore_shared: bool, timeout: float = 120.0) -> None:
    """Load ``path`` into a domain started paused with ``-incoming defer``; it stays paused."""
    _set_ignore_shared(dom, ignore_shared)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _hand_fd(dom, fd, "khload")
    finally:
        os.close(fd)
    qmp(dom, "migrate-incoming", uri="fd:khload")
    _wait_migration(dom, timeout)
    # left on, a later full save of this domain would skip its RAM and could not be restored
    _set_ignore_shared(dom, False)


def migrate_live(src: libvirt.virDomain, dst: libvirt.virDomain, *, timeout: float = 120.0) -> None:
    """Copy the paused ``src`` (RAM included) straight into ``dst``, started paused with
    ``-incoming defer``, over a socket pair: nothing is written to a file, and sending and
    loading overlap. ``dst`` stays paused; ``src`` is left paused for the caller to resume."""
    import socket

    if src.info()[0] != libvirt.VIR_DOMAIN_PAUSED:
        raise MigrationFailed(src.name(), "the source must be paused before it is copied")
    a, b = socket.socketpair()
    try:
        _set_ignore_shared(dst, False)
        _hand_fd(dst, b.fileno(), "khin")
        _set_ignore_shared(src, False)
        qmp(src, "migrate-set-parameters", args={"max-bandwidth": UNTHROTTLED})
        _hand_fd(src, a.fileno(), "khout")
    finally:
        a.close()
        b.close()
    qmp(dst, "migrate-incoming", uri="fd:khin")
    qmp(src, "migrate", uri="fd:khout")
    _wait_migration(src, timeout)
    _wait_migration(dst, timeout)


def begin_live_save(dom: libvirt.virDomain, path: Path, *, timeout: float = 10.0) -> None:
    """Start saving the running domain's whole state to ``path`` as it is *now*, and return once
    it runs again: QEMU's background snapshot pauses it only to save the devices and to
    write-protect its RAM (userfaultfd), then streams each page before the guest's first write
    to it. ``finish_live_save`` waits for the file. ``LiveSaveUnavailable`` if the host kernel
    does not let QEMU use userfaultfd (``vm.unprivileged_userfaultfd``)."""
    try:
        qmp(
            dom,
            "migrate-set-capabilities",
            capabilities=[{"capability": "background-snapshot", "state": True}],
        )
    except MigrationFailed as exc:
        if "not supported" in str(exc):
            raise LiveSaveUnavailable(str(exc)) from exc
        raise
    try:
        _set_ignore_shared(dom, False)
        qmp(dom, "migrate-set-parameters", args={"max-bandwidth": UNTHROTTLED})
        _hand_new_file(dom, path, "khlive")
        # paused by us, resumed by QEMU once the devices are saved: the resume is the sign that
        # the state being written is this moment's
        dom.suspend()
        try:
            qmp(dom, "migrate", uri="fd:khlive")
        except BaseException:
            dom.resume()
            raise
        _wait_running(dom, timeout)
    except BaseException:
        qmp(
            dom,
            "migrate-set-capabilities",
            capabilities=[{"capability": "background-snapshot", "state": False}],
        )
        raise


def _wait_running(dom: libvirt.virDomain, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (qmp(dom, "query-status") or {}).get("running"):
        info = qmp(dom, "query-migrate") or {}
        if info.get("status") in ("failed", "cancelled"):
            dom.resume()
            raise MigrationFailed(
                dom.name(), f"background snapshot {info['status']}: {info.get('error-desc', '')}"
            )
        if time.monotonic() > deadline:
            dom.resume()
            raise MigrationFailed(
                dom.name(), f"the domain did not run again within {timeout:.0f}s of its snapshot"
            )
        time.sleep(0.002)


def finish_live_save(dom: libvirt.virDomain, path: Path, *, timeout: float = 120.0) -> int:
    """Wait for a save ``begin_live_save`` started; returns the file's size."""
    try:
        _wait_migration(dom, timeout)
    finally:
        qmp(
            dom,
            "migrate-set-capabilities",
            capabilities=[{"capability": "background-snapshot", "state": False}],
        )
    return path.stat().st_size
