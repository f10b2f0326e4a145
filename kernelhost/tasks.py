"""Owned background tasks: every task the service starts has an owner that cancels and awaits it.

``TaskSet.spawn`` keeps a reference (an unreferenced task can be garbage-collected mid-run),
logs a failure with its traceback when the task ends (nothing fails silently), and ``close``
cancels every task still running and waits for them, with a deadline. ``to_thread_to_the_end``
runs a call whose effect a cleanup must see; ``IdleThread`` runs background work (a fork's spare
RAM copy) at the idle CPU priority until someone waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("kernelhost.tasks")

T = TypeVar("T")


class TaskSet:
    """The background tasks of one owner (a manager, a VM factory, a WebSocket, a tunnel set)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(
        self,
        coro: Coroutine[Any, Any, T],
        name: str | None = None,
        expected: tuple[type[BaseException], ...] = (),
    ) -> asyncio.Task[T]:
        """Run ``coro`` as a task of this owner. A failure is logged with its traceback, unless
        it is one of ``expected`` (errors the awaiting caller reports itself)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, expected))
        return task

    def _done(self, task: asyncio.Task[Any], expected: tuple[type[BaseException], ...]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, expected):
            log.error(
                "task.failed",
                owner=self.owner,
                task=task.get_name(),
                exc_info=(type(exc), exc, exc.__traceback__),
            )

    def cancel(self) -> list[asyncio.Task[Any]]:
        """Cancel every task; the ones cancelled (to await, if the caller can)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return tasks

    async def wait(self, timeout: float) -> None:
        """Let the running tasks finish (cleanups that remove VMs and files), up to ``timeout``,
        and the tasks they spawn meanwhile (a cleanup that starts another)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._tasks), timeout=left)

    async def close(self, timeout: float = 10.0) -> None:
        """Cancel every task and wait for them to end, at most ``timeout`` seconds."""
        await cancel_and_wait(list(self._tasks), timeout, self.owner)


async def cancel_and_wait(tasks: list[asyncio.Task[Any]], timeout: float, owner: str) -> None:
    """Cancel ``tasks`` and wait for them to end, at most ``timeout`` seconds; their exceptions
    are retrieved (their owners log them), and each still running then is logged, named."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in done:
        with contextlib.suppress(asyncio.CancelledError):
            task.exception()
    for task in pending:
        log.error("task.did_not_stop", owner=owner, task=task.get_name(), timeout=timeout)


async def to_thread_to_the_end(func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread`` for a call whose effect a cleanup must see (a VM being created):
    a cancellation waits for the thread to end before it goes on, so the caller's cleanup
    (destroy the domain) never runs before the domain exists. The thread always ends: the
    calls this runs have deadlines of their own."""
    future = asyncio.ensure_future(asyncio.to_thread(func, *args, **kwargs))
    cancelled = False
    while not future.done():
        try:
            await asyncio.wait([future])
        except asyncio.CancelledError:
            cancelled = True  # raised once the thread has ended
    if cancelled:
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller gets
        raise asyncio.CancelledError
    return future.result()


class IdleThread:
    """Work in a worker thread at the idle scheduling priority (``SCHED_IDLE``: it runs only on
    CPU nothing else wants), which its owner can raise back to normal once someone waits for it.

    ``await IdleThread().run(func, ...)``; ``raise_priority()`` from the event loop. Where the
    host refuses the policy the work runs at normal priority."""

    def __init__(self) -> None:
        self._tid: int | None = None
        self._raised = False

    async def run(self, func: Callable[..., T], /, *args: Any) -> T:
        return await asyncio.to_thread(self._in_thread, func, *args)

    def _in_thread(self, func: Callable[..., T], /, *args: Any) -> T:
        if not self._raised:
            _set_policy(0, os.SCHED_IDLE)
        self._tid = threading.get_native_id()  # after the policy: a raise from now on holds
        if self._raised:
            _set_policy(0, os.SCHED_OTHER)
        try:
            return func(*args)
        finally:
            self._tid = None  # the pool's thread goes on to other work at normal priority
            _set_policy(0, os.SCHED_OTHER)

    def raise_priority(self) -> None:
        """Normal priority for the rest of the work (someone waits for it)."""
        self._raised = True
        tid = self._tid
        if tid is not None:
            _set_policy(tid, os.SCHED_OTHER)


def _set_policy(tid: int, policy: int) -> None:
    with contextlib.suppress(OSError):  # no such thread any more, or the host refuses
        os.sched_setscheduler(tid, policy, os.sched_param(0))
