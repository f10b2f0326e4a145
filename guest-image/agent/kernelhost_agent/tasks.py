"""Background tasks owned by the agent: kept until done, cancelled at stop, failures logged.

Nothing in the agent is fire-and-forget: every task is created through ``TaskSet.spawn``, which
keeps a reference (so the event loop cannot drop it half-way), logs the traceback of a task that
fails, and cancels and awaits whatever is still running when the agent stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from .shared import log, log_failure

__all__ = ["TaskSet"]


class TaskSet:
    """The running tasks of one agent."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failures = 0  # tasks that ended with an exception (each one logged)

    def __len__(self) -> int:
        """How many tasks are still running."""
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` in the background under ``name`` (the name appears in the log)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failures += 1
            log_failure(f"task {task.get_name()} failed:", exc)

    async def wait_all(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until every task, and those they start, is done."""
        async with asyncio.timeout(timeout):
            while self._tasks:
                await asyncio.wait(list(self._tasks))

    async def cancel_all(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait (at most ``timeout`` seconds) for them to finish."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            log(f"task {task.get_name()} did not stop within {timeout}s of being cancelled")
