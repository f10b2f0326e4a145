"""Automatic checkpoints (``auto_checkpoint``): the state before each call, kept so that
``undo`` can rewind the last calls. It is taken right after a call ends, in the background, as
"the state before the next call"; a call that comes before it is frozen takes it first,
synchronously. ``Checkpoints`` keeps the newest ``auto_checkpoint`` + 1 of them."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

import structlog

from ...ratelimit import TokenBucket
from ..context import Context
from ..errors import SandboxError
from ..sandbox import Sandbox
from ..store.checkpoints import CheckpointRecord

log = structlog.get_logger("kernelhost.checkpoints")


class Taker(Protocol):
    """How the automatic checkpoints take one: ``service.Checkpoints``' public two steps (freeze
    the VM, then write the checkpoint in the background)."""

    async def freeze(self, sbx: Sandbox) -> Any: ...

    async def write(
        self, sbx: Sandbox, frozen: Any, *, label: str = "", auto: bool = False, call_index: int = 0
    ) -> CheckpointRecord: ...


class AutoCheckpoints:
    def __init__(self, ctx: Context, checkpoints: Taker) -> None:
        self.ctx = ctx
        self.cps = checkpoints
        self._warned = TokenBucket(1 / 60, 5.0)  # failed automatic checkpoints logged

    async def before_call(self, sbx: Sandbox) -> None:
        """The caller holds ``sbx.lock`` and is about to run call number ``calls + 1``."""
        if not sbx.record.auto_checkpoint or not sbx.checkpoint_stale:
            return
        await self._auto(sbx)

    def after_call(self, sbx: Sandbox) -> None:
        """A call ended: the state before the next one is taken now, in the background."""
        if not sbx.record.auto_checkpoint or not self.ctx.registry.holds(sbx):
            return
        sbx.checkpoint_stale = True
        self.ctx.tasks.spawn(self._auto_after(sbx), name=f"auto-checkpoint:{sbx.id}")

    async def _auto_after(self, sbx: Sandbox) -> None:
        async with sbx.lock.hold("auto-checkpoint"):
            if not sbx.checkpoint_stale or not self.ctx.registry.holds(sbx):
                return  # a call that came first took it
            await self._auto(sbx)

    async def _auto(self, sbx: Sandbox) -> None:
        sbx.checkpoint_stale = False
        index = sbx.record.calls + 1
        try:
            frozen = await self.cps.freeze(sbx)
        except SandboxError as exc:
            self._warn(sbx, exc)
            return
        task = self.cps.write(sbx, frozen, label=f"before call {index}", auto=True, call_index=index)
        # written in the background; the call runs meanwhile
        self.ctx.tasks.spawn(self._log_failure(sbx, task), name=f"auto-checkpoint-write:{sbx.id}")

    async def _log_failure(self, sbx: Sandbox, write: Awaitable[CheckpointRecord]) -> None:
        try:
            await write
        except SandboxError as exc:
            self._warn(sbx, exc)

    def _warn(self, sbx: Sandbox, exc: SandboxError) -> None:
        if self._warned.take():
            log.warning("checkpoint.auto_failed", sandbox_id=sbx.id, error=exc.message)
