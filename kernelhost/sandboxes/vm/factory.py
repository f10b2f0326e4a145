"""How a sandbox gets its VM: clone from a template snapshot (or cold boot when there is none),
hand-over from the warm pool, hibernate to disk and wake, and fork a live VM into n children.

Every VM here has its RAM as a file-backed block (``memory-backend-file``, id ``khram``): a
template's file mapped shared, a clone's mapped privately, any other VM's an unnamed file in
``ram_dir/anon``. One RAM shape per template (its own size, or the service's) is what lets any
of its VMs' saved state load into another.
This module knows the channel (it attaches agents) but not HTTP, and nothing of sandbox records.
Every launch returns its timings with its agent (``Launched``), so concurrent launches, wakes and
pool refills never share a "last launch" value.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Collection
from pathlib import Path

import structlog

from hypervisor import DomainSpec, DomainStats, GuestImage, Hypervisor, HypervisorError, ImageStore
from hypervisor.ownership import give_to_qemu, keep_from_qemu
from hypervisor.stats import domain_stats

from ...channel import AgentClient
from ...channel.protocol import Capability, Op, jupyter_message
from ...config import Settings
from ...tasks import TaskSet, to_thread_to_the_end
from .backend import Children
from .cpu import KeyPartitions
from .fork import VmForker
from .launched import Launched, VmTimings
from .pool import Clone, WarmPool
from .prune import apply, scan_in_use, stale_snapshots
from .saves import CheckpointFiles
from .snapshots import Snapshot, TemplateSnapshots

log = structlog.get_logger("kernelhost.vms")


class VmFactory:
    """The libvirt and QEMU ``VmBackend`` (``backend.py`` has the contract)."""

    def __init__(
        self,
        settings: Settings,
        hv: Hypervisor,
        images: ImageStore,
        accel: str,
        channel_key: bytes | None = None,
    ) -> None:
        """``channel_key``: the key of the channels' request ids, kept across restarts (the
        manager derives it from the access-token key); None: this process's."""
        self.settings = settings
        self.channel_key = channel_key
        self.timeouts = settings.timeouts
        self.hv = hv
        self.images = images
        self.accel = accel
        self.ram_dir = settings.ram_dir
        self.anon_dir = settings.ram_dir / "anon"
        self._boot_slots = asyncio.Semaphore(settings.max_concurrent_boots)
        self.snapshots = TemplateSnapshots(
            hv,
            settings.ram_dir,
            accel=accel,
            memory_mib=settings.vm_memory_mib,
            vcpus=settings.vm_vcpus,
            boot_timeout=settings.boot_timeout,
            warmup_timeout=settings.timeouts.snapshot_warmup,
            attach=self.connect_agent,
        )
        self.pool = WarmPool(settings.pool_size, self._pool_clone, self.discard)
        self.background = TaskSet("vms")
        self.forker = VmForker(self)
        # each key's VMs in a CPU partition of their own (docs/limits.md)
        self.cpu = KeyPartitions(hv.prefix, settings.cpu_weight_per_key)

    async def prepare(self) -> None:
        """Create the RAM directories and remove what a killed predecessor left in them."""
        self.ram_dir.mkdir(parents=True, exist_ok=True)
        keep_from_qemu(self.ram_dir, 0o755)  # QEMU passes through; it must not rename templates/
        for path in (self.anon_dir, self.forks_dir.parent):  # QEMU creates RAM files here
            path.mkdir(parents=True, exist_ok=True)
            give_to_qemu(path)
        await asyncio.to_thread(self.snapshots.prepare)
        # this service's unfinished forks (a crash mid-fork); children that run keep their
        # mappings of these files, so removing the names frees nothing still in use
        shutil.rmtree(self.forks_dir, ignore_errors=True)
        # snapshot builds abandoned by any service on this host (an hour is far past a build)
        for path in self.snapshots.dir.glob(".build-*"):
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > 3600:
                    shutil.rmtree(path, ignore_errors=True)
        await asyncio.to_thread(self.prune_snapshots)
        await asyncio.to_thread(self.cpu.start)

    def prune_snapshots(self) -> int:
        """Remove template snapshots no clone will start from again (an older image build,
        another QEMU), unless a running VM still maps them (``prune.py``); returns bytes freed."""
        try:
            versions: dict[str, str] | None = self.hv.versions()
        except HypervisorError:
            versions = None
        plan = stale_snapshots(self.ram_dir, self.images, scan_in_use(), versions)
        for art, why in plan.keep:
            log.info("prune.snapshot_kept", path=str(art.path), reason=art.reason, kept=why)
        freed = apply(
            plan,
            lambda art: log.info(
                "prune.snapshot_removed", path=str(art.path), reason=art.reason, bytes=art.bytes
            ),
        )
        if plan.remove:
            log.info("prune.done", removed=len(plan.remove), bytes_freed=freed)
        return freed

    @property
    def forks_dir(self) -> Path:
        return self.ram_dir / "forks" / self.hv.prefix.rstrip("-")

    async def close(self) -> None:
        await self.pool.close()
        self.forker.stop()
        # let cleanups finish: they remove domains and files
        await self.background.wait(self.timeouts.cleanup)
        self.forker.clear()
        await asyncio.to_thread(self.cpu.close)  # the partitions of keys with no VM left
        with contextlib.suppress(OSError):  # this service's fork directory, once empty
            self.forks_dir.rmdir()

    @property
    def use_snapshots(self) -> bool:
        return self.settings.snapshots == "on"

    # -- agents --------------------------------------------------------------------------------

    def agent_client(self, socket: Path) -> AgentClient:
        """A channel (not connected yet) to a VM's agent, its request ids tagged under the
        service's key (a restored VM's answers to an earlier channel are then dropped)."""
        return AgentClient(socket, max_frame_bytes=self.settings.max_frame_bytes, id_key=self.channel_key)

    async def connect_agent(self, socket: Path, timeout: float) -> AgentClient:
        """Connect to a VM's channel and wait until its agent has a ready kernel."""
        agent = self.agent_client(socket)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await agent.connect(timeout=timeout)
        try:
            await agent.hello(timeout=max(1.0, deadline - loop.time()))
        except BaseException:
            await agent.close()
            raise
        return agent

    async def hygiene(self, agent: AgentClient) -> None:
        """After a clone, resume or fork: fresh clock, entropy and RNG seeds in the guest."""
        await agent.request(
            Op.RESUMED, timeout=self.timeouts.hygiene, time_ns=time.time_ns(), entropy=os.urandom(64)
        )

    # -- launching -----------------------------------------------------------------------------

    def spec(
        self,
        domain: str,
        image: GuestImage,
        meta: dict[str, str],
        *,
        mem_path: Path | None = None,
        mem_share: bool = False,
        incoming: bool = False,
    ) -> DomainSpec:
        if mem_path is None:
            # An unnamed file that QEMU creates in anon_dir and unlinks at once, mapped shared:
            # a shared tmpfs mapping fills about 4x faster than a private one when a state is
            # loaded (one page fault per page instead of a read fault plus a copy-on-write).
            mem_path, mem_share = self.anon_dir, True
        memory, vcpus, writable = self.snapshots.shape_of(image)
        return self.hv.spec_for(
            domain,
            image,
            accel=self.accel,
            memory_mib=memory,
            vcpus=vcpus,
            writable_size=writable,
            metadata=meta,
            mem_path=mem_path,
            mem_share=mem_share,
            incoming=incoming,
            cpu_quota_percent=self.settings.vm_cpu_quota_percent,
            partition=self.cpu.place(domain, meta),
        )  # sandboxes only: not templates

    async def snapshot_for(self, image: GuestImage) -> Snapshot | None:
        if not self.use_snapshots:
            return None
        return await self.snapshots.ensure(image)

    async def launch(self, domain: str, image: GuestImage, meta: dict[str, str]) -> Launched:
        """Start a VM named ``domain`` for ``image``; it comes with its attached, fresh agent.

        Clones the template snapshot (building it first if there is none); cold-boots when
        snapshots are off. On failure nothing of the domain is left.
        """
        try:
            snap = await self.snapshot_for(image)
            if snap is not None:
                return await self.clone(domain, image, snap, meta)
            return await self._boot(domain, image, meta)
        except BaseException:
            await self.destroy(domain)
            raise

    async def _boot(self, domain: str, image: GuestImage, meta: dict[str, str]) -> Launched:
        t0 = time.monotonic()
        async with self._boot_slots:
            spec = self.spec(domain, image, meta)
            await to_thread_to_the_end(self.hv.start, spec)
            t1 = time.monotonic()
            agent = await self.connect_agent(spec.channel_socket, self.timeouts.boot)
        return Launched(agent, VmTimings("boot", t1 - t0, time.monotonic() - t1, 0.0))

    async def clone(
        self,
        domain: str,
        image: GuestImage,
        snap: Snapshot,
        meta: dict[str, str],
        *,
        ignore_shared: bool = True,
    ) -> Launched:
        t0 = time.monotonic()
        spec = self.spec(domain, image, meta, mem_path=snap.ram, incoming=True)
        await to_thread_to_the_end(self.hv.start_incoming, spec)
        return await self.load_attached(spec, snap.state, ignore_shared=ignore_shared, how="clone", t0=t0)

    async def load_attached(
        self, spec: DomainSpec, state: Path, *, ignore_shared: bool, how: str, t0: float
    ) -> Launched:
        """Load ``state`` into the paused domain ``hv.start_incoming`` started (at ``t0``) and
        resume it, with the channel connected first: the guest's agent, which was connected
        when the state was saved, then never sees its host go away and answers at once (else
        it notices the new connection only on its next look, up to 0.1 s later). Then the clone
        hygiene: fresh clock, entropy and seeds. The agent is closed on failure; the caller
        destroys the domain. Requests in flight when the state was saved are answered on the
        new channel, which drops them (``agent_client``)."""
        agent = self.agent_client(spec.channel_socket)
        try:
            await agent.connect(timeout=self.timeouts.attach)
            await asyncio.to_thread(self.hv.load_into, spec.name, state, ignore_shared=ignore_shared)
            t1 = time.monotonic()
            await agent.hello(timeout=self.timeouts.attach)
            t2 = time.monotonic()
            await self.hygiene(agent)
        except BaseException:
            await agent.close()
            raise
        return Launched(agent, VmTimings(how, t1 - t0, t2 - t1, time.monotonic() - t2))

    async def destroy(self, domain: str) -> None:
        """Destroy ``domain`` (idempotent), even if the caller is cancelled meanwhile: the
        destroy runs as a task that ``close`` waits for, so a shutdown mid-launch leaves no
        domain behind. Never raises: a failure is logged and ``retry_destroys`` tries again."""
        await asyncio.shield(self.destroy_later(domain))

    def destroy_later(self, domain: str) -> asyncio.Task[None]:
        """Destroy ``domain`` in the background; ``close`` waits for it (a shutdown right after
        does not leave the domain running, as a cancelled task would)."""
        return self.background.spawn(self._destroy(domain), name=f"destroy:{domain}")

    async def _destroy(self, domain: str) -> None:
        try:
            await asyncio.to_thread(self.hv.destroy, domain)
        except HypervisorError as exc:  # remembered by the hypervisor, retried by the reaper
            log.error("vm.destroy_failed", domain=domain, error=str(exc))
            return
        await asyncio.to_thread(self.cpu.release, domain)

    async def retry_destroys(self) -> list[str]:
        if not self.hv.pending_destroys:
            return []
        done = await asyncio.to_thread(self.hv.retry_destroys)
        for domain in done:
            await asyncio.to_thread(self.cpu.release, domain)
        return done

    # -- pool ----------------------------------------------------------------------------------

    async def _pool_clone(self, template: str) -> Clone:
        image = self.images.get(template)
        domain = self.hv.new_name()
        launched = await self.launch(domain, image, {"role": "pool", "template": template})
        try:
            await self.warm_up(launched.agent)
        except BaseException:
            await launched.agent.close()
            await self.destroy(domain)
            raise
        return Clone(domain, launched.agent, image.key)

    async def warm_up(self, agent: AgentClient) -> None:
        """A pooled clone's first cells, run before anyone has it: its first call is then as
        fast as its second (pages faulted in, code translated under emulation), and the agent
        leaves no trace of them (no execution count, no ``_``)."""
        t0 = time.monotonic()
        if agent.supports(Capability.WARM_UP):
            await agent.request(Op.WARM_UP, timeout=self.timeouts.attach)
        await self._warm_relay(agent)
        log.debug("vm.warmed_up", seconds=round(time.monotonic() - t0, 3))

    async def _warm_relay(self, agent: AgentClient) -> None:
        """A silent cell sent as a user's cell is (a jupyter frame into the agent's relay, its
        output and reply back through it), so the guest's relay code is run, and under
        emulation translated, before a user's first call. Silent: no history, no execution
        count, no ``_``; ``print`` is valid Python and R."""
        content = {"code": "print('warm')", "silent": True, "store_history": False}
        content.update(user_expressions={}, allow_stdin=False, stop_on_error=False)
        metadata = {"kernelhost": {"max_output_bytes": 1 << 20}}  # the cap's path too
        msg = jupyter_message("execute_request", content, "kernelhost-warm-up", metadata=metadata)
        sub = agent.subscribe(msg["header"]["msg_id"])
        deadline = time.monotonic() + self.timeouts.attach
        try:
            await agent.send_jupyter("shell", msg, timeout=self.timeouts.attach)
            while True:
                reply = await sub.get(timeout=max(0.0, deadline - time.monotonic()))
                if reply.channel == "shell" and reply.msg_type == "execute_reply":
                    return
        finally:
            sub.close()

    async def discard(self, clone: Clone) -> None:
        """Close and destroy a pooled clone (one made from an image that was rebuilt since)."""
        await clone.agent.close()
        await self.destroy(clone.domain)

    def take_clone(self, template: str, refill: bool) -> Clone | None:
        """A ready clone of ``template`` from the pool (None: none, or snapshots are off);
        ``refill``: the template's pool fills from now on (idempotent)."""
        if not self.use_snapshots:
            return None
        clone = self.pool.take(template)
        if refill:
            self.pool.start(template)
        return clone

    async def warm(self, image: GuestImage) -> None:
        """Build the template snapshot of ``image`` if it is missing, then keep its pool filled."""
        if not self.use_snapshots:
            return
        await self.snapshot_for(image)
        self.pool.start(image.template)

    # -- hibernate and wake --------------------------------------------------------------------

    async def hibernate(self, domain: str, path: Path) -> int:
        """Save the whole VM (RAM included) to ``path`` on disk and destroy it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            size = await asyncio.to_thread(self.hv.freeze, domain, path, ignore_shared=False)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        await self.destroy(domain)
        return size

    async def wake(self, domain: str, image: GuestImage, path: Path, meta: dict[str, str]) -> Launched:
        """Start ``domain`` from a hibernated state; the caller removes ``path`` afterwards."""
        t0 = time.monotonic()
        spec = self.spec(domain, image, meta, incoming=True)
        try:
            await to_thread_to_the_end(self.hv.start_incoming, spec)
            return await self.load_attached(spec, path, ignore_shared=False, how="wake", t0=t0)
        except BaseException:
            await self.destroy(domain)
            raise

    # -- fork ----------------------------------------------------------------------------------

    async def fork(self, parent: str, image: GuestImage, children: Children) -> list[tuple[str, AgentClient]]:
        """Clone the running ``parent`` into ``children`` (domain, metadata); the parent resumes
        (``vm/fork.py``: page by page where it can, else through an intermediate VM). Each
        child's domain (the first ones may be QEMUs started before the fork) and agent."""
        return await self.forker.fork(parent, image, children)

    # -- the rest of the contract: names, labels, reconcile, usage, checkpoints ----------------

    def new_name(self) -> str:
        return self.hv.new_name()

    def shape_of(self, image: GuestImage) -> tuple[int, int]:
        memory, vcpus, _ = self.snapshots.shape_of(image)
        return memory, vcpus

    async def label(self, domain: str, meta: dict[str, str]) -> None:
        try:
            await asyncio.to_thread(self.hv.set_metadata, domain, meta)
        except HypervisorError as exc:
            log.warning("vm.label_failed", domain=domain, error=str(exc))
        if meta.get("key"):
            await asyncio.to_thread(self.cpu.move, domain, meta["key"])

    async def reattach(self, domain: str, timeout: float) -> AgentClient:
        return await self.connect_agent(self.hv.vm_dir(domain) / "agent.sock", timeout)

    async def running_domains(self) -> set[str]:
        return {d.name for d in await asyncio.to_thread(self.hv.domains) if d.running}

    async def reconcile(self, keep: set[str]) -> list[str]:
        removed = await asyncio.to_thread(self.hv.reconcile, keep)
        for domain in removed:
            await asyncio.to_thread(self.cpu.release, domain)
        return removed

    async def cpu_time(self, domain: str) -> tuple[int, int]:
        return await asyncio.to_thread(self.hv.cpu_time, domain)

    async def stats(self, domains: Collection[str]) -> dict[str, DomainStats]:
        return await asyncio.to_thread(domain_stats, domains, lambda: self.hv.conn)

    def console_tail(self, domain: str, lines: int = 20, *, qemu_log: bool = False) -> str:
        paths = [("console", self.hv.vm_dir(domain) / "console.log")]
        if qemu_log:
            paths.append(("QEMU", self.hv.qemu_log(domain)))
        tails = []
        for what, path in paths:
            try:
                tail = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            if tail and qemu_log:
                tails.append(f"-- {what}:")
            tails += tail
        return "\n".join(tails)

    async def prepare_template(self, image: GuestImage) -> None:
        await self.snapshot_for(image)

    async def forget_template(self, name: str) -> None:
        await self.pool.stop(name)
        await asyncio.to_thread(self.snapshots.remove, name)

    def builder_name(self, build_id: str) -> str:
        return f"{self.hv.prefix}build-{build_id}"

    async def boot_builder(
        self, domain: str, image: GuestImage, memory_mib: int, scratch: Path, meta: dict[str, str]
    ) -> tuple[AgentClient, str]:
        spec = self.hv.spec_for(
            domain, image, accel=self.accel, memory_mib=memory_mib, vcpus=max(1, self.settings.vm_vcpus),
            metadata=meta, mem_path=self.anon_dir, mem_share=True,
            writable_size="25%", cmdline_extra="kh.build",  # its agent starts no Jupyter kernel
            partition=self.cpu.place(domain, meta),
        )  # fmt: skip
        spec = dataclasses.replace(spec, scratch_disk=scratch)
        try:
            await to_thread_to_the_end(self.hv.start, spec)
            agent = await self.connect_agent(spec.channel_socket, self.timeouts.boot)
        except BaseException:
            await self.destroy(domain)
            raise
        return agent, spec.scratch_device

    def checkpoint_files(self, directory: Path, live: str) -> CheckpointFiles:
        return CheckpointFiles(self, directory, live)
