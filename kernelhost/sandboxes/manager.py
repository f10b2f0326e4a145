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
        self._boot_slots = asyncio.Semaphore(settings.max_concurrent_boots)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None

    # -- start-up and shutdown -----------------------------------------------------------------

    async def start(self) -> None:
        """Reattach to running VMs we know, drop records of dead ones, destroy strays."""
        try:
            domains = {d.name: d for d in await asyncio.to_thread(self.hv.domains)}
        except LibvirtUnavailable as exc:
            raise BackendUnavailable(str(exc)) from exc
        keep: set[str] = set()
        for rec in self.store.all():
            sbx = Sandbox(rec)
            info = domains.get(rec.domain)
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
        self._reaper = asyncio.create_task(self._reap_loop(), name="idle-reaper")

    async def close(self) -> None:
        """Stop background work and close channels; VMs keep running for the next start."""
        tasks = [t for t in [self._reaper, *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
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
        bound.info("sandbox.created", template=template, boot_ms=round((time.monotonic() - t0) * 1000))
        return sbx

    async def _launch(self, sbx: Sandbox, image: GuestImage) -> None:
        """Start a VM for ``sbx.record`` (domain ``record.domain``) and attach its agent.

        The one way a sandbox gets a VM, for a create and for a replacement alike. On failure the
        caller destroys the domain.
        """
        rec = sbx.record
        async with self._boot_slots:
            spec = self.hv.spec_for(
                rec.domain, image, accel=self.accel, memory_mib=rec.memory_mib,
                vcpus=rec.vcpus, metadata={"sandbox": rec.id, "template": rec.template})
            await asyncio.to_thread(self.hv.start, spec)
            await self._attach(sbx, timeout=self.settings.boot_timeout)

    async def _attach(self, sbx: Sandbox, timeout: float) -> None:
        rec = sbx.record
        agent = AgentClient(
            self.hv.vm_dir(rec.domain) / "agent.sock",
            max_frame_bytes=self.settings.max_frame_bytes,
            on_event=lambda ev: self._on_event(sbx, ev),
            on_close=lambda reason, violation: self._on_close(sbx, reason, violation),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await agent.connect(timeout=timeout)
        try:
            await agent.request("hello", timeout=max(1.0, deadline - loop.time()))
        except BaseException:
            await agent.close()
            raise
        sbx.agent = agent

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
                idle_for = now - sbx.record.last_active_at
                if not sbx.busy and not sbx.lock.locked() and idle_for > sbx.record.idle_timeout_seconds:
                    log.info("sandbox.idle_expired", sandbox_id=sbx.id, idle_seconds=round(idle_for))
                    await self._remove(sbx, reason="idle timeout")

