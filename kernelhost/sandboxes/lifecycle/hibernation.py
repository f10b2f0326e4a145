"""Idle sandboxes: hibernated to disk (the whole VM saved, the VM stopped) and woken on their next
call with their state intact; expired ones deleted. The reaper looks at the sandboxes when the
next one is due (and every ``reaper_interval`` seconds) and acts on each in a task of its own,
so one sandbox whose guest or disk is slow never holds up the others; at most
``REAP_CONCURRENCY`` act at once, because each hibernation writes a whole VM's memory to disk
(a fork's 32 children expiring together must not thrash the host).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import structlog

from hypervisor import HypervisorError

from ... import tracing
from ...channel import ChannelError
from ...ratelimit import TokenBucket
from ..context import Context
from ..errors import CapacityExceeded, Remedy, SandboxNotFound, SandboxNotRunning, StoreRowRefused
from ..inside import stop_processes
from ..sandbox import Sandbox, wait_replacement
from ..states import SandboxState
from .create import Lifecycle

log = structlog.get_logger("kernelhost.sandboxes")

REAP_CONCURRENCY = 2
DUE_MARGIN = 0.02  # seconds past a sandbox's due time that the reaper wakes (due is "past it")


class Hibernation:
    def __init__(self, ctx: Context, lifecycle: Lifecycle) -> None:
        self.ctx = ctx
        self.lifecycle = lifecycle
        self.registry = ctx.registry

    async def hibernate(self, sbx: Sandbox) -> None:
        """Save the idle sandbox to disk and stop its VM; its next call wakes it.
        ``CapacityExceeded`` when its key's hibernated sandboxes have no disk left for it."""
        async with sbx.lock.hold("hibernate"), sbx.vm_lock:
            if sbx.live_agent is None or not self.registry.holds(sbx):
                return
            self._check_disk(sbx)
            await self._hibernate_locked(sbx)

    def _check_disk(self, sbx: Sandbox) -> None:
        """A saved VM takes at most its memory on disk; the key's budget must hold that more."""
        owner = sbx.record.owner
        used = 0
        for other in self.registry.owned(owner):
            if other.record.state == SandboxState.HIBERNATED:
                with contextlib.suppress(OSError, StoreRowRefused):
                    used += self.ctx.hibernation_file(other.record).stat().st_size
        limit = self.ctx.settings.max_hibernated_mib_per_key << 20
        if used + (sbx.record.memory_mib << 20) > limit:
            raise CapacityExceeded(
                f"this API key's hibernated sandboxes take {used >> 20} MiB of disk; sandbox "
                f"{sbx.id} may need {sbx.record.memory_mib} MiB more, over the limit of "
                f"{limit >> 20} MiB (max_hibernated_mib_per_key); delete hibernated sandboxes, "
                "or raise the setting",
                limit="max_hibernated_mib_per_key",
                value=limit >> 20,
            )

    async def _hibernate_locked(self, sbx: Sandbox) -> None:
        t0 = time.monotonic()
        await stop_processes(sbx, timeout=self.ctx.settings.agent_timeout)
        path = self.ctx.hibernation_file(sbx.record)
        agent, sbx.agent = sbx.agent, None
        if agent is not None:
            await agent.close()
        try:
            size = await self.ctx.vms.hibernate(sbx.record.domain, path)
        except HypervisorError as exc:
            path.unlink(missing_ok=True)
            log.error("sandbox.hibernate_failed", sandbox_id=sbx.id, error=str(exc))
            await self.lifecycle.remove(sbx, reason=f"hibernation failed: {exc}")
            return
        if not self.registry.holds(sbx):  # deleted while it was being saved
            path.unlink(missing_ok=True)
            return
        self.registry.set_state(sbx, SandboxState.HIBERNATED)
        self.ctx.metrics.count_hibernation(sbx.record.template)
        log.info(
            "sandbox.hibernated", sandbox_id=sbx.id, bytes=size, ms=round((time.monotonic() - t0) * 1000)
        )

    async def wait_for_vm(self, sbx: Sandbox) -> None:
        """Wait for a replacement, hibernation or wake of ``sbx`` in flight, then wake it."""
        await wait_replacement(sbx)
        if sbx.vm_lock.locked():
            async with sbx.vm_lock:
                pass
        await self.ensure_awake(sbx)

    async def ensure_awake(self, sbx: Sandbox, asked: bool = False) -> None:
        """Wake a hibernated sandbox; state intact, clock fresh. One wake at a time. A sandbox
        that does not wake on a call (``wake_on_call`` 0) wakes only when ``asked``."""
        if sbx.record.state != SandboxState.HIBERNATED:
            return
        if not asked and not sbx.record.wake_on_call:
            raise SandboxNotRunning(
                f"sandbox {sbx.id} is paused and was created not to wake on a call "
                "(auto_resume off): connect to it (resume) first",
                state=sbx.record.state.value,
                sandbox_id=sbx.id,
            )
        async with sbx.vm_lock:
            await self.wake(sbx)

    async def wake(self, sbx: Sandbox) -> None:
        """Wake ``sbx`` if it is hibernated; the caller holds ``sbx.vm_lock``."""
        rec = sbx.record
        if rec.state != SandboxState.HIBERNATED or not self.registry.holds(sbx):
            return
        t0 = time.monotonic()
        path = self.ctx.hibernation_file(rec)
        # a woken sandbox counts against its key's memory again: checked before it runs
        with tracing.span("sandbox.wake", sandbox_id=rec.id, template=rec.template):
            async with self.registry.admit(rec.owner, 0, rec.memory_mib):
                await self._wake_vm(sbx, path, t0)

    async def _wake_vm(self, sbx: Sandbox, path: Path, t0: float) -> None:
        rec = sbx.record
        try:
            launched = await self.ctx.vms.wake(
                rec.domain,
                self.ctx.image_of(rec),
                path,
                {"sandbox": rec.id, "template": rec.template, "key": rec.owner},
            )
        except (HypervisorError, ChannelError) as exc:
            raise SandboxNotRunning(
                f"sandbox {rec.id} was hibernated and could not be woken: {exc}",
                remedy=Remedy.RECREATE,
                state=rec.state.value,
                sandbox_id=rec.id,
            ) from exc
        if not self.registry.holds(sbx):  # deleted before its VM started: it must not run on
            await launched.agent.close()
            await self.ctx.vms.destroy(rec.domain)
            raise SandboxNotFound(rec.id)
        self.lifecycle.bind(sbx, launched.agent)
        await self.ctx.network.configure(sbx, strict=False)  # drops the saved guest's tunnels
        self.registry.set_state(sbx, SandboxState.RUNNING)
        path.unlink(missing_ok=True)
        self.ctx.metrics.observe_wake(rec.template, time.monotonic() - t0)
        log.info("sandbox.woken", sandbox_id=rec.id, ms=round((time.monotonic() - t0) * 1000))


