"""Fork at the VM level: a live VM's RAM and devices become the start of ``n`` children.

Page by page where the parent maps a base RAM file privately (a clone of a template snapshot, a
fork's child, a restored checkpoint): the children's RAM file is the base file's data plus the
pages the parent wrote (``hypervisor.forkram``), so the parent's pause and the copy grow with
what it changed, not with its RAM. The children's QEMU processes start (paused) while the copy
runs: nothing reads their RAM until they run. For a template's base file one copy is kept ready
(``Spares``), with a paused QEMU already started on it, so a fork copies only the written pages
and its first child skips QEMU's start; the next spare is made in the background.

Otherwise (a VM woken from disk maps its RAM shared; a host that does not let the service read
QEMU's memory) the whole RAM is copied into an intermediate VM frozen like a template.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from hypervisor import DomainSpec, GuestImage, HypervisorError, PageForkUnavailable
from hypervisor.forkram import RamMapping, copy_base, make_ram_file
from hypervisor.host import PageCopy, give_to_qemu

from ..channel import AgentClient
from ..tasks import TaskSet, to_thread_to_the_end
from .snapshots import Snapshot

if TYPE_CHECKING:
    from .vms import Launched, VmFactory

log = structlog.get_logger("kernelhost.vms")

Children = list[tuple[str, dict[str, str]]]
SPARE_WAIT = 10.0  # the longest a fork waits for the spare being made before it copies the base
#: The next spare is copied this long after a fork's children run: its copy (a few hundred MiB,
#: a host core for ~0.3 s) beside their first calls made those 0.24-0.34 s instead of 0.14 s.
SPARE_DELAY = 1.0


@dataclass(frozen=True)
class Spare:
    """A ready copy of a template's RAM file, and the paused QEMU started on it (``domain``,
    waiting for a state like a child's) where one could be started."""

    path: Path
    domain: str | None = None


#: Starts a paused, incoming domain on a spare RAM file for a child of ``image``: its name.
StartVm = Callable[[Path, GuestImage], Awaitable[str]]


class Spares:
    """One ready copy of each template RAM file that a fork started from: the next fork from
    it renames the copy instead of copying the base (a few hundred MiB, ~0.2 s), and its first
    child is the QEMU ``start_vm`` started on the copy (QEMU's start, ~0.1 s, off the fork's
    path). A host that forks holds one such file and paused QEMU per template it forks from;
    ``stop`` and ``clear`` remove them."""

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
        self._making: dict[str, asyncio.Task[None]] = {}  # base -> the task making its copy
        self._copying: set[str] = set()  # bases whose copy has begun (past its delay)
        self._ready: dict[str, Spare] = {}
        self._stopped = False

    async def take(self, base: str | None, dest: Path) -> Spare | None:
        """Move the ready copy of ``base`` to ``dest`` (its QEMU keeps it mapped); None if there
        is none. A copy being made (a fork right after another) is waited for, up to
        ``SPARE_WAIT`` seconds: it is part done, and a second copy beside it would slow both
        (3.7 s against 0.2 s, seen)."""
        making = self._making.get(base) if base is not None else None
        if making is not None:
            if base not in self._copying:
                making.cancel()  # still in its delay: the fork copies for itself, as fast
            await asyncio.wait({making}, timeout=SPARE_WAIT)
        spare = self._ready.pop(base, None) if base is not None else None
        if spare is None:
            return None
        try:
            os.rename(spare.path, dest)
        except FileNotFoundError:
            self._drop_vm(spare)
            return None
        return Spare(dest, spare.domain)

    def refill(
        self, base: str | None, size: int, image: GuestImage | None = None, delay: float = 0.0
    ) -> None:
        """Make the next copy of ``base`` (a template's RAM file) off the request path, starting
        ``delay`` seconds from now, and a paused QEMU for a child of ``image`` on it; a fork
        within the delay cancels it (``take``)."""
        for old in [b for b in self._ready if not os.path.exists(b)]:  # pruned since
            spare = self._ready.pop(old)
            spare.path.unlink(missing_ok=True)
            self._drop_vm(spare)
        if base is None or base in self._making or base in self._ready or self._stopped:
            return
        if Path(base).parent.parent != self.templates:
            return
        name = f"fork-spare:{Path(base).parent.name}"
        self._making[base] = self._tasks.spawn(self._make(base, size, image, delay), name=name)

    async def _make(self, base: str, size: int, image: GuestImage | None, delay: float) -> None:
        name = f"spare-{hashlib.sha256(base.encode()).hexdigest()[:16]}"
        tmp, path = self.dir / f"{name}.tmp", self.dir / name
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            self._copying.add(base)
            tmp.unlink(missing_ok=True)
            await asyncio.to_thread(make_ram_file, tmp, size)
            await asyncio.to_thread(copy_base, base, tmp)
            give_to_qemu(tmp, 0o600)
            os.rename(tmp, path)
            spare = Spare(path, await self._started_on(path, image))
            if self._stopped:  # the service stopped while the copy ran
                path.unlink(missing_ok=True)
                self._drop_vm(spare)
            else:
                self._ready[base] = spare
        except (OSError, HypervisorError) as exc:
            log.warning("vm.fork_spare_failed", base=base, error=str(exc))
        finally:
            tmp.unlink(missing_ok=True)
            self._making.pop(base, None)
            self._copying.discard(base)

    async def _started_on(self, path: Path, image: GuestImage | None) -> str | None:
        """The paused QEMU started on ``path``; None where none starts (the fork starts its
        child's QEMU itself then)."""
        if self._start_vm is None or image is None or self._stopped:
            return None
        try:
            return await self._start_vm(path, image)
        except HypervisorError as exc:
            log.warning("vm.fork_spare_vm_failed", ram=str(path), error=str(exc))
            return None

    def _drop_vm(self, spare: Spare) -> None:
        if spare.domain is not None and self._destroy_vm is not None:
            self._destroy_vm(spare.domain)

    def stop(self) -> None:
        """A service stopping: cancel the copies still waiting out their delay, destroy the
        spares' paused QEMUs (in the background the service's close waits for)."""
        self._stopped = True
        for base, task in list(self._making.items()):
            if base not in self._copying:
                task.cancel()
        for spare in self._ready.values():
            self._drop_vm(spare)

    def clear(self) -> None:
        self._ready.clear()
        for path in self.dir.glob("spare-*"):
            path.unlink(missing_ok=True)


