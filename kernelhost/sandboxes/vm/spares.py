"""The fork's spares: a ready copy of each template RAM file a fork started from, with paused QEMUs
already started on it.

A page fork (``fork.py``) needs a private copy of the template's base RAM file to write the
parent's pages into. The next fork from that base renames the spare copy instead of copying the
base (a few hundred MiB), and its children are the QEMUs started on the copy beforehand
(paused, waiting for a state: QEMU's start and libvirt's work for it leave the fork's path). As
many QEMUs are started as the last fork from that base had children, at most ``SPARE_VMS_MAX``;
a fork with more children starts the rest itself, one with fewer destroys the ones it leaves.

The next spare is made as soon as a fork's children run, its copy in a thread at the idle
scheduling priority: it takes only CPU that nothing else wants, so it does not slow the
children's first calls (a copy at normal priority beside them does: bench/results/vm-mechanics.md),
and a fork right after another finds it made or part made. A fork that finds the copy
still running raises it to normal priority and waits for it (a busy host cannot starve it). A
host that forks holds one such file (the template's RAM size) and up to ``SPARE_VMS_MAX`` paused
QEMUs (~24 MiB each) per template it forks from; ``stop`` and ``clear`` remove them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from hypervisor import GuestImage, HypervisorError
from hypervisor.forkram import copy_base, make_ram_file
from hypervisor.ownership import give_to_qemu

from ...tasks import IdleThread, TaskSet

log = structlog.get_logger("kernelhost.vms")

SPARE_WAIT = 10.0  # the longest a fork waits for the spare being made before it copies the base
#: The spare QEMUs a fork leaves are destroyed this long after (libvirt's work for it beside
#: the children's first calls would slow those).
DROP_DELAY = 1.0
#: The most paused QEMUs kept on one spare (a fork of more children starts the rest itself).
SPARE_VMS_MAX = 5


@dataclass(frozen=True)
class Spare:
    """A ready copy of a template's RAM file, and the paused QEMUs started on it (``domains``,
    each waiting for a state like a child's)."""

    path: Path
    domains: tuple[str, ...] = ()


#: Starts a paused, incoming domain on a spare RAM file for a child of ``image``: its name.
StartVm = Callable[[Path, GuestImage], Awaitable[str]]


