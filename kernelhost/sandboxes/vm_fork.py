"""Fork at the VM level: a live VM's RAM and devices become the start of ``n`` children.

Page by page where the parent maps a base RAM file privately (a clone of a template snapshot, a
fork's child, a restored checkpoint): the children's RAM file is the base file's data plus the
pages the parent wrote (``hypervisor.forkram``), so the parent's pause and the copy grow with
what it changed, not with its RAM. The children's QEMU processes start (paused) while the copy
runs: nothing reads their RAM until they run. For a template's base file one copy is kept ready
(``Spares``), so a fork copies only the written pages; the next spare is made in the background.

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
from collections.abc import Awaitable, Iterable
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


class Spares:
    """One ready copy of each template RAM file that a fork started from: the next fork from
    it renames the copy instead of copying the base (a few hundred MiB, ~0.2 s). A host that
    forks holds one such file per template it forks from; ``clear`` removes them."""

    def __init__(self, directory: Path, templates: Path, tasks: TaskSet) -> None:
        self.dir = directory
        self.templates = templates  # where template RAM files live: the bases worth a spare
        self._tasks = tasks
        self._making: dict[str, asyncio.Task[None]] = {}  # base -> the task making its copy
        self._copying: set[str] = set()  # bases whose copy has begun (past its delay)
        self._ready: dict[str, Path] = {}

    async def take(self, base: str | None, dest: Path) -> bool:
        """Move the ready copy of ``base`` to ``dest``; False if there is none. A copy being
        made (a fork right after another) is waited for, up to ``SPARE_WAIT`` seconds: it is
        part done, and a second copy beside it would slow both (3.7 s against 0.2 s, seen)."""
        making = self._making.get(base) if base is not None else None
        if making is not None:
            if base not in self._copying:
                making.cancel()  # still in its delay: the fork copies for itself, as fast
            await asyncio.wait({making}, timeout=SPARE_WAIT)
        spare = self._ready.pop(base, None) if base is not None else None
        if spare is None:
            return False
        try:
            os.rename(spare, dest)
            return True
        except FileNotFoundError:
            return False

    def refill(self, base: str | None, size: int, delay: float = 0.0) -> None:
        """Make the next copy of ``base`` (a template's RAM file) off the request path, starting
        ``delay`` seconds from now; a fork within the delay cancels it (``take``)."""
        for old in [b for b in self._ready if not os.path.exists(b)]:  # pruned since
            self._ready.pop(old).unlink(missing_ok=True)
        if base is None or base in self._making or base in self._ready:
            return
        if Path(base).parent.parent != self.templates:
            return
        name = f"fork-spare:{Path(base).parent.name}"
        self._making[base] = self._tasks.spawn(self._make(base, size, delay), name=name)

    async def _make(self, base: str, size: int, delay: float) -> None:
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
            self._ready[base] = path
        except (OSError, HypervisorError) as exc:
            log.warning("vm.fork_spare_failed", base=base, error=str(exc))
        finally:
            tmp.unlink(missing_ok=True)
            self._making.pop(base, None)
            self._copying.discard(base)

    def stop(self) -> None:
        """Cancel the copies still waiting out their delay (a service stopping)."""
        for base, task in list(self._making.items()):
            if base not in self._copying:
                task.cancel()

    def clear(self) -> None:
        self._ready.clear()
        for path in self.dir.glob("spare-*"):
            path.unlink(missing_ok=True)


class VmForker:
    """``VmFactory.fork``: the copy, then the children."""

    def __init__(self, vms: VmFactory) -> None:
        self.vms = vms
        self.hv = vms.hv
        self.spares = Spares(vms.forks_dir, vms.snapshots.dir, vms.background)

    async def fork(self, parent: str, image: GuestImage, children: Children) -> list[AgentClient]:
        """Clone the running ``parent`` into ``children`` (domain, metadata); parent resumes.
        The RAM file is unlinked once they run (their mappings keep it); on failure nothing of
        the children is left."""
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
                launched = await self._fork_pages(parent, source, image, snap, children)
            self._log_children(parent, launched)
            return [one.agent for one in launched]
        except BaseException:
            for one in launched:
                await one.agent.close()
            for domain, _ in children:
                await self.vms.destroy_tracked(domain)
            raise
        finally:
            # the paused copy (if any) and the file names go, off the caller's path
            self.vms.background.spawn(self._drop(mid, work), name=f"drop-fork:{work.name}")

    async def _fork_pages(
        self, parent: str, source: RamMapping, image: GuestImage, snap: Snapshot, children: Children
    ) -> list[Launched]:
        t0 = time.monotonic()
        machine = await asyncio.to_thread(self.hv.machine_type, parent)
        spare = await self.spares.take(source.path, snap.ram)
        if not spare:
            await asyncio.to_thread(make_ram_file, snap.ram, source.size)
        give_to_qemu(snap.ram, 0o600)
        specs = [self.vms.spec(d, image, m, mem_path=snap.ram, incoming=True) for d, m in children]
        copy = asyncio.to_thread(
            self.hv.fork_pages, parent, source, snap.ram, snap.state, base=not spare, machine=machine
        )
        qemu_started: list[float] = []

        async def start(spec: DomainSpec) -> None:
            await to_thread_to_the_end(self.hv.start_incoming, spec)
            qemu_started.append(round(time.monotonic() - t0, 3))

        started = await asyncio.gather(copy, *(start(s) for s in specs), return_exceptions=True)
        for result in started:
            if isinstance(result, BaseException):
                raise result
        copied: PageCopy = started[0]  # type: ignore[assignment]
        log.info(
            "vm.fork_copied",
            parent=parent,
            how="pages",
            spare=spare,
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
        self.spares.refill(source.path, source.size, delay=SPARE_DELAY)
        return launched

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
