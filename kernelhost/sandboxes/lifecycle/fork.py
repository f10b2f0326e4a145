"""Fork: ``n`` new sandboxes holding every variable, import and file of a live parent.

The parent is paused only while its whole state is copied (``VmFactory.fork``); the children
are copy-on-write clones of that copy, get fresh clocks and random seeds, inherit the parent's
network mode, idle timeout and metadata (plus ``forked_from``), and count against the owner's
limits like any new sandbox.
"""

from __future__ import annotations

import contextlib
import time

import structlog

from hypervisor import HypervisorError

from ... import tracing
from ...channel import AgentClient, ChannelError
from ...channel.protocol import Op
from ..context import Context
from ..errors import BootFailed, InvalidRequest
from ..registry import VmShape, new_record
from ..sandbox import Sandbox, ensure_usable
from ..states import SandboxState
from .create import Lifecycle
from .hibernation import Hibernation

log = structlog.get_logger("kernelhost.sandboxes")


class Forker:
    def __init__(self, ctx: Context, lifecycle: Lifecycle, hibernation: Hibernation) -> None:
        self.ctx = ctx
        self.lifecycle = lifecycle
        self.hibernation = hibernation
        self.registry = ctx.registry

    def _check_count(self, n: object) -> int:
        limit = self.ctx.settings.max_fork
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
            raise InvalidRequest(
                f"n={n!r} is out of range; fork between 1 and {limit} children at once", field="n"
            )
        return n

    async def fork(self, owner: str, sandbox_id: str, n: int = 1) -> list[Sandbox]:
        """``n`` new sandboxes holding every variable, import and file of the parent now."""
        n = self._check_count(n)
        parent = self.registry.get(owner, sandbox_id)
        prec = parent.record
        with tracing.span("sandbox.fork", sandbox_id=prec.id, children=n):
            async with self.registry.admit(owner, n, prec.memory_mib, alongside=1):
                async with parent.lock.hold("fork"), parent.vm_lock:
                    ensure_usable(parent)
                    await self.hibernation.wake(parent)
                    ensure_usable(parent)
                    return await self._fork_locked(parent, owner, n)

    async def _fork_locked(self, parent: Sandbox, owner: str, n: int) -> list[Sandbox]:
        prec = parent.record
        shape = VmShape(prec.memory_mib, prec.vcpus, prec.accel)
        kids = [
            Sandbox(
                new_record(
                    owner=owner,
                    template=prec.template,
                    domain=self.ctx.vms.new_name(),
                    image_key=prec.image_key,
                    shape=shape,
                    idle_timeout=prec.idle_timeout_seconds,
                    metadata={**prec.metadata, "forked_from": prec.id},
                    network=prec.network,
                )
            )
            for _ in range(n)
        ]
        for kid in kids:
            kid.record.run_as = prec.run_as  # its guest's memory is the parent's: the same user
            self.registry.record(kid.record)
        t0 = time.monotonic()
        try:
            with tracing.span("vm.fork", sandbox_id=prec.id, children=n):
                forked = await self.ctx.vms.fork(
                    prec.domain,
                    self.ctx.image_of(prec),
                    [
                        (k.record.domain, {"sandbox": k.id, "template": prec.template, "key": owner})
                        for k in kids
                    ],
                )
        except BaseException as exc:
            for kid in kids:
                self.registry.forget(kid.id)
            if isinstance(exc, HypervisorError | ChannelError | TimeoutError):
                raise BootFailed(f"fork of {prec.id} failed: {exc}", sandbox_id=prec.id) from exc
            raise
        agents = [agent for _, agent in forked]
        for kid, (domain, agent) in zip(kids, forked, strict=True):
            if domain != kid.record.domain:  # the spare's QEMU, started before the fork
                self.registry.update(kid, domain=domain)
            self.lifecycle.bind(kid, agent)
            self.registry.set_state(kid, SandboxState.RUNNING)
            self.registry.add(kid)
        await self._end_inherited_processes(parent, agents)
        self.registry.touch(parent)
        self.ctx.metrics.observe_fork(prec.template, n, time.monotonic() - t0)
        log.info(
            "sandbox.forked",
            sandbox_id=prec.id,
            children=[k.id for k in kids],
            ms=round((time.monotonic() - t0) * 1000),
        )
        return kids

    async def _end_inherited_processes(self, parent: Sandbox, agents: list[AgentClient]) -> None:
        """A child's VM is a copy of its parent's, background processes included, but their host
        side stays with the parent: the copies would run unlisted and unkillable, so they end."""
        runs = [p.running.run_id for p in parent.processes.values() if p.running.run_id]
        for agent in agents:
            for run_id in runs:
                with contextlib.suppress(ChannelError):
                    await agent.request(
                        Op.BASH_SIGNAL, timeout=self.ctx.settings.agent_timeout, run_id=run_id, signal="KILL"
                    )
