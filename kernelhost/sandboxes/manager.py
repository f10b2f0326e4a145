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
from typing import Any, Protocol

import structlog

from hypervisor import (
    GuestImage,
    Hypervisor,
    HypervisorError,
    ImageNotFound,
    ImageStore,
    LibvirtUnavailable,
)

from ..channel import AgentClient, AgentError, ChannelClosed, JupyterMessage, Subscription
from ..config import Settings
from ..metrics import Metrics
from .errors import (
    AgentUnresponsive,
    BackendUnavailable,
    BootFailed,
    CapacityExceeded,
    InvalidRequest,
    NotSupportedByImage,
    SandboxNotFound,
    SandboxNotRunning,
    UnknownTemplate,
)
from .execution import LANGUAGES, Control, inject_kernel_death, run_cell
from .files import FileOps, iso_time
from .network import HostNetwork, NetworkSpec, Tunnels, parse_network
from .store import SandboxRecord, Store
from .vms import VmFactory

log = structlog.get_logger("kernelhost.sandboxes")



@dataclass(eq=False)
class Sandbox:
    """A live sandbox: its record, its channel, and the lock that serializes its executions."""

    record: SandboxRecord
    agent: AgentClient | None = None
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # held while the VM behind the sandbox changes (hibernate, wake, replace, fork's snapshot) or
    # a restart works on it; taken after ``lock`` when both are needed, never before it
    vm_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    current: Subscription | None = None
    busy: bool = False
    control: Control | None = None  # the running execution, for interrupt and restart
    replacement: asyncio.Task[bool] | None = None  # a VM replacement in progress
    net: Tunnels | None = None  # host side of the guest's network tunnels (issue 6)
    # co-attach (issue 5): who sees every Jupyter message, agent event and channel change of
    # this sandbox (the Kernel Gateway's WebSocket hub); fed by _listen, called from _bind
    listeners: set[SandboxListener] = field(default_factory=set)

    @property
    def id(self) -> str:
        return self.record.id

    def to_dict(self) -> dict[str, Any]:
        r = self.record
        return {
            "id": r.id, "template": r.template, "state": r.state,
            "created_at": iso_time(r.created_at), "last_active_at": iso_time(r.last_active_at),
            "idle_timeout_seconds": r.idle_timeout_seconds, "accel": r.accel,
            "memory_mib": r.memory_mib, "vcpus": r.vcpus, "metadata": r.metadata,
            "network": NetworkSpec.from_dict(r.network).to_dict(),
            **({"detail": r.detail} if r.detail else {}),
        }