class Spares:
    """One spare per template RAM file that a fork started from (the module's docstring)."""

    def __init__(
        self,
        directory: Path,
        templates: Path,
        tasks: TaskSet,
        start_vm: StartVm | None = None,
        destroy_vm: Callable[[str], object] | None = None,
    ) -> None:
        self.dir = directory
        self.templates = templates  # where template RAM files live: the bases worth a spare
        self._tasks = tasks
        self._start_vm, self._destroy_vm = start_vm, destroy_vm
        self._making: dict[str, asyncio.Task[None]] = {}  # base -> the task making its spare
        self._copiers: dict[str, IdleThread] = {}  # base -> the thread copying it
        self._ready: dict[str, Spare] = {}
        self._stopped = False

    async def take(self, base: str | None, dest: Path) -> Spare | None:
        """Move the ready copy of ``base`` to ``dest`` (its QEMUs keep it mapped); None if there
        is none. A copy being made (a fork right after another) is waited for, up to
        ``SPARE_WAIT`` seconds: it is part done, and a second copy beside it would slow both
        (3.7 s against 0.2 s, seen)."""
        if base is None:
            return None
        making = self._making.get(base)
        if making is not None:
            copier = self._copiers.get(base)
            if copier is not None:
                copier.raise_priority()
            await asyncio.wait({making}, timeout=SPARE_WAIT)
        spare = self._ready.pop(base, None)
        if spare is None:
            return None
        try:
            os.rename(spare.path, dest)
        except FileNotFoundError:
            self.drop_vms(spare.domains)
            return None
        return Spare(dest, spare.domains)

    def refill(self, base: str | None, size: int, image: GuestImage | None = None, vms: int = 1) -> None:
        """Make the next copy of ``base`` (a template's RAM file) off the request path, at the
        idle priority, with ``vms`` paused QEMUs for children of ``image`` on it (at most
        ``SPARE_VMS_MAX``)."""
        for old in [b for b in self._ready if not os.path.exists(b)]:  # pruned since
            spare = self._ready.pop(old)
            spare.path.unlink(missing_ok=True)
            self.drop_vms(spare.domains)
        if base is None or base in self._making or base in self._ready or self._stopped:
            return
        if Path(base).parent.parent != self.templates:
            return
        vms = max(0, min(vms, SPARE_VMS_MAX))
        name = f"fork-spare:{Path(base).parent.name}"
        self._making[base] = self._tasks.spawn(self._make(base, size, image, vms), name=name)

    async def _make(self, base: str, size: int, image: GuestImage | None, vms: int) -> None:
        name = f"spare-{hashlib.sha256(base.encode()).hexdigest()[:16]}"
        tmp, path = self.dir / f"{name}.tmp", self.dir / name
        copier = self._copiers[base] = IdleThread()
        try:
            tmp.unlink(missing_ok=True)
            await copier.run(make_ram_file, tmp, size)
            await copier.run(copy_base, base, tmp)
            give_to_qemu(tmp, 0o600)
            os.rename(tmp, path)
            spare = Spare(path, await self._started_on(path, image, vms))
            if self._stopped:  # the service stopped while the spare was made
                path.unlink(missing_ok=True)
                self.drop_vms(spare.domains)
            else:
                self._ready[base] = spare
                log.info("vm.fork_spare_ready", base=base, vms=len(spare.domains))
        except (OSError, HypervisorError) as exc:
            log.warning("vm.fork_spare_failed", base=base, error=str(exc))
        finally:
            tmp.unlink(missing_ok=True)
            self._making.pop(base, None)
            self._copiers.pop(base, None)

    async def _started_on(self, path: Path, image: GuestImage | None, vms: int) -> tuple[str, ...]:
        """The paused QEMUs started on ``path``, side by side: those that started (a fork
        starts its children's other QEMUs itself)."""
        if self._start_vm is None or image is None or self._stopped or vms == 0:
            return ()
        start = self._start_vm
        results = await asyncio.gather(*(start(path, image) for _ in range(vms)), return_exceptions=True)
        for exc in [r for r in results if isinstance(r, BaseException)]:
            if not isinstance(exc, HypervisorError):
                self.drop_vms([r for r in results if isinstance(r, str)])
                raise exc
            log.warning("vm.fork_spare_vm_failed", ram=str(path), error=str(exc))
        return tuple(r for r in results if isinstance(r, str))

    def drop_vms(self, domains: tuple[str, ...] | list[str], delay: float = 0.0) -> None:
        """Destroy spare QEMUs no fork will use, in the background the service's close waits
        for; ``delay`` seconds from now (a fork's leftovers, ``DROP_DELAY``)."""
        destroy = self._destroy_vm
        if destroy is None or not domains:
            return
        if delay > 0 and not self._stopped:
            self._tasks.spawn(_after(delay, destroy, tuple(domains)), name="fork-spare-drop")
            return
        for domain in domains:
            destroy(domain)

    def stop(self) -> None:
        """A service stopping: the copies under way finish at normal priority and are removed
        (the service's close waits for them), the spares' paused QEMUs are destroyed."""
        self._stopped = True
        for copier in self._copiers.values():
            copier.raise_priority()
        for spare in self._ready.values():
            self.drop_vms(spare.domains)

    def clear(self) -> None:
        self._ready.clear()
        for path in self.dir.glob("spare-*"):
            path.unlink(missing_ok=True)


async def _after(delay: float, destroy: Callable[[str], object], domains: tuple[str, ...]) -> None:
    try:
        await asyncio.sleep(delay)
    finally:  # a cancelled wait destroys them at once
        for domain in domains:
            destroy(domain)