class Reaper:
    """Hibernates or deletes sandboxes idle for too long; retries destroys libvirt refused."""

    def __init__(self, ctx: Context, lifecycle: Lifecycle, hibernation: Hibernation) -> None:
        self.ctx = ctx
        self.lifecycle = lifecycle
        self.hibernation = hibernation
        self._working: dict[str, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(REAP_CONCURRENCY)
        self._full = TokenBucket(1 / 60, 5.0)  # refused hibernations logged, per second

    async def run(self) -> None:
        """Sweep when the next sandbox is due (its idle timeout or retention reached), or
        every ``reaper_interval`` seconds for what a sweep found due but could not act on (a
        hibernation refused, a destroy libvirt refused). A sandbox that comes, is used, or
        gets a new timeout wakes this loop to look again, so a timeout fires on time."""
        changed = self.ctx.registry.changed
        periodic = time.time() + self.ctx.settings.reaper_interval
        while True:
            changed.clear()
            now = time.time()
            wake_at = min(periodic, self.next_due(now))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wake_at - now)):
                    await changed.wait()
                    continue  # something changed: look again at when the next one is due
            now = time.time()
            if now >= periodic:
                periodic = now + self.ctx.settings.reaper_interval
            await self.sweep(now)

    def next_due(self, now: float) -> float:
        """When the next sandbox that is not due now becomes due (infinity: none). One due
        already is the periodic sweep's, or one at work."""
        soonest = float("inf")
        for sbx in self.ctx.registry:
            task = self._working.get(sbx.id)
            if self._blocked(sbx) or (task is not None and not task.done()):
                continue
            at = self._due_at(sbx) + DUE_MARGIN
            if now < at < soonest:
                soonest = at
        return soonest

    async def expire(self, sbx: Sandbox) -> None:
        """What its idle timeout does, now (E2B's ``set_timeout(0)``)."""
        await self._act(sbx, time.time())

    async def sweep(self, now: float) -> None:
        done = await self.ctx.vms.retry_destroys()  # destroys that failed while libvirt was away
        if done:
            log.info("reaper.destroyed_late", domains=done)
        for sbx in self.ctx.registry:
            task = self._working.get(sbx.id)
            if task is not None and not task.done():
                continue  # still at work on it from an earlier sweep
            if self._due(sbx, now):
                self._working[sbx.id] = self.ctx.tasks.spawn(self._reap(sbx, now), name=f"reap:{sbx.id}")
        for sandbox_id, task in list(self._working.items()):
            if task.done():
                del self._working[sandbox_id]

    def _blocked(self, sbx: Sandbox) -> bool:
        return bool(
            sbx.busy
            or any(not p.own for p in sbx.processes.values())  # a tenant's process runs: not idle
            or sbx.vm_lock.locked()
            or not self.ctx.registry.holds(sbx)
            or (sbx.replacement is not None and not sbx.replacement.done())
        )

    def _due_at(self, sbx: Sandbox) -> float:
        rec = sbx.record
        if rec.state == SandboxState.HIBERNATED:
            return rec.last_active_at + self.ctx.settings.hibernate_retention_seconds
        return rec.last_active_at + rec.idle_timeout_seconds

    def _due(self, sbx: Sandbox, now: float) -> bool:
        return not self._blocked(sbx) and now > self._due_at(sbx)

    async def _reap(self, sbx: Sandbox, now: float) -> None:
        """Hibernate or delete one sandbox that has been idle for long enough."""
        async with self._slots:
            if self._due(sbx, time.time()):  # still, after waiting for a slot
                await self._act(sbx, now)

    async def _act(self, sbx: Sandbox, now: float) -> None:
        rec = sbx.record
        try:
            if rec.state == SandboxState.HIBERNATED:
                log.info("sandbox.retention_expired", sandbox_id=sbx.id)
                await self.lifecycle.remove(sbx, reason="hibernation retention expired")
                return
            action = rec.idle_action or self.ctx.settings.idle_action
            log.info(
                "sandbox.idle_expired",
                sandbox_id=sbx.id,
                idle_seconds=round(now - rec.last_active_at),
                action=action,
            )
            if action == "hibernate" and rec.state == SandboxState.RUNNING:
                try:
                    await self.hibernation.hibernate(sbx)
                except CapacityExceeded as exc:  # no disk left for the key: it stays running
                    if self._full.take():
                        log.warning("sandbox.hibernation_refused", sandbox_id=sbx.id, reason=exc.message)
            else:
                await self.lifecycle.remove(sbx, reason="idle timeout")
        except (HypervisorError, ChannelError, OSError) as exc:
            # the reaper must outlive any one sandbox's trouble
            log.error("reaper.failed", sandbox_id=sbx.id, error=str(exc))