class SandboxManager(FileOps):
    def __init__(self, settings: Settings, hv: Hypervisor, images: ImageStore, store: Store,
                 accel: str) -> None:
        self.settings = settings
        self.hv = hv
        self.images = images
        self.store = store
        self.accel = accel
        self.sandboxes: dict[str, Sandbox] = {}
        self.vms = VmFactory(settings, hv, images, accel)
        self.metrics = Metrics()  # scraped at GET /metrics
        self.network = HostNetwork(settings)  # default allowlist, host protection (issue 6)
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
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # one failed task must not stop the rest of the cleanup
                log.error("shutdown.task_failed", task=t.get_name(), error=repr(exc))
        await self.vms.close()
        for sbx in self.sandboxes.values():
            if sbx.agent is not None:
                await sbx.agent.close()
        if self.hv.pending_destroys:
            await asyncio.to_thread(self.hv.retry_destroys)

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

    def _check_quota(self, owner: str, new: int) -> None:
        """Per-key limits: how many sandboxes, and how much VM memory while running."""
        mine = self.owned(owner)
        limit = self.settings.max_sandboxes_per_key
        if len(mine) + new > limit:
            raise CapacityExceeded(
                f"this API key holds {len(mine)} sandboxes and asked for {new} more, over its "
                f"limit of {limit} (max_sandboxes_per_key); close some first",
                limit="max_sandboxes_per_key", value=limit)
        used = sum(s.record.memory_mib for s in mine if s.record.state != "hibernated")
        want = new * self.settings.vm_memory_mib
        mem_limit = self.settings.max_memory_mib_per_key
        if used + want > mem_limit:
            raise CapacityExceeded(
                f"this API key's running sandboxes use {used} MiB of VM memory; {want} MiB more "
                f"would pass its limit of {mem_limit} MiB (max_memory_mib_per_key); close or "
                "hibernate some first", limit="max_memory_mib_per_key", value=mem_limit)

    async def create(self, owner: str, template: str, idle_timeout: int | None = None,
                     metadata: dict[str, str] | None = None, network: Any = None) -> Sandbox:
        t0 = time.monotonic()
        spec = network if isinstance(network, NetworkSpec) else parse_network(network)
        self._check_quota(owner, new=1)
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
            metadata=dict(metadata or {}), network=spec.to_dict(),
        )
        sbx = Sandbox(rec)
        clone = self.vms.pool.take(template) if self.vms.use_snapshots else None
        if clone is not None and clone.image_key == image.key:
            rec.domain, rec.state = clone.domain, "running"
            self.store.insert(rec)
            self._bind(sbx, clone.agent)
            try:
                await self._net_config(sbx, strict=True)
            except BaseException:
                await clone.agent.close()
                await self.vms.destroy_tracked(rec.domain)
                self.store.delete(rec.id)
                raise
            self.sandboxes[rec.id] = sbx
            self._spawn(self._label(rec))
            self.metrics.observe_create(template, "pool", time.monotonic() - t0)
            log.info("sandbox.created", sandbox_id=rec.id, domain=rec.domain, template=template,
                     how="pool")
            return sbx
        if clone is not None:  # made from an image that has since been rebuilt
            self._spawn(self.vms._discard(clone))
        self.store.insert(rec)
        bound = log.bind(sandbox_id=rec.id, domain=rec.domain)
        try:
            await self._launch(sbx, image)
        except BaseException as exc:
            self.metrics.count_create_failure(template)
            # includes cancellation (client went away): never leave the VM or its files behind
            tail = self._console_tail(rec.domain)
            await self.vms.destroy_tracked(rec.domain)
            self.store.delete(rec.id)
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
        self.metrics.observe_create(template, self.vms.last.how, time.monotonic() - t0)
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
        await self._net_config(sbx, strict=True)

    async def _attach(self, sbx: Sandbox, timeout: float) -> None:
        """Reattach to a running VM's agent (service restart)."""
        agent = await self.vms.connect_agent(self.hv.vm_dir(sbx.record.domain) / "agent.sock",
                                             timeout)
        self._bind(sbx, agent)
        self._spawn(self._net_config(sbx, strict=False))  # a running cell must not hold start

    def _bind(self, sbx: Sandbox, agent: AgentClient) -> None:
        agent.on_event = lambda ev: self._on_event(sbx, ev)
        agent.on_close = lambda reason, violation: self._on_close(sbx, reason, violation)
        sbx.agent = agent
        _listen(sbx, agent)  # co-attach broadcast (issue 5)
        self._bind_network(sbx, agent)
        if not agent.connected:  # closed before we listened: report it now
            self._on_close(sbx, agent.closed_reason or "channel closed", False)

    # -- network (issue 6; kernelhost/sandboxes/network.py, docs/network.md) --

    def _bind_network(self, sbx: Sandbox, agent: AgentClient) -> None:
        """Serve the guest's tunnels on this agent's channel; ended with the channel (close,
        hibernation, fork hand-over, VM replacement) or when another agent takes over."""
        if sbx.net is not None:
            sbx.net.close()
        spec = NetworkSpec.from_dict(sbx.record.network)
        tunnels = Tunnels(self.network.policy(spec), agent, sbx.id)
        sbx.net = tunnels
        agent.on_net = tunnels.on_frame
        on_close = agent.on_close

        def close(reason: str, violation: bool) -> None:
            tunnels.close()
            if on_close is not None:
                on_close(reason, violation)

        agent.on_close = close

    async def _net_config(self, sbx: Sandbox, strict: bool) -> None:
        """Tell the guest its network mode (proxy, pip.conf, the kernel's proxy environment).

        A guest in mode "none" is as its template made it and is not told anything. ``strict``
        (create, replacement): a failure raises; otherwise (wake, fork, reattach) it is logged.
        """
        spec = NetworkSpec.from_dict(sbx.record.network)
        agent = sbx.agent
        if spec.mode == "none" or agent is None:
            return
        try:
            await agent.request("net_config", timeout=max(30.0, self.settings.agent_timeout),
                                **self.network.guest_config(spec))
        except (asyncio.TimeoutError, AgentError, ChannelClosed) as exc:
            log.warning("sandbox.net_config_failed", sandbox_id=sbx.id, error=str(exc))
            if not strict:
                return
            if isinstance(exc, AgentError) and "unknown op" in str(exc):
                raise NotSupportedByImage(
                    f"the guest image of template {sbx.record.template!r} has no network support; "
                    "rebuild the images (make image) and create the sandbox again") from exc
            raise AgentUnresponsive(
                f"sandbox {sbx.id}: its agent did not set up network mode {spec.mode!r}: "
                f"{exc or type(exc).__name__}") from exc

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
        if event.get("event") == "kernel_died":
            self.metrics.count_kernel_death("kernel")
            if sbx.current is not None:
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
        self.metrics.count_kernel_death("vm")
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
        if timeout is None and self.settings.default_execution_timeout > 0:
            timeout = self.settings.default_execution_timeout
        self._check_running(sbx)
        return self._execute(sbx, code, timeout, language)

    async def _execute(self, sbx: Sandbox, code: str, timeout: float | None,
                       language: str = "python") -> AsyncGenerator[dict[str, Any], None]:
        async with sbx.lock:
            await self._wait_replacement(sbx)
            self._check_running(sbx)
            await self._ensure_awake(sbx)
            assert sbx.agent is not None
            sbx.busy = True
            sbx.control = Control()
            self.store.touch(sbx.id)
            t0 = time.monotonic()
            try:
                gen = run_cell(sbx.agent, sbx.session, code, timeout=timeout,
                               language=language,
                               interrupt_grace=self.settings.interrupt_grace,
                               restart_timeout=self.settings.restart_timeout,
                               agent_timeout=self.settings.agent_timeout,
                               max_output_bytes=self.settings.max_output_bytes,
                               max_result_bytes=self.settings.max_result_bytes,
                               control=sbx.control,
                               replace_vm=lambda reason: self._replace_vm(sbx, reason),
                               on_subscription=lambda sub: setattr(sbx, "current", sub))
                async with contextlib.aclosing(gen):
                    async for event in gen:
                        if event.get("type") == "end":
                            self.metrics.observe_end(language, event, time.monotonic() - t0)
                        yield event
            finally:
                sbx.busy = False
                sbx.current = None
                sbx.control = None
                sbx.record.last_active_at = time.time()
                if self.sandboxes.get(sbx.id) is sbx:
                    self.store.touch(sbx.id, sbx.record.last_active_at)

    def _check_running(self, sbx: Sandbox) -> None:
        if sbx.record.state in ("hibernated", "replacing"):
            return  # woken, or waited for, by the caller
        if sbx.record.state != "running" or sbx.agent is None or not sbx.agent.connected:
            raise SandboxNotRunning(
                f"sandbox {sbx.id} is {sbx.record.state}"
                f"{': ' + sbx.record.detail if sbx.record.detail else ''}; "
                f"POST /v1/sandboxes/{sbx.id}/restart gives it a fresh VM (state lost), "
                "or delete it and create a new one", state=sbx.record.state)

    # -- idle reaper ---------------------------------------------------------------------------

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval)
            if self.hv.pending_destroys:  # destroys that failed while libvirt was away
                done = await asyncio.to_thread(self.hv.retry_destroys)
                if done:
                    log.info("reaper.destroyed_late", domains=done)
            for sbx in list(self.sandboxes.values()):
                try:
                    await self._reap(sbx, time.time())
                except (HypervisorError, ChannelClosed, AgentError, OSError) as exc:
                    # the reaper must outlive any one sandbox's trouble
                    log.error("reaper.failed", sandbox_id=sbx.id, error=str(exc))

    async def _reap(self, sbx: Sandbox, now: float) -> None:
        """Hibernate or delete one sandbox if it has been idle for long enough."""
        rec = sbx.record
        idle_for = now - rec.last_active_at
        if (sbx.busy or sbx.lock.locked() or sbx.vm_lock.locked()
                or (sbx.replacement is not None and not sbx.replacement.done())
                or self.sandboxes.get(sbx.id) is not sbx):
            return
        if rec.state == "hibernated":
            if idle_for > self.settings.hibernate_retention_seconds:
                log.info("sandbox.retention_expired", sandbox_id=sbx.id)
                await self._remove(sbx, reason="hibernation retention expired")
            return
        if idle_for <= rec.idle_timeout_seconds:
            return
        log.info("sandbox.idle_expired", sandbox_id=sbx.id, idle_seconds=round(idle_for),
                 action=self.settings.idle_action)
        if self.settings.idle_action == "hibernate" and rec.state == "running":
            await self.hibernate(sbx)
        else:
            await self._remove(sbx, reason="idle timeout")

    # -- hibernate, wake, fork -----------------------------------------------------------------

    async def hibernate(self, sbx: Sandbox) -> None:
        """Save the idle sandbox to disk and stop its VM; its next call wakes it."""
        async with sbx.lock, sbx.vm_lock:
            if (sbx.record.state != "running" or sbx.agent is None or not sbx.agent.connected
                    or self.sandboxes.get(sbx.id) is not sbx):
                return
            t0 = time.monotonic()
            path = self._hibernate_path(sbx.record)
            agent, sbx.agent = sbx.agent, None
            await agent.close()
            try:
                size = await self.vms.hibernate(sbx.record.domain, path)
            except HypervisorError as exc:
                path.unlink(missing_ok=True)
                log.error("sandbox.hibernate_failed", sandbox_id=sbx.id, error=str(exc))
                await self._remove(sbx, reason=f"hibernation failed: {exc}")
                return
            if self.sandboxes.get(sbx.id) is not sbx:  # deleted while it was being saved
                path.unlink(missing_ok=True)
                return
            sbx.record.state = "hibernated"
            self.store.update(sbx.id, state="hibernated")
            self.metrics.count_hibernation(sbx.record.template)
            log.info("sandbox.hibernated", sandbox_id=sbx.id, bytes=size,
                     ms=round((time.monotonic() - t0) * 1000))

    async def _settle(self, sbx: Sandbox) -> None:
        """Wait for a replacement, hibernation or wake of ``sbx`` in flight, then wake it."""
        await self._wait_replacement(sbx)
        if sbx.vm_lock.locked():
            async with sbx.vm_lock:
                pass
        await self._ensure_awake(sbx)

    async def _ensure_awake(self, sbx: Sandbox) -> None:
        """Wake a hibernated sandbox; state intact, clock fresh. One wake at a time."""
        if sbx.record.state != "hibernated":
            return
        async with sbx.vm_lock:
            await self._wake(sbx)

    async def _wake(self, sbx: Sandbox) -> None:
        """Wake ``sbx`` if it is hibernated; the caller holds ``sbx.vm_lock``."""
        rec = sbx.record
        if rec.state != "hibernated" or self.sandboxes.get(sbx.id) is not sbx:
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
        await self._net_config(sbx, strict=False)  # drops tunnels the saved guest still had
        rec.state = "running"
        self.store.update(rec.id, state="running")
        path.unlink(missing_ok=True)
        self.metrics.observe_wake(rec.template, time.monotonic() - t0)
        log.info("sandbox.woken", sandbox_id=rec.id, ms=round((time.monotonic() - t0) * 1000))

    async def fork(self, owner: str, sandbox_id: str, n: int = 1) -> list[Sandbox]:
        """``n`` new sandboxes holding every variable, import and file of the parent now."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.settings.max_fork:
            raise InvalidRequest(f"n={n!r} is out of range; fork between 1 and "
                                 f"{self.settings.max_fork} children at once", field="n")
        parent = self.get(owner, sandbox_id)
        self._check_quota(owner, new=n)
        async with parent.lock, parent.vm_lock:
            self._check_running(parent)
            await self._wake(parent)
            self._check_running(parent)
            prec = parent.record
            image = self.images.get_by_key(prec.template, prec.image_key)
            now = time.time()
            kids = [Sandbox(SandboxRecord(
                id="sbx_" + secrets.token_hex(8), owner=owner, template=prec.template,
                domain=self.hv.new_name(), state="starting", created_at=now, last_active_at=now,
                idle_timeout_seconds=prec.idle_timeout_seconds, memory_mib=prec.memory_mib,
                vcpus=prec.vcpus, accel=prec.accel, image_key=prec.image_key,
                metadata={**prec.metadata, "forked_from": prec.id},
                network=dict(prec.network))) for _ in range(n)]
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
            self.metrics.observe_fork(prec.template, n, time.monotonic() - t0)
            log.info("sandbox.forked", sandbox_id=prec.id, children=[k.id for k in kids],
                     ms=round((time.monotonic() - t0) * 1000))
            return kids

    # == execution depth: interrupt, restart, VM replacement (files: files.py) =====================
    # The timeout ladder's last rung and the restart of a dead VM reuse ``_launch`` with a new
    # domain name (so a destroy still in flight for the old name cannot hit the new VM). Interrupt,
    # restart and file calls (FileOps) do not queue behind executions: they act while one runs.

    async def interrupt(self, sbx: Sandbox) -> dict[str, Any]:
        """Interrupt what runs now (Python: KeyboardInterrupt; bash: SIGINT); state is kept."""
        await self._wait_replacement(sbx)
        self._check_running(sbx)
        control = sbx.control
        if sbx.record.state != "running" or sbx.agent is None or control is None:
            return {"interrupted": False}  # nothing runs (a hibernated sandbox runs nothing)
        control.interrupt_requested = True
        try:
            if control.kind == "bash":
                await sbx.agent.request("bash_signal", timeout=self.settings.agent_timeout,
                                        run_id=control.run_id, signal="INT")
            else:
                await sbx.agent.request("interrupt", timeout=self.settings.agent_timeout)
        except (asyncio.TimeoutError, AgentError, ChannelClosed) as exc:
            raise AgentUnresponsive(
                f"the agent of sandbox {sbx.id} did not carry out the interrupt within "
                f"{self.settings.agent_timeout:g}s ({exc or type(exc).__name__}); "
                f"POST /v1/sandboxes/{sbx.id}/restart restarts the kernel, or gives the sandbox "
                "a fresh VM if its agent stays silent") from exc
        return {"interrupted": True}

    async def restart(self, sbx: Sandbox) -> dict[str, Any]:
        """Restart the kernel and reset the shell (state lost); a dead or silent VM is replaced.

        Does not wait for a running execution: that one ends at once with status ``restarted``.
        """
        await self._wait_replacement(sbx)
        # vm_lock: no hibernation, wake or fork snapshot can take the VM away while it restarts
        async with sbx.vm_lock:
            if self.sandboxes.get(sbx.id) is not sbx:
                raise SandboxNotFound(sbx.id)  # deleted meanwhile
            await self._wake(sbx)
            if sbx.control is not None:
                sbx.control.notify("restarted")
            agent = sbx.agent
            if sbx.record.state == "running" and agent is not None and agent.connected:
                try:
                    # The restart frame goes out before the woken execution's successor can send
                    # anything; the agent holds shell messages until the new kernel is ready.
                    await agent.request("restart", timeout=self.settings.restart_timeout)
                    with contextlib.suppress(AgentError):  # images older than bash lack the op
                        await agent.request("bash_reset", timeout=self.settings.agent_timeout)
                    self.store.touch(sbx.id)
                    return {"recovery": "kernel_restarted"}
                except (asyncio.TimeoutError, AgentError, ChannelClosed) as exc:
                    reason = f"the kernel restart failed ({exc or type(exc).__name__})"
            else:
                reason = f"restart of a {sbx.record.state} sandbox"
        if not await self._replace_vm(sbx, reason):
            raise SandboxNotFound(sbx.id)  # deleted meanwhile
        return {"recovery": "vm_replaced"}

    async def _wait_replacement(self, sbx: Sandbox) -> None:
        task = sbx.replacement
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    async def _replace_vm(self, sbx: Sandbox, reason: str) -> bool:
        """Give the sandbox a fresh VM from its template (every variable and file is lost).

        One replacement at a time per sandbox; it runs as an owned task, so a caller that goes
        away (client disconnect) does not leave it half done. False if the sandbox is going away.
        """
        task = sbx.replacement
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._do_replace(sbx, reason),
                                                          name=f"replace-vm:{sbx.id}")
            sbx.replacement = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _do_replace(self, sbx: Sandbox, reason: str) -> bool:
        async with sbx.vm_lock:
            return await self._replace_locked(sbx, reason)

    async def _replace_locked(self, sbx: Sandbox, reason: str) -> bool:
        rec = sbx.record
        if self.sandboxes.get(sbx.id) is not sbx:
            return False
        log.warning("sandbox.replacing_vm", sandbox_id=sbx.id, domain=rec.domain, reason=reason)
        t0 = time.monotonic()
        old_agent, sbx.agent = sbx.agent, None
        if old_agent is not None:
            await old_agent.close()
        # Tasks the close spawned (_on_close: destroy the old domain, or remove the sandbox after
        # a protocol violation) take their first step now, binding the old names.
        await asyncio.sleep(0)
        if self.sandboxes.get(sbx.id) is not sbx:
            return False
        with contextlib.suppress(HypervisorError):
            await asyncio.to_thread(self.hv.destroy, rec.domain)
        self._hibernate_path(rec).unlink(missing_ok=True)  # a hibernated one is replaced too
        rec.domain, rec.state, rec.detail = self.hv.new_name(), "replacing", ""
        self.store.update(rec.id, domain=rec.domain, state="replacing", detail="")
        try:
            image = self.images.get(rec.template)
            # the new VM runs the template's current image: later forks and wakes must use it
            rec.image_key = image.key
            self.store.update(rec.id, image_key=image.key)
            await self._launch(sbx, image)
        except Exception as exc:
            detail = f"replacing its VM ({reason}) failed: {exc or type(exc).__name__}"
            log.error("sandbox.replace_failed", sandbox_id=sbx.id, error=detail)
            if self.sandboxes.get(sbx.id) is sbx:
                rec.state, rec.detail = "dead", detail
                self.store.update(rec.id, state="dead", detail=detail)
            raise BootFailed(f"sandbox {sbx.id}: {detail}; delete it and create a new one") \
                from exc
        if self.sandboxes.get(sbx.id) is not sbx:  # deleted while the new VM came up
            if sbx.agent is not None:
                await sbx.agent.close()
            await self._destroy_vm_only(sbx)
            return False
        rec.state, rec.image_key = "running", image.key
        self.store.update(rec.id, state="running", image_key=image.key, detail="")
        log.info("sandbox.vm_replaced", sandbox_id=sbx.id, domain=rec.domain,
                 ms=round((time.monotonic() - t0) * 1000))
        return True

# == co-attach (issue 5): a sandbox's kernel traffic to its listeners ==============================
# Every Jupyter message from the guest, every agent event and every channel change of a sandbox is
# handed to each of ``Sandbox.listeners`` (the Kernel Gateway's WebSocket hub, kernelhost/api/
# gateway.py), after the manager's own handling. Listeners run on the channel's reader: they must
# not block, and one that raises is logged, never allowed to break the channel (a raise there
# would count as a protocol violation and destroy the VM).


class SandboxListener(Protocol):
    def on_message(self, message: JupyterMessage) -> None: ...

    def on_event(self, event: dict[str, Any]) -> None: ...

    def on_channel(self, connected: bool, reason: str) -> None: ...


def _listen(sbx: Sandbox, agent: AgentClient) -> None:
    """Chain the listeners after the manager's own hooks of ``agent`` (called by ``_bind``)."""
    on_event, on_close = agent.on_event, agent.on_close

    def event(ev: dict[str, Any]) -> None:
        if on_event is not None:
            on_event(ev)
        _tell(sbx, "on_event", ev)

    def close(reason: str, violation: bool) -> None:
        if on_close is not None:
            on_close(reason, violation)
        _tell(sbx, "on_channel", False, reason)

    agent.on_message = lambda m: _tell(sbx, "on_message", m)
    agent.on_event, agent.on_close = event, close
    if agent.connected:
        _tell(sbx, "on_channel", True, "")


def _tell(sbx: Sandbox, hook: str, *args: Any) -> None:
    for listener in list(sbx.listeners):
        try:
            getattr(listener, hook)(*args)
        except Exception:
            log.exception("sandbox.listener_failed", sandbox_id=sbx.id, hook=hook)
