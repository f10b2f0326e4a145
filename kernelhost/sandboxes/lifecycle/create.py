"""A sandbox's life: created (a pooled clone handed over, or a VM launched), bound to its agent's
channel, lost or cut off when the channel goes, removed; and, at service start, reconciled with
the VMs libvirt still runs (reattached if known, destroyed if not).

Binding is where a sandbox's channel gets its listeners, in this order: the sandbox's own watch
(kernel death, the loss of the VM, a protocol violation), its network tunnels, and the Jupyter
clients attached to it (``session.KernelSession``), which therefore see the sandbox's state as
the watch left it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from hypervisor import GuestImage, HypervisorError, ImageNotFound, LibvirtUnavailable

from ... import tracing
from ...channel import AgentClient, ChannelError, ChannelListener, Event
from ...channel.client import CLOSED_BY_HOST
from ...ratelimit import TokenBucket
from ..context import Context
from ..errors import BackendUnavailable, BootFailed, InvalidRequest, UnknownTemplate
from ..inside.accounts import set_user
from ..network import NetworkSpec, parse_network
from ..registry import new_record
from ..sandbox import Sandbox
from ..states import SandboxState
from ..vm.pool import Clone

log = structlog.get_logger("kernelhost.sandboxes")
T = TypeVar("T")


class SandboxWatch(ChannelListener):
    """The sandbox's own listener on one agent's channel."""

    def __init__(self, lifecycle: Lifecycle, sbx: Sandbox, agent: AgentClient) -> None:
        self.lifecycle = lifecycle
        self.sbx = sbx
        self.agent = agent
        self.events = TokenBucket(1.0, 20.0)  # agent events logged: per second, and at once

    def on_event(self, event: dict[str, Any]) -> None:
        what = str(event.get("event"))[:40]  # the guest chose it: bounded before it is logged
        if self.events.take():
            log.info("sandbox.agent_event", sandbox_id=self.sbx.id, agent_event=what)
        if what == Event.KERNEL_DIED:
            self.lifecycle.ctx.metrics.count_kernel_death("kernel")
            code = event.get("exit_code")
            call = self.sbx.call
            if call is not None and call.context == event.get("context"):  # its kernel died
                exit_code = code if isinstance(code, int) and not isinstance(code, bool) else None
                call.notify("kernel_died", exit_code=exit_code)

    def on_close(self, reason: str, violation: bool) -> None:
        if self.sbx.agent is self.agent:
            self.lifecycle.channel_closed(self.sbx, reason, violation)


#: a key's template name -> (the image name a record keeps, the image); ``TemplateService.resolve``
Resolve = Callable[[str, str], tuple[str, GuestImage]]


class Lifecycle:
    def __init__(self, ctx: Context, resolve: Resolve | None = None) -> None:
        self.ctx = ctx
        self.registry = ctx.registry
        self.resolve = resolve
        #: called with each sandbox ``remove`` took out (its checkpoints go with it)
        self.on_remove: list[Callable[[Sandbox], None]] = []

    # -- create --------------------------------------------------------------------------------

    def idle_timeout(self, idle_timeout: int | None) -> int:
        settings = self.ctx.settings
        idle = settings.default_idle_timeout if idle_timeout is None else idle_timeout
        if not 1 <= idle <= settings.max_idle_timeout:
            raise InvalidRequest(
                f"idle_timeout_seconds={idle} is out of range; use 1 to {settings.max_idle_timeout}",
                field="idle_timeout_seconds",
            )
        return idle

    def check_metadata(self, metadata: dict[str, str] | None) -> dict[str, str]:
        """Checked against ``max_metadata_bytes``: it is kept in every record, copied into every
        fork child and sent with every listing."""
        data = dict(metadata or {})
        limit = self.ctx.settings.max_metadata_bytes
        size = len(json.dumps(data))
        if size > limit:
            raise InvalidRequest(
                f"metadata is {size} bytes as JSON, over the limit of {limit} "
                "(max_metadata_bytes); keep large data in a file in the sandbox",
                field="metadata",
                limit="max_metadata_bytes",
            )
        return data

    def _image(self, owner: str, template: str) -> tuple[str, GuestImage]:
        """The image name to record and the image, for ``owner``'s template ``template``."""
        if self.resolve is not None:
            return self.resolve(owner, template)
        try:
            return template, self.ctx.images.get(template)
        except ImageNotFound as exc:
            raise UnknownTemplate(
                f"unknown template {template!r}; valid templates: "
                f"{', '.join(exc.available) or 'none built (run make image)'}",
                field="template",
                valid=exc.available,
            ) from None

    async def create(
        self,
        owner: str,
        template: str,
        idle_timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        network: NetworkSpec | None = None,
        auto_checkpoint: int = 0,
        run_as: str = "",
    ) -> Sandbox:
        t0 = time.monotonic()
        name, image = self._image(owner, template)
        # the template's default network when the request names none
        spec = parse_network(network if network is not None else image.manifest.get("network"))
        shape = self.ctx.shape_for(image)
        with tracing.span("sandbox.create", template=name) as creating:
            async with self.registry.admit(owner, 1, shape.memory_mib):
                idle = self.idle_timeout(idle_timeout)
                meta = self.check_metadata(metadata)
                rec = new_record(
                    owner=owner,
                    template=name,
                    domain=self.ctx.vms.new_name(),
                    image_key=image.key,
                    shape=shape,
                    idle_timeout=idle,
                    metadata=meta,
                    network=spec.to_dict(),
                )
                rec.auto_checkpoint = auto_checkpoint
                rec.run_as = run_as  # told to the guest at its hand-over (inside/accounts.py)
                sbx = Sandbox(rec)
                vms = self.ctx.vms
                # a shared template's pool fills once it is used (idempotent); a key's own template
                # has none: no VM runs on a key's behalf but its sandboxes (they clone its snapshot)
                clone = vms.take_clone(name, refill="@" not in name)
                if clone is not None and clone.image_key == image.key:
                    await self._adopt(sbx, clone)
                    how = "pool"
                else:
                    if clone is not None:  # made from an image that has since been rebuilt
                        self.ctx.tasks.spawn(vms.discard(clone), name=f"discard:{clone.domain}")
                    how = await self._create_vm(sbx, image)
            tracing.set_attributes(creating, sandbox_id=sbx.id, how=how)
        seconds = time.monotonic() - t0
        self.ctx.metrics.observe_create(name, how, seconds)
        log.info(
            "sandbox.created",
            sandbox_id=rec.id,
            domain=rec.domain,
            template=name,
            how=how,
            ms=round(seconds * 1000),
        )
        return sbx

    async def admit(
        self,
        sbx: Sandbox,
        start: Callable[[], Awaitable[T]],
        on_failure: Callable[[BaseException], BaseException] | None = None,
    ) -> T:
        """The one way a sandbox comes to life (a create, a pooled VM handed over, a branch of a
        checkpoint): its record is stored (``starting``), ``start`` gives it a VM and binds its
        channel, then it runs and is live. If ``start`` fails or is cancelled (the client went
        away) nothing is left: its channel closed, its VM destroyed, its record forgotten.
        ``on_failure`` maps the error; it runs before the VM is destroyed (its console is
        still there to read)."""
        rec = sbx.record
        self.registry.record(rec)
        try:
            result = await start()
        except BaseException as exc:
            mapped = on_failure(exc) if on_failure is not None else exc
            if sbx.agent is not None:
                await sbx.agent.close()
            await self.ctx.vms.destroy(rec.domain)
            self.registry.forget(rec.id)
            if mapped is exc:
                raise
            raise mapped from exc
        self.registry.set_state(sbx, SandboxState.RUNNING)
        self.registry.add(sbx)
        return result

    async def _adopt(self, sbx: Sandbox, clone: Clone) -> None:
        """Hand a pooled clone over to ``sbx``; on failure nothing of it is left."""
        rec = sbx.record
        rec.domain = clone.domain

        async def start() -> None:
            with tracing.span("sandbox.pool_handover", sandbox_id=sbx.id, template=rec.template):
                self.bind(sbx, clone.agent)
                await self.ctx.network.configure(sbx, strict=True)
                await set_user(sbx, self.ctx.settings.timeouts.restart)

        await self.admit(sbx, start)
        # the key's from now on: its metadata, its CPU partition
        meta = {"sandbox": rec.id, "template": rec.template, "key": rec.owner}
        self.ctx.tasks.spawn(self.ctx.vms.label(rec.domain, meta), name=f"label:{sbx.id}")

    async def _create_vm(self, sbx: Sandbox, image: GuestImage) -> str:
        """Launch a VM for ``sbx``; how it came (clone or boot)."""
        rec = sbx.record

        def failed(exc: BaseException) -> BaseException:
            self.ctx.metrics.count_create_failure(rec.template)
            return self._boot_error(exc, rec.id, rec.domain, self.ctx.vms.console_tail(rec.domain))

        return await self.admit(sbx, lambda: self.launch(sbx, image), failed)

    def _boot_error(self, exc: BaseException, sandbox_id: str, domain: str, tail: str) -> BaseException:
        if isinstance(exc, LibvirtUnavailable):
            return BackendUnavailable(str(exc))
        if isinstance(exc, HypervisorError | ChannelError | TimeoutError):
            log.warning(
                "sandbox.boot_failed", sandbox_id=sandbox_id, domain=domain, error=str(exc), console=tail
            )
            return BootFailed(
                f"sandbox VM did not reach a ready kernel within "
                f"{self.ctx.settings.boot_timeout:.0f}s: {exc or type(exc).__name__}; check "
                "'kernelhost doctor' and raise KERNELHOST_BOOT_TIMEOUT on slow hosts",
                console=tail,
            )
        return exc

    async def launch(self, sbx: Sandbox, image: GuestImage) -> str:
        """Start a VM for ``sbx.record`` (domain ``record.domain``) and attach its agent; how it
        came. The one way a sandbox gets a VM, for a create and for a replacement alike. On
        failure the caller destroys the domain."""
        rec = sbx.record
        with tracing.span("vm.launch", sandbox_id=rec.id, template=rec.template) as launching:
            meta = {"sandbox": rec.id, "template": rec.template, "key": rec.owner}
            launched = await self.ctx.vms.launch(rec.domain, image, meta)
            tracing.set_attributes(launching, how=launched.timings.how)
            self.bind(sbx, launched.agent)
            await self.ctx.network.configure(sbx, strict=True)
            await set_user(sbx, self.ctx.settings.timeouts.restart)
        return launched.timings.how

    def bind(self, sbx: Sandbox, agent: AgentClient) -> None:
        """Make ``agent`` the sandbox's channel, with its listeners (see the module docstring)."""
        sbx.agent = agent
        watch = SandboxWatch(self, sbx, agent)
        agent.add_listener(watch)
        self.ctx.network.bind(sbx, agent)
        if sbx.kernel is not None:
            sbx.kernel.bind(agent)
        if not agent.connected:  # closed before we listened: report it now
            watch.on_close(agent.closed_reason or "channel closed", False)

    # -- losing the channel, removing ------------------------------------------------------------

    def channel_closed(self, sbx: Sandbox, reason: str, violation: bool) -> None:
        if not self.registry.holds(sbx) or reason == CLOSED_BY_HOST:
            return
        if violation:
            # a guest that breaks the protocol is not trusted again: its VM goes
            log.warning("sandbox.protocol_violation", sandbox_id=sbx.id, reason=reason)
            self.ctx.tasks.spawn(
                self.remove(sbx, reason=f"protocol violation: {reason}"), name=f"remove:{sbx.id}"
            )
            return
        log.warning("sandbox.lost", sandbox_id=sbx.id, reason=reason)
        self.ctx.metrics.count_kernel_death("vm")
        self.registry.set_state(sbx, SandboxState.DEAD, detail=f"the VM stopped: {reason}")
        self.ctx.vms.destroy_later(sbx.record.domain)

    async def delete(self, owner: str, sandbox_id: str) -> None:
        await self.remove(self.registry.get(owner, sandbox_id), reason="deleted")

    async def remove(self, sbx: Sandbox, reason: str) -> None:
        """Take the sandbox out of the service and destroy its VM and files (idempotent)."""
        if not self.registry.pop(sbx):
            return
        if sbx.agent is not None:
            await sbx.agent.close()
        await self.ctx.vms.destroy(sbx.record.domain)
        self.registry.forget(sbx.id)
        self.ctx.drop_hibernation_file(sbx.record)
        for hook in self.on_remove:
            hook(sbx)
        log.info("sandbox.removed", sandbox_id=sbx.id, reason=reason)

    # -- service start ---------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Reattach to running VMs we know, drop records of dead ones, destroy strays."""
        ctx = self.ctx
        try:
            running = await ctx.vms.running_domains()
        except LibvirtUnavailable as exc:
            raise BackendUnavailable(str(exc)) from exc
        keep: set[str] = set()
        for rec in ctx.registry.store.all():
            sbx = Sandbox(rec)
            if rec.state == SandboxState.HIBERNATED and ctx.has_hibernation_file(rec):
                ctx.registry.add(sbx)  # wakes on its next call
                continue
            if rec.state == SandboxState.STARTING or rec.domain not in running:
                # killed mid-create, or its VM is gone: nothing to reattach to
                log.info("sandbox.dropped", sandbox_id=rec.id, domain=rec.domain, state=rec.state)
                ctx.registry.forget(rec.id)
                continue
            if await self._reattach(sbx):
                keep.add(rec.domain)
        removed = await ctx.vms.reconcile(keep)
        if removed:
            log.info("reconcile.destroyed", domains=removed)
        self._remove_stray_hibernations()

    async def _reattach(self, sbx: Sandbox) -> bool:
        rec = sbx.record
        try:
            agent = await self.ctx.vms.reattach(rec.domain, self.ctx.settings.timeouts.reattach)
        except ChannelError as exc:
            log.warning("sandbox.reattach_failed", sandbox_id=rec.id, error=str(exc))
            self.registry.forget(rec.id)
            return False
        self.registry.add(sbx)
        self.bind(sbx, agent)
        # a cell still running in the guest must not hold the service's start
        self.ctx.tasks.spawn(self.ctx.network.configure(sbx, strict=False), name=f"net-config:{sbx.id}")
        log.info("sandbox.reattached", sandbox_id=rec.id, domain=rec.domain)
        return True

    def _remove_stray_hibernations(self) -> None:
        known = {self.ctx.settings.hibernate_dir / f"{s.id}.state" for s in self.registry}
        directory = self.ctx.settings.hibernate_dir
        store = self.registry.store
        if directory.is_dir():
            for path in directory.iterdir():
                # a shared directory holds other nodes' sandboxes too: only a file no record names
                if path not in known and not (store.shared and store.get(path.name.split(".")[0])):
                    path.unlink(missing_ok=True)
