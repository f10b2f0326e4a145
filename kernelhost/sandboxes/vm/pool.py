"""Warm pool: ready clones per template, so a create is a hand-over, not a boot.

Each template keeps up to ``size`` clones running, attached and already through clone hygiene
(clock set, entropy added, RNGs reseeded). ``take`` pops one without waiting; a background task
per template refills the pool one clone at a time. A pooled clone whose channel closes is
dropped and destroyed.

A refill that a hand-out asked for starts ``REFILL_DELAY`` seconds later: the sandbox just handed
out is about to run its first call, and a clone being made (a QEMU started, a snapshot loaded, a
kernel warmed) takes a core: made at once, it slows that first call (bench/results/vm-mechanics.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

from hypervisor import HypervisorError

from ...channel import AgentClient, ChannelError
from ...tasks import TaskSet, cancel_and_wait

log = structlog.get_logger("kernelhost.pool")


@dataclass(eq=False)
class Clone:
    domain: str
    agent: AgentClient
    image_key: str


REFILL_DELAY = 1.0
STOP_TIMEOUT = 30.0  # a refill's own cleanup (a half-made clone destroyed) within this

MakeClone = Callable[[str], Awaitable[Clone]]
Discard = Callable[[Clone], Coroutine[Any, Any, None]]


class WarmPool:
    def __init__(
        self, size: int, make: MakeClone, discard: Discard, refill_delay: float = REFILL_DELAY
    ) -> None:
        self.size = size
        self.refill_delay = refill_delay
        self._make = make
        self._discard = discard
        self._ready: dict[str, list[Clone]] = {}
        self._wanted: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.hits = 0
        self.misses = 0
        self._discards = TaskSet("pool")

    def ready(self, template: str) -> int:
        return len(self._ready.get(template, []))

    def start(self, template: str) -> None:
        """Keep this template's pool filled (idempotent)."""
        if self.size <= 0 or template in self._tasks:
            return
        self._ready.setdefault(template, [])
        self._wanted[template] = asyncio.Event()
        self._tasks[template] = asyncio.create_task(self._refill(template), name=f"pool-refill:{template}")

    async def stop(self, template: str) -> None:
        """Stop keeping this template's pool and destroy its clones (a template deleted)."""
        task = self._tasks.pop(template, None)
        wanted = self._wanted.pop(template, None)
        if task is not None:
            await self._end([task], wanted)
        for clone in self._ready.pop(template, []):
            await self._discard(clone)

    async def _end(self, tasks: list[asyncio.Task[None]], *wanted: asyncio.Event | None) -> None:
        """Cancel refill tasks and wait (bounded) for them to end. A refill no longer in
        ``_tasks`` stops at its next step even if the cancellation is lost (``asyncio.wait_for``
        before Python 3.12 returns an inner result that came as it was cancelled, seen under
        load): its wait for demand is woken, and a clone it made meanwhile is discarded."""
        for event in wanted:
            if event is not None:
                event.set()
        await cancel_and_wait(tasks, STOP_TIMEOUT, "pool")

    def _keeps(self, template: str) -> bool:
        """Whether the running refill of ``template`` is still wanted (not stopped or closed)."""
        return self._tasks.get(template) is asyncio.current_task()

    def take(self, template: str) -> Clone | None:
        ready = self._ready.get(template)
        clone = None
        while ready:
            candidate = ready.pop(0)
            if candidate.agent.connected:
                clone = candidate
                break
            self._drop(candidate)
        if clone is None:
            self.misses += 1
        else:
            self.hits += 1
        if template in self._wanted:
            self._wanted[template].set()
        return clone

    async def _refill(self, template: str) -> None:
        failures = 0
        while self._keeps(template):
            ready = self._ready[template]
            for lost in [c for c in ready if not c.agent.connected]:
                ready.remove(lost)
                self._drop(lost)
            if len(ready) >= self.size:
                self._wanted[template].clear()
                await self._wanted[template].wait()
                await asyncio.sleep(self.refill_delay)  # the handed-out sandbox's first call first
                continue
            try:
                clone = await self._make(template)
            except Exception as exc:  # keep the pool alive; back off and retry
                failures += 1
                expected = isinstance(exc, HypervisorError | ChannelError | TimeoutError)
                log.warning(
                    "pool.refill_failed",
                    template=template,
                    error=str(exc),
                    failures=failures,
                    exc_info=not expected,
                )
                await asyncio.sleep(min(60.0, 0.5 * 2 ** min(failures, 7)))
                continue
            failures = 0
            if not self._keeps(template):  # stopped while it was made: a lost cancellation
                await self._discard(clone)
                return
            ready.append(clone)

    def _drop(self, clone: Clone) -> None:
        """A pooled clone whose channel closed: its VM goes too."""
        log.warning("pool.clone_lost", domain=clone.domain, reason=clone.agent.closed_reason)
        self._discards.spawn(self._discard(clone), name=f"discard:{clone.domain}")

    async def close(self) -> None:
        """Stop refilling and destroy every pooled clone."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await self._end(tasks, *self._wanted.values())
        for clones in self._ready.values():
            while clones:
                await self._discard(clones.pop())
        await self._discards.wait(timeout=30.0)
