"""Fork at the VM level: a live VM's RAM and devices become the start of ``n`` children.

Page by page where the parent maps a base RAM file privately (a clone of a template snapshot, a
fork's child, a restored checkpoint): the children's RAM file is the base file's data plus the
pages the parent wrote (``hypervisor.forkram``), so the parent's pause and the copy grow with
what it changed, not with its RAM. The children's QEMU processes start (paused) while the copy
runs: nothing reads their RAM until they run. For a template's base file one copy is kept ready
with paused QEMUs already started on it (``spares.py``), so a fork copies only the written
pages and its children skip QEMU's start; the next spare is made in the background.

Otherwise (a VM woken from disk maps its RAM shared; a host that does not let the service read
QEMU's memory) the whole RAM is copied into an intermediate VM frozen like a template.
"""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Protocol

import structlog

from hypervisor import DomainSpec, GuestImage, Hypervisor, PageForkUnavailable
from hypervisor.forkram import RamMapping, make_ram_file
from hypervisor.host import PageCopy
from hypervisor.ownership import give_to_qemu

from ...channel import AgentClient
from ...tasks import TaskSet, to_thread_to_the_end
from .launched import Launched
from .snapshots import Snapshot, TemplateSnapshots
from .spares import DROP_DELAY, Spare, Spares

log = structlog.get_logger("kernelhost.vms")

Children = list[tuple[str, dict[str, str]]]


class VmFactory(Protocol):
    """What a fork uses of the factory that owns it (``factory.VmFactory``)."""

    hv: Hypervisor
    snapshots: TemplateSnapshots
    background: TaskSet

    @property
    def forks_dir(self) -> Path: ...

    def spec(
        self,
        domain: str,
        image: GuestImage,
        meta: dict[str, str],
        *,
        mem_path: Path | None = None,
        mem_share: bool = False,
        incoming: bool = False,
    ) -> DomainSpec: ...

    async def clone(
        self,
        domain: str,
        image: GuestImage,
        snap: Snapshot,
        meta: dict[str, str],
        *,
        ignore_shared: bool = True,
    ) -> Launched: ...

    async def load_attached(
        self, spec: DomainSpec, state: Path, *, ignore_shared: bool, how: str, t0: float
    ) -> Launched: ...

    async def destroy(self, domain: str) -> None: ...

    async def label(self, domain: str, meta: dict[str, str]) -> None: ...

    def destroy_later(self, domain: str) -> asyncio.Task[None]: ...


class VmForker:
    """``VmFactory.fork``: the copy, then the children."""

    def __init__(self, vms: VmFactory) -> None:
        self.vms = vms
        self.hv = vms.hv
        self.spares = Spares(
            vms.forks_dir, vms.snapshots.dir, vms.background, self._start_spare_vm, vms.destroy_later
        )

    def stop(self) -> None:
        """The service stops: no new spare, the ones being made end (``Spares.stop``)."""
        self.spares.stop()

    def clear(self) -> None:
        """Once the factory's cleanups ran: the spare copies' files go."""
        self.spares.clear()

    async def fork(self, parent: str, image: GuestImage, children: Children) -> list[tuple[str, AgentClient]]:
        """Clone the running ``parent`` into ``children`` (domain, metadata); parent resumes.
        Each child's domain and agent: the first children's domains are the spare's paused
        QEMUs where a spare was ready (named before the fork, relabelled with the children's
        metadata). The RAM file is unlinked once they run (their mappings keep it); on failure
        nothing of the children is left."""
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
                await self.vms.destroy(domain)
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
        """The children of a page fork; the first of ``domains`` become the spare's QEMUs where
        a spare is ready."""
        t0 = time.monotonic()
        machine = await asyncio.to_thread(self.hv.machine_type, parent)
        spare = await self.spares.take(source.path, snap.ram)
        # adopted at once: from here a failure's cleanup (``fork``) destroys them as children
        prestarted = await self._adopt_spare_vms(spare, domains, children)
        if spare is None:
            await asyncio.to_thread(make_ram_file, snap.ram, source.size)
        give_to_qemu(snap.ram, 0o600)
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

        started = await asyncio.gather(copy, *(start(s) for s in specs[prestarted:]), return_exceptions=True)
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
        # the next ready copy as the children run, at the idle priority (their first calls come
        # first); as many QEMUs on it as this fork had children
        self.spares.refill(source.path, source.size, image, vms=len(children))
        return launched

    async def _start_spare_vm(self, ram: Path, image: GuestImage) -> str:
        """A paused QEMU on the spare file ``ram``, waiting for a child's state; nothing of it
        is left if this fails or is cancelled."""
        domain = self.hv.new_name()
        meta = {"role": "fork-spare", "template": image.template}
        spec = self.vms.spec(domain, image, meta, mem_path=ram, incoming=True)
        try:
            await to_thread_to_the_end(self.hv.start_incoming, spec)
        except BaseException:
            await self.vms.destroy(domain)
            raise
        return domain

    async def _adopt_spare_vms(self, spare: Spare | None, domains: list[str], children: Children) -> int:
        """Make the spare's paused QEMUs the first children (the first of ``domains``), each
        labelled with its child's metadata in the background; how many. The ones that died,
        and the ones this fork leaves, are destroyed."""
        if spare is None or not spare.domains:
            return 0
        offered = spare.domains[: len(domains)]
        self.spares.drop_vms(spare.domains[len(domains) :], delay=DROP_DELAY)
        try:
            running = await asyncio.gather(*(asyncio.to_thread(self.hv.is_running, d) for d in offered))
        except BaseException:
            self.spares.drop_vms(offered)
            raise
        alive = [d for d, up in zip(offered, running, strict=True) if up]
        self.spares.drop_vms([d for d, up in zip(offered, running, strict=True) if not up])
        for i, domain in enumerate(alive):
            domains[i] = domain
            # the child's metadata, and its key's CPU partition
            self.vms.background.spawn(self.vms.label(domain, children[i][1]), name=f"label:{domain}")
        return len(alive)

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
            if domain is not None:  # its CPU partition is released with it
                await self.vms.destroy(domain)
        finally:
            shutil.rmtree(work, ignore_errors=True)
