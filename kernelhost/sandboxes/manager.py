"""Sandbox lifecycle: create (boot a VM), look up by owner, execute, delete, reattach, reap.

A sandbox is a libvirt domain plus a channel to its agent. Records live in SQLite so a restarted
service reattaches to the VMs that are still running (variables intact) and destroys the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hypervisor import (
    GuestImage,
    Hypervisor,
    HypervisorError,
    ImageNotFound,
    ImageStore,
    LibvirtUnavailable,
)

from ..channel import AgentClient, AgentError, ChannelClosed, Subscription
from ..config import Settings
from .errors import (
    BackendUnavailable,
    BootFailed,
    InvalidRequest,
    SandboxNotFound,
    SandboxNotRunning,
    UnknownTemplate,
)
from .execution import inject_kernel_death, run_cell
from .store import SandboxRecord, Store
from .vms import VmFactory

log = structlog.get_logger("kernelhost.sandboxes")

LANGUAGES = ("python",)


@dataclass(eq=False)
class Sandbox:
    """A live sandbox: its record, its channel, and the lock that serializes its executions."""

    record: SandboxRecord
    agent: AgentClient | None = None
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    current: Subscription | None = None
    busy: bool = False

    @property
    def id(self) -> str:
        return self.record.id

    def to_dict(self) -> dict[str, Any]:
        r = self.record
        return {
            "id": r.id, "template": r.template, "state": r.state,
            "created_at": _iso(r.created_at), "last_active_at": _iso(r.last_active_at),
            "idle_timeout_seconds": r.idle_timeout_seconds, "accel": r.accel,
            "memory_mib": r.memory_mib, "vcpus": r.vcpus, "metadata": r.metadata,
            **({"detail": r.detail} if r.detail else {}),
        }


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


class SandboxManager:
    def __init__(self, settings: Settings, hv: Hypervisor, images: ImageStore, store: Store,
                 accel: str) -> None:
        self.settings = settings
        self.hv = hv
        self.images = images
        self.store = store
        self.accel = accel
        self.sandboxes: dict[str, Sandbox] = {}
        self.vms = VmFactory(settings, hv, images, accel)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None

    # -- start-up and shutdown -----------------------------------------------------------------

    async def start(self) -> None:
        """Reattach to running VMs we know, drop records of dead ones, destroy strays."""
        try:
            domains = {d.name: d for d in await asyncio.to_thread(self.hv.domains)}
        except LibvirtUnavailable as exc:
            raise BackendUnavailable(str(exc)) from exc
        await self.vms.prepare()
        keep: set[str] = set()
        for rec in self.store.all():
            sbx = Sandbox(rec)
            info = domains.get(rec.domain)
            if rec.state == "hibernated" and self._hibernate_path(rec).is_file():
                self.sandboxes[rec.id] = sbx  # wakes on its next call
                continue
            if rec.state == "starting" or info is None or not info.running:
                # killed mid-create, or its VM is gone: nothing to reattach to
                log.info("sandbox.dropped", sandbox_id=rec.id, domain=rec.domain, state=rec.state)
                self.store.delete(rec.id)
                continue
            try:
                await self._attach(sbx, timeout=15.0)
            except (ChannelClosed, AgentError, asyncio.TimeoutError, TimeoutError) as exc:
                log.warning("sandbox.reattach_failed", sandbox_id=rec.id, error=str(exc))
                self.store.delete(rec.id)
                continue
            self.sandboxes[rec.id] = sbx
            keep.add(rec.domain)
            log.info("sandbox.reattached", sandbox_id=rec.id, domain=rec.domain)
        removed = await asyncio.to_thread(self.hv.reconcile, keep)
        if removed:
            log.info("reconcile.destroyed", domains=removed)
        self._remove_stray_hibernations()
        self._reaper = asyncio.create_task(self._reap_loop(), name="idle-reaper")
        self._spawn(self._warm_up())

    async def _warm_up(self) -> None:
        """Build missing template snapshots, then keep each template's pool filled."""
        if not self.vms.use_snapshots:
            return
        for template in self.images.templates():
            try:
                await self.vms.snapshot_for(self.images.get(template))
            except (HypervisorError, ChannelClosed, AgentError, TimeoutError) as exc:
                log.error("snapshot.build_failed", template=template, error=str(exc))
                continue
            self.vms.pool.start(template)

    def _hibernate_path(self, rec: SandboxRecord) -> Path:
        return self.settings.hibernate_dir / f"{rec.id}.state"

    def _remove_stray_hibernations(self) -> None:
        known = {self._hibernate_path(s.record) for s in self.sandboxes.values()}
        if self.settings.hibernate_dir.is_dir():
            for path in self.settings.hibernate_dir.iterdir():
                if path not in known:
                    path.unlink(missing_ok=True)

    async def close(self) -> None:
        """Stop background work and close channels; VMs keep running for the next start."""
        tasks = [t for t in [self._reaper, *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.vms.close()
        for sbx in self.sandboxes.values():
            if sbx.agent is not None:
                await sbx.agent.close()

    # -- lookups -------------------------------------------------------------------------------

    def get(self, owner: str, sandbox_id: str) -> Sandbox:
        sbx = self.sandboxes.get(sandbox_id)
        if sbx is None or sbx.record.owner != owner:
            raise SandboxNotFound(sandbox_id)
        return sbx

    def owned(self, owner: str) -> list[Sandbox]:
        return [s for s in self.sandboxes.values() if s.record.owner == owner]

    def templates(self) -> list[str]:
        return self.images.templates()

    # -- create / delete -----------------------------------------------------------------------

    async def create(self, owner: str, template: str, idle_timeout: int | None = None,
                     metadata: dict[str, str] | None = None) -> Sandbox:
        idle = self.settings.default_idle_timeout if idle_timeout is None else idle_timeout
        if not 1 <= idle <= self.settings.max_idle_timeout:
            raise InvalidRequest(
                f"idle_timeout_seconds={idle} is out of range; use 1 to "
                f"{self.settings.max_idle_timeout}", field="idle_timeout_seconds")
        try:
            image = self.images.get(template)
        except ImageNotFound as exc:
            raise UnknownTemplate(
                f"unknown template {template!r}; valid templates: "
                f"{', '.join(exc.available) or 'none built (run make image)'}",
                field="template", valid=exc.available) from None
        now = time.time()
        rec = SandboxRecord(
            id="sbx_" + secrets.token_hex(8), owner=owner, template=template,
            domain=self.hv.new_name(), state="starting", created_at=now, last_active_at=now,
            idle_timeout_seconds=idle, memory_mib=self.settings.vm_memory_mib,
            vcpus=self.settings.vm_vcpus, accel=self.accel, image_key=image.key,
            metadata=dict(metadata or {}),
        )
        sbx = Sandbox(rec)
        clone = self.vms.pool.take(template) if self.vms.use_snapshots else None
        if clone is not None and clone.image_key == image.key:
            rec.domain, rec.state = clone.domain, "running"
            self.store.insert(rec)
            self._bind(sbx, clone.agent)
            self.sandboxes[rec.id] = sbx
            self._spawn(self._label(rec))
            log.info("sandbox.created", sandbox_id=rec.id, domain=rec.domain, template=template,
                     how="pool")
            return sbx
        if clone is not None:  # made from an image that has since been rebuilt
            self._spawn(self.vms._discard(clone))
        self.store.insert(rec)
        bound = log.bind(sandbox_id=rec.id, domain=rec.domain)
        t0 = time.monotonic()
        try:
            await self._launch(sbx, image)
        except BaseException as exc:
            # includes cancellation (client went away): never leave the VM or its files behind
            tail = self._console_tail(rec.domain)
            await asyncio.shield(self._destroy_quietly(rec))
            if isinstance(exc, LibvirtUnavailable):
                raise BackendUnavailable(str(exc)) from exc
            if isinstance(exc, (HypervisorError, ChannelClosed, AgentError, TimeoutError,
                                asyncio.TimeoutError)):
                bound.warning("sandbox.boot_failed", error=str(exc), console=tail)
                raise BootFailed(
                    f"sandbox VM did not reach a ready kernel within "
                    f"{self.settings.boot_timeout:.0f}s: {exc or type(exc).__name__}; "
                    f"check 'kernelhost doctor' and raise KERNELHOST_BOOT_TIMEOUT on slow hosts",
                    console=tail) from exc
            raise
        rec.state = "running"
        self.store.update(rec.id, state="running")
        self.sandboxes[rec.id] = sbx
        bound.info("sandbox.created", template=template, how=self.vms.last.how,
                   ms=round((time.monotonic() - t0) * 1000))
        return sbx

    async def _label(self, rec: SandboxRecord) -> None:
        """Name the sandbox in its pooled domain's metadata (for operators and reconcile)."""
        with contextlib.suppress(HypervisorError):
            await asyncio.to_thread(self.hv.set_metadata, rec.domain,
                                    {"sandbox": rec.id, "template": rec.template})

    async def _launch(self, sbx: Sandbox, image: GuestImage) -> None:
        """Start a VM for ``sbx.record`` (domain ``record.domain``) and attach its agent.

        The one way a sandbox gets a VM, for a create and for a replacement alike. On failure the
        caller destroys the domain.
        """
        rec = sbx.record
        agent = await self.vms.launch(rec.domain, image,
                                      {"sandbox": rec.id, "template": rec.template})
        self._bind(sbx, agent)

    async def _attach(self, sbx: Sandbox, timeout: float) -> None:
        """Reattach to a running VM's agent (service restart)."""
        agent = await self.vms.connect_agent(self.hv.vm_dir(sbx.record.domain) / "agent.sock",
                                             timeout)
        self._bind(sbx, agent)

    def _bind(self, sbx: Sandbox, agent: AgentClient) -> None:
        agent.on_event = lambda ev: self._on_event(sbx, ev)
        agent.on_close = lambda reason, violation: self._on_close(sbx, reason, violation)
        sbx.agent = agent
        if not agent.connected:  # closed before we listened: report it now
            self._on_close(sbx, agent.closed_reason or "channel closed", False)

    def _console_tail(self, domain: str, lines: int = 20) -> str:
        path = self.hv.vm_dir(domain) / "console.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def _destroy_quietly(self, rec: SandboxRecord) -> None:
        try:
            await asyncio.to_thread(self.hv.destroy, rec.domain)
        except HypervisorError as exc:
            log.error("sandbox.destroy_failed", sandbox_id=rec.id, error=str(exc))
        self.store.delete(rec.id)

    async def delete(self, owner: str, sandbox_id: str) -> None:
        sbx = self.get(owner, sandbox_id)
        await self._remove(sbx, reason="deleted")

    async def _remove(self, sbx: Sandbox, reason: str) -> None:
        if self.sandboxes.pop(sbx.id, None) is None:
            return
        if sbx.agent is not None:
            await sbx.agent.close()
        await self._destroy_quietly(sbx.record)
        self._hibernate_path(sbx.record).unlink(missing_ok=True)
        log.info("sandbox.removed", sandbox_id=sbx.id, reason=reason)

    # -- agent callbacks -----------------------------------------------------------------------

    def _on_event(self, sbx: Sandbox, event: dict[str, Any]) -> None:
        log.info("sandbox.agent_event", sandbox_id=sbx.id, agent_event=event.get("event"))
        if event.get("event") == "kernel_died" and sbx.current is not None:
            inject_kernel_death(sbx.current, event)

    def _on_close(self, sbx: Sandbox, reason: str, violation: bool) -> None:
        if self.sandboxes.get(sbx.id) is not sbx or reason == "closed by the host":
            return
        if violation:
            # a guest that breaks the protocol is not trusted again: its VM goes
            log.warning("sandbox.protocol_violation", sandbox_id=sbx.id, reason=reason)
            self._spawn(self._remove(sbx, reason=f"protocol violation: {reason}"))
            return
        log.warning("sandbox.lost", sandbox_id=sbx.id, reason=reason)
        sbx.record.state = "dead"
        sbx.record.detail = f"the VM stopped: {reason}"
        self.store.update(sbx.id, state="dead", detail=sbx.record.detail)
        self._spawn(self._destroy_vm_only(sbx))

    async def _destroy_vm_only(self, sbx: Sandbox) -> None:
        with contextlib.suppress(HypervisorError):
            await asyncio.to_thread(self.hv.destroy, sbx.record.domain)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- execution -----------------------------------------------------------------------------

    async def execute(self, sbx: Sandbox, code: str, language: str = "python",
                      timeout: float | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Events of one execution; calls to one sandbox run one at a time, in arrival order."""
        if language not in LANGUAGES:
            raise InvalidRequest(
                f"language {language!r} is not supported; use one of: {', '.join(LANGUAGES)}",
                field="language")
        if len(code.encode()) > self.settings.max_code_bytes:
            raise InvalidRequest(
                f"code is {len(code.encode())} bytes, over the limit of "
                f"{self.settings.max_code_bytes}; upload large inputs as files", field="code")
        if timeout is not None and timeout <= 0:
            raise InvalidRequest(f"timeout={timeout} must be positive (seconds) or null",
                                 field="timeout")
        self._check_running(sbx)
        return self._execute(sbx, code, timeout)

    async def _execute(self, sbx: Sandbox, code: str, timeout: float | None
                       ) -> AsyncGenerator[dict[str, Any], None]:
        async with sbx.lock:
            self._check_running(sbx)
            await self._ensure_awake(sbx)
            assert sbx.agent is not None
            sbx.busy = True
            self.store.touch(sbx.id)
            try:
                gen = run_cell(sbx.agent, sbx.session, code, timeout=timeout,
                               interrupt_grace=self.settings.interrupt_grace,
                               on_subscription=lambda sub: setattr(sbx, "current", sub))
                async with contextlib.aclosing(gen):
                    async for event in gen:
                        yield event
            finally:
                sbx.busy = False
                sbx.current = None
                sbx.record.last_active_at = time.time()
                if self.sandboxes.get(sbx.id) is sbx:
                    self.store.touch(sbx.id, sbx.record.last_active_at)

    def _check_running(self, sbx: Sandbox) -> None:
        if sbx.record.state == "hibernated":
            return  # woken by the caller under the sandbox's lock
        if sbx.record.state != "running" or sbx.agent is None or not sbx.agent.connected:
            raise SandboxNotRunning(
                f"sandbox {sbx.id} is {sbx.record.state}"
                f"{': ' + sbx.record.detail if sbx.record.detail else ''}; "
                "delete it and create a new one", state=sbx.record.state)

    # -- idle reaper ---------------------------------------------------------------------------

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval)
            now = time.time()
            for sbx in list(self.sandboxes.values()):
                rec = sbx.record
                idle_for = now - rec.last_active_at
                if sbx.busy or sbx.lock.locked():
                    continue
                if rec.state == "hibernated":
                    if idle_for > self.settings.hibernate_retention_seconds:
                        log.info("sandbox.retention_expired", sandbox_id=sbx.id)
                        await self._remove(sbx, reason="hibernation retention expired")
                    continue
                if idle_for <= rec.idle_timeout_seconds:
                    continue
                log.info("sandbox.idle_expired", sandbox_id=sbx.id, idle_seconds=round(idle_for),
                         action=self.settings.idle_action)
                if self.settings.idle_action == "hibernate" and rec.state == "running":
                    await self.hibernate(sbx)
                else:
                    await self._remove(sbx, reason="idle timeout")

    # -- hibernate, wake, fork -----------------------------------------------------------------

    async def hibernate(self, sbx: Sandbox) -> None:
        """Save the idle sandbox to disk and stop its VM; its next call wakes it."""
        async with sbx.lock:
            if sbx.record.state != "running" or sbx.agent is None:
                return
            t0 = time.monotonic()
            path = self._hibernate_path(sbx.record)
            agent, sbx.agent = sbx.agent, None
            await agent.close()
            try:
                size = await self.vms.hibernate(sbx.record.domain, path)
            except HypervisorError as exc:
                log.error("sandbox.hibernate_failed", sandbox_id=sbx.id, error=str(exc))
                await self._remove(sbx, reason=f"hibernation failed: {exc}")
                return
            sbx.record.state = "hibernated"
            self.store.update(sbx.id, state="hibernated")
            log.info("sandbox.hibernated", sandbox_id=sbx.id, bytes=size,
                     ms=round((time.monotonic() - t0) * 1000))

    async def _ensure_awake(self, sbx: Sandbox) -> None:
        """Wake a hibernated sandbox (caller holds its lock); state intact, clock fresh."""
        rec = sbx.record
        if rec.state != "hibernated":
            return
        t0 = time.monotonic()
        path = self._hibernate_path(rec)
        try:
            image = self.images.get_by_key(rec.template, rec.image_key)
            agent = await self.vms.wake(rec.domain, image, path,
                                        {"sandbox": rec.id, "template": rec.template})
        except (HypervisorError, ChannelClosed, AgentError, TimeoutError) as exc:
            raise SandboxNotRunning(
                f"sandbox {rec.id} was hibernated and could not be woken: {exc}; "
                "delete it and create a new one", state="hibernated") from exc
        self._bind(sbx, agent)
        rec.state = "running"
        self.store.update(rec.id, state="running")
        path.unlink(missing_ok=True)
        log.info("sandbox.woken", sandbox_id=rec.id, ms=round((time.monotonic() - t0) * 1000))

    async def fork(self, owner: str, sandbox_id: str, n: int = 1) -> list[Sandbox]:
        """``n`` new sandboxes holding every variable, import and file of the parent now."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.settings.max_fork:
            raise InvalidRequest(f"n={n!r} is out of range; fork between 1 and "
                                 f"{self.settings.max_fork} children at once", field="n")
        parent = self.get(owner, sandbox_id)
        async with parent.lock:
            self._check_running(parent)
            await self._ensure_awake(parent)
            prec = parent.record
            image = self.images.get_by_key(prec.template, prec.image_key)
            now = time.time()
            kids = [Sandbox(SandboxRecord(
                id="sbx_" + secrets.token_hex(8), owner=owner, template=prec.template,
                domain=self.hv.new_name(), state="starting", created_at=now, last_active_at=now,
                idle_timeout_seconds=prec.idle_timeout_seconds, memory_mib=prec.memory_mib,
                vcpus=prec.vcpus, accel=prec.accel, image_key=prec.image_key,
                metadata={**prec.metadata, "forked_from": prec.id})) for _ in range(n)]
            for kid in kids:
                self.store.insert(kid.record)
            t0 = time.monotonic()
            try:
                agents = await self.vms.fork(
                    prec.domain, image,
                    [(k.record.domain, {"sandbox": k.id, "template": prec.template}) for k in kids])
            except BaseException as exc:
                for kid in kids:
                    self.store.delete(kid.id)
                if isinstance(exc, (HypervisorError, ChannelClosed, AgentError, TimeoutError)):
                    raise BootFailed(f"fork of {prec.id} failed: {exc}") from exc
                raise
            for kid, agent in zip(kids, agents, strict=True):
                self._bind(kid, agent)
                kid.record.state = "running"
                self.store.update(kid.id, state="running")
                self.sandboxes[kid.id] = kid
            self.store.touch(prec.id)
            log.info("sandbox.forked", sandbox_id=prec.id, children=[k.id for k in kids],
                     ms=round((time.monotonic() - t0) * 1000))
            return kids
