"""Owned tasks and threads whose effects a cleanup must see; an owner's wait covers the
cleanups its tasks start while it waits, and ends at its deadline whatever still runs."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from kernelhost.tasks import IdleThread, TaskSet, to_thread_to_the_end

pytestmark = pytest.mark.unit


def _make(made: threading.Event, seconds: float) -> str:
    time.sleep(seconds)  # a libvirt call creating a domain
    made.set()
    return "domain"


async def test_a_cancelled_caller_goes_on_only_once_the_thread_has_ended() -> None:
    made = threading.Event()
    task = asyncio.create_task(to_thread_to_the_end(_make, made, 0.3))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()  # a second cancellation does not cut the wait short either
    with pytest.raises(asyncio.CancelledError):
        await task
    assert made.is_set()  # so the cleanup after the cancellation finds the domain to destroy


async def test_the_result_and_the_error_come_through() -> None:
    assert await to_thread_to_the_end(_make, threading.Event(), 0.0) == "domain"

    def fail() -> None:
        raise ValueError("no such image")

    with pytest.raises(ValueError, match="no such image"):
        await to_thread_to_the_end(fail)


async def test_a_cancelled_call_that_failed_still_reports_a_cancellation() -> None:
    started = threading.Event()

    def fail_later() -> None:
        started.set()
        time.sleep(0.2)
        raise ValueError("late")

    task = asyncio.create_task(to_thread_to_the_end(fail_later))
    assert await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_wait_also_waits_for_tasks_spawned_meanwhile() -> None:
    tasks = TaskSet("test")
    done: list[str] = []

    async def cleanup() -> None:
        await asyncio.sleep(0.1)
        done.append("cleanup")

    async def first() -> None:
        await asyncio.sleep(0.05)
        tasks.spawn(cleanup(), name="cleanup")  # started after the wait began
        done.append("first")

    tasks.spawn(first(), name="first")
    await tasks.wait(5)
    assert done == ["first", "cleanup"] and len(tasks) == 0


async def test_wait_ends_at_its_deadline() -> None:
    tasks = TaskSet("test")
    stuck = tasks.spawn(asyncio.sleep(30), name="stuck")
    t0 = time.monotonic()
    await tasks.wait(0.2)
    assert time.monotonic() - t0 < 5 and not stuck.done()
    await tasks.close()
    assert stuck.cancelled()


async def test_an_idle_thread_runs_at_the_idle_priority_until_raised() -> None:
    go = threading.Event()

    def policies() -> list[int]:
        first = os.sched_getscheduler(0)
        assert go.wait(10)
        return [first, os.sched_getscheduler(0)]

    idle = IdleThread()
    running = asyncio.create_task(idle.run(policies))
    await asyncio.sleep(0.2)
    idle.raise_priority()  # someone waits for it now
    go.set()
    assert await running == [os.SCHED_IDLE, os.SCHED_OTHER]
    assert await idle.run(os.sched_getscheduler, 0) == os.SCHED_OTHER  # raised for good
    fresh = IdleThread()
    assert await fresh.run(os.sched_getscheduler, 0) == os.SCHED_IDLE
    assert await asyncio.to_thread(os.sched_getscheduler, 0) == os.SCHED_OTHER  # the pool's threads
