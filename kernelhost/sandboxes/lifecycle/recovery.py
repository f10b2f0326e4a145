"""Bringing a sandbox back: interrupt what runs, restart the kernel, or give the sandbox a fresh
VM from its template (the timeout ladder's last rung, and the restart of a dead VM).

None of these queue behind a running execution: they act on it. A replacement reuses
``Lifecycle.launch`` with a new domain name, so a destroy still in flight for the old name
cannot hit the new VM, and runs as an owned task, so a caller that goes away (a client
disconnect) does not leave it half done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from ...channel import ChannelError
from ...channel.protocol import Capability, Op
from ..context import Context
from ..errors import AgentUnresponsive, BootFailed, Remedy, SandboxError, SandboxNotFound
from ..sandbox import Sandbox, ensure_usable, wait_replacement
from ..states import Recovery, SandboxState
from .create import Lifecycle
from .hibernation import Hibernation

log = structlog.get_logger("kernelhost.sandboxes")


class Recoverer:
    def __init__(self, ctx: Context, lifecycle: Lifecycle, hibernation: Hibernation) -> None:
        self.ctx = ctx
        self.lifecycle = lifecycle
        self.hibernation = hibernation
        self.registry = ctx.registry

    async def interrupt(self, sbx: Sandbox) -> bool:
        """Interrupt what runs now (Python: KeyboardInterrupt; bash: SIGINT); state is kept.
        False if nothing ran: no native call, and no attached Jupyter client's cell."""
        await wait_replacement(sbx)
        ensure_usable(sbx)
        agent = sbx.live_agent
        call = sbx.call
        kernel_busy = sbx.kernel is not None and sbx.kernel.running
        if agent is None or (call is None and not kernel_busy):
            log.info("sandbox.interrupt_skipped", sandbox_id=sbx.id, why="nothing runs")
            return False  # nothing runs (a hibernated sandbox runs nothing)
        timeout = self.ctx.settings.agent_timeout
        try:
            if call is not None:
                call.interrupt_requested = True
                if call.language == "bash":
                    await agent.request(Op.BASH_SIGNAL, timeout=timeout, run_id=call.run_id, signal="INT")
                    return True
                if call.context is not None:  # a code context's cell: its own kernel
                    await agent.request(Op.CONTEXT_INTERRUPT, timeout=timeout, context=call.context)
                    return True
            await agent.request(Op.INTERRUPT, timeout=timeout)
        except ChannelError as exc:
            raise AgentUnresponsive(
                f"the agent of sandbox {sbx.id} did not carry out the interrupt within "
                f"{timeout:g}s ({exc or type(exc).__name__})",
                sandbox_id=sbx.id,
            ) from exc
        return True

    async def restart(self, sbx: Sandbox) -> Recovery:
        """Restart the kernel and reset the shell (state lost); a dead or silent VM is replaced.

        Does not wait for a running execution: that one ends at once with status ``restarted``.
        """
        await wait_replacement(sbx)
        # vm_lock: no hibernation, wake or fork's freeze can take the VM away while it restarts
        async with sbx.vm_lock:
            if not self.registry.holds(sbx):
                raise SandboxNotFound(sbx.id)  # deleted meanwhile
            await self.hibernation.wake(sbx)
            if sbx.call is not None and sbx.call.context is None:  # a context's kernel goes on
                sbx.call.notify("restarted")
            agent = sbx.live_agent
            if agent is not None:
                try:
                    # The restart frame goes out before the woken execution's successor can send
                    # anything; the agent holds shell messages until the new kernel is ready.
                    await agent.request(Op.RESTART, timeout=self.ctx.settings.restart_timeout)
                    if agent.supports(Capability.BASH):
                        await agent.request(Op.BASH_RESET, timeout=self.ctx.settings.agent_timeout)
                    self.registry.touch(sbx)
                    return Recovery.KERNEL_RESTARTED
                except ChannelError as exc:
                    reason = f"the kernel restart failed ({exc or type(exc).__name__})"
            else:
                reason = f"restart of a {sbx.record.state} sandbox"
        if not await self.replace_vm(sbx, reason):
            raise SandboxNotFound(sbx.id)  # deleted meanwhile
        return Recovery.VM_REPLACED

    async def replace_vm(self, sbx: Sandbox, reason: str) -> bool:
        """Give the sandbox a fresh VM from its template (every variable and file is lost).

        One replacement at a time per sandbox. False if the sandbox is going away.
        """
        task = sbx.replacement
        if task is None or task.done():
            task = self.ctx.tasks.spawn(
                self._replace(sbx, reason), name=f"replace-vm:{sbx.id}", expected=(BootFailed,)
            )
            sbx.replacement = task
        return await asyncio.shield(task)

    async def _replace(self, sbx: Sandbox, reason: str) -> bool:
        async with sbx.vm_lock:
            if not self.registry.holds(sbx):
                return False
            log.warning("sandbox.replacing_vm", sandbox_id=sbx.id, domain=sbx.record.domain, reason=reason)
            t0 = time.monotonic()

            async def start() -> None:
                image = self.ctx.images.get(sbx.record.template)
                # the new VM runs the template's current image: later forks and wakes must use it
                self.registry.update(sbx, image_key=image.key)
                await self.lifecycle.launch(sbx, image)

            if not await self.swap_vm(sbx, start, f"replacing its VM ({reason})"):
                return False
            log.info(
                "sandbox.vm_replaced",
                sandbox_id=sbx.id,
                domain=sbx.record.domain,
                ms=round((time.monotonic() - t0) * 1000),
            )
            return True

    async def swap_vm(
        self, sbx: Sandbox, start: Callable[[], Awaitable[None]], what: str, *, wait: bool = True
    ) -> bool:
        """Give ``sbx`` another VM, the one way a sandbox changes VM (a replacement, a restore).
        The caller holds ``sbx.vm_lock``. The old VM is dropped (``wait=False``: destroyed in
        the background while the new one comes), the sandbox gets a new domain name (state
        ``replacing``), ``start`` starts that VM and binds its channel, then it runs again.

        False if the sandbox was deleted meanwhile: nothing of the new VM is left, whenever the
        delete came. If ``start`` fails, the sandbox is ``dead`` with ``what`` and the cause
        as its detail, and the error is raised (a ``SandboxError`` as it is, any other as
        ``BootFailed``)."""
        await self.drop_vm(sbx, wait)
        if not self.registry.holds(sbx):
            return False
        self.registry.update(sbx, domain=self.ctx.vms.new_name(), state=SandboxState.REPLACING, detail="")
        try:
            await start()
        except Exception as exc:
            detail = f"{what} failed: {exc or type(exc).__name__}"
            log.error("sandbox.swap_failed", sandbox_id=sbx.id, error=detail)
            if self.registry.holds(sbx):
                self.registry.set_state(sbx, SandboxState.DEAD, detail=detail)
            if isinstance(exc, SandboxError):
                raise
            raise BootFailed(
                f"sandbox {sbx.id}: {detail}", remedy=Remedy.RECREATE, sandbox_id=sbx.id
            ) from exc
        if not self.registry.holds(sbx):  # deleted while the new VM came up
            if sbx.agent is not None:
                await sbx.agent.close()
            await self.ctx.vms.destroy(sbx.record.domain)
            return False
        self.registry.update(sbx, state=SandboxState.RUNNING, detail="")
        return True

    async def drop_vm(self, sbx: Sandbox, wait: bool = True) -> None:
        """Close the sandbox's channel and destroy its VM (or its hibernated state); the
        caller holds ``sbx.vm_lock`` and gives it another VM (of another domain name).
        ``wait=False``: the destroy runs in the background while the new VM comes up (the VM
        factory waits for it at shutdown)."""
        old_agent, sbx.agent = sbx.agent, None
        if old_agent is not None:
            await old_agent.close()
        # Tasks the close spawned (destroy the old domain, or remove the sandbox after a
        # protocol violation) take their first step now, binding the old names.
        await asyncio.sleep(0)
        if not self.registry.holds(sbx):
            return
        self.ctx.drop_hibernation_file(sbx.record)  # a hibernated one too
        if wait:
            await self.ctx.vms.destroy(sbx.record.domain)
        else:
            self.ctx.vms.destroy_later(sbx.record.domain)