class VmForker:
    """``VmFactory.fork``: the copy, then the children."""

    def __init__(self, vms: VmFactory) -> None:
        self.vms = vms
        self.hv = vms.hv
        self.spares = Spares(
            vms.forks_dir, vms.snapshots.dir, vms.background, self._start_spare_vm, vms.destroy_later
        )

    async def fork(self, parent: str, image: GuestImage, children: Children) -> list[tuple[str, AgentClient]]:
        """Clone the running ``parent`` into ``children`` (domain, metadata); parent resumes.
        Each child's domain and agent: the first child's domain is the spare's paused QEMU where
        one was ready (named before the fork, relabelled with the child's metadata). The RAM
        file is unlinked once they run (their mappings keep it); on failure nothing of the
        children is left."""
        domains = [domain for domain, _ in children]
        work = self.vms.forks_dir / uuid.uuid4().hex[:12]
        work.mkdir(parents=True)
        give_to_qemu(work.parent)
        give_to_qemu(work)
        snap = Snapshot(image.template, "fork", work, image.key)
        mid: str | None = None
        launched: list[Launched] = []
        try:
            memory = self.vms.snapshots.shape_of(image)[0] << 20
            try:
                source = await asyncio.to_thread(self.hv.fork_source, parent, memory)
            except PageForkUnavailable as exc:
                log.info("vm.fork_whole_ram", parent=parent, reason=str(exc))
                mid = self.hv.new_name()  # named first: a copy that fails half-way is destroyed too
                await self._copy_whole(parent, mid, image, snap)
                launched = await self._gather(self.vms.clone(d, image, snap, m) for d, m in children)
            else:
                launched = await self._fork_pages(parent, source, image, snap, children, domains)
            self._log_children(parent, launched)
            return [(domain, one.agent) for domain, one in zip(domains, launched, strict=True)]
        except BaseException:
            for one in launched:
                await one.agent.close()
            for domain in domains:
                await self.vms.destroy_tracked(domain)
            raise
        finally:
            # the paused copy (if any) and the file names go, off the caller's path
            self.vms.background.spawn(self._drop(mid, work), name=f"drop-fork:{work.name}")

    async def _fork_pages(
        self,
        parent: str,
        source: RamMapping,
        image: GuestImage,
        snap: Snapshot,
        children: Children,
        domains: list[str],
    ) -> list[Launched]:
        """The children of a page fork; ``domains[0]`` becomes the spare's QEMU if one is ready."""
        t0 = time.monotonic()
        machine = await asyncio.to_thread(self.hv.machine_type, parent)
        spare = await self.spares.take(source.path, snap.ram)
        if spare is None:
            await asyncio.to_thread(make_ram_file, snap.ram, source.size)
        give_to_qemu(snap.ram, 0o600)
        prestarted = await self._adopt_spare_vm(spare, domains, children[0][1])
        specs = [
            self.vms.spec(d, image, m, mem_path=snap.ram, incoming=True)
            for d, (_, m) in zip(domains, children, strict=True)
        ]
        copy = asyncio.to_thread(
            self.hv.fork_pages, parent, source, snap.ram, snap.state, base=spare is None, machine=machine
        )
        qemu_started: list[float] = []

        async def start(spec: DomainSpec) -> None:
            await to_thread_to_the_end(self.hv.start_incoming, spec)
            qemu_started.append(round(time.monotonic() - t0, 3))

        to_start = specs[1:] if prestarted else specs
        started = await asyncio.gather(copy, *(start(s) for s in to_start), return_exceptions=True)
        for result in started:
            if isinstance(result, BaseException):
                raise result
        copied: PageCopy = started[0]  # type: ignore[assignment]
        log.info(
            "vm.fork_copied",
            parent=parent,
            how="pages",
            spare=spare is not None,
            prestarted=prestarted,
            base_mib=copied.base >> 20,
            written_mib=copied.written >> 20,
            allocated=round(copied.allocate_seconds, 3),
            paused_pages=round(copied.pages_seconds, 3),
            paused_devices=round(copied.devices_seconds, 3),
            qemu_started=qemu_started,
            seconds=round(time.monotonic() - t0, 3),
        )

        async def load(spec_index: int) -> Launched:
            spec = specs[spec_index]
            return await self.vms.load_attached(
                spec, snap.state, ignore_shared=False, how="fork", t0=time.monotonic()
            )

        launched = await self._gather(load(i) for i in range(len(specs)))
        # the next ready copy once the children run and have answered their first calls: its
        # copy would compete with those
        self.spares.refill(source.path, source.size, image, delay=SPARE_DELAY)
        return launched

    async def _start_spare_vm(self, ram: Path, image: GuestImage) -> str:
        """A paused QEMU on the spare file ``ram``, waiting for a child's state."""
        domain = self.hv.new_name()
        meta = {"role": "fork-spare", "template": image.template}
        spec = self.vms.spec(domain, image, meta, mem_path=ram, incoming=True)
        await to_thread_to_the_end(self.hv.start_incoming, spec)
        return domain

    async def _adopt_spare_vm(self, spare: Spare | None, domains: list[str], meta: dict[str, str]) -> bool:
        """Make the spare's paused QEMU the first child (``domains[0]``), labelled with its
        ``meta`` in the background; False where there is none, or it has died (then gone)."""
        if spare is None or spare.domain is None:
            return False
        if not await asyncio.to_thread(self.hv.is_running, spare.domain):
            self.vms.destroy_later(spare.domain)
            return False
        domains[0] = spare.domain
        self.vms.background.spawn(self._label(spare.domain, meta), name=f"label:{spare.domain}")
        return True

    async def _label(self, domain: str, meta: dict[str, str]) -> None:
        try:
            await asyncio.to_thread(self.hv.set_metadata, domain, meta)
        except HypervisorError as exc:
            log.warning("vm.fork_label_failed", domain=domain, error=str(exc))

    async def _copy_whole(self, parent: str, mid: str, image: GuestImage, snap: Snapshot) -> None:
        """The parent's whole RAM into an intermediate VM ``mid`` with ``snap.ram`` as its shared
        RAM file, whose device state is then saved like a template's."""
        t0 = time.monotonic()
        spec = self.vms.spec(mid, image, {"role": "fork"}, mem_path=snap.ram, mem_share=True, incoming=True)
        await asyncio.to_thread(self.hv.fork_into, parent, spec, snap.state)
        log.info("vm.fork_copied", parent=parent, how="whole", seconds=round(time.monotonic() - t0, 3))

    @staticmethod
    async def _gather(coros: Iterable[Awaitable[Launched]]) -> list[Launched]:
        """Every launch's result; if one failed, the others' agents are closed and it is raised
        (the caller destroys the domains)."""
        results = await asyncio.gather(*coros, return_exceptions=True)
        done = [r for r in results if not isinstance(r, BaseException)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for one in done:
                await one.agent.close()
            raise failed[0]
        return done

    @staticmethod
    def _log_children(parent: str, launched: list[Launched]) -> None:
        log.info(
            "vm.fork_children",
            parent=parent,
            start=[round(one.timings.start, 3) for one in launched],
            attach=[round(one.timings.attach, 3) for one in launched],
            hygiene=[round(one.timings.hygiene, 3) for one in launched],
        )

    async def _drop(self, domain: str | None, work: Path) -> None:
        try:
            if domain is not None:
                with contextlib.suppress(HypervisorError):
                    await asyncio.to_thread(self.hv.destroy, domain)
        finally:
            shutil.rmtree(work, ignore_errors=True)
