"""The warm pool's refill (``pool.WarmPool``) with a fake clone maker: the first fill at once, a
refill after a hand-out only once the handed-out sandbox has had ``refill_delay`` to itself."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kernelhost.sandboxes.vm.pool import Clone, WarmPool

pytestmark = pytest.mark.unit


class _Agent:
    connected = True
    closed_reason = None


async def test_a_refill_after_a_hand_out_waits_for_the_delay() -> None:
    made: list[float] = []
    one_more = asyncio.Event()

    async def make(template: str) -> Clone:
        made.append(time.monotonic())
        one_more.set()  # the refill puts it in the pool in this same step
        return Clone(f"kh-{len(made)}", _Agent(), "key")  # type: ignore[arg-type]

    async def discard(clone: Clone) -> Any:
        return None

    pool = WarmPool(1, make, discard, refill_delay=0.3)
    pool.start("python")
    try:
        await asyncio.wait_for(one_more.wait(), 5)
        one_more.clear()
        assert len(made) == 1 and pool.ready("python") == 1  # the first fill did not wait
        taken_at = time.monotonic()
        clone = pool.take("python")
        assert clone is not None and clone.domain == "kh-1" and pool.ready("python") == 0
        await asyncio.wait_for(one_more.wait(), 5)
        assert pool.ready("python") == 1
        assert made[1] - taken_at >= 0.3  # the refill waited for the delay
        assert pool.take("python") is not None and pool.hits == 2 and pool.misses == 0
    finally:
        await pool.close()


async def test_close_ends_a_refill_that_lost_its_cancellation() -> None:
    """``asyncio.wait_for`` before Python 3.12 returns an inner result that came as it was
    cancelled: a clone made as the service stops is returned to the refill as if no stop had
    come. The pool's close still ends (it hung forever, leaking the pooled VMs) and discards it."""
    started, discarded = asyncio.Event(), []

    async def make(template: str) -> Clone:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # the lost cancellation: the clone is made all the same
        return Clone("kh-late", _Agent(), "key")  # type: ignore[arg-type]

    async def discard(clone: Clone) -> Any:
        discarded.append(clone.domain)

    pool = WarmPool(1, make, discard, refill_delay=0.0)
    pool.start("python")
    await asyncio.wait_for(started.wait(), 5)
    closing = asyncio.ensure_future(pool.close())
    done, _ = await asyncio.wait({closing}, timeout=5)  # not wait_for: it would end it itself
    assert done == {closing}, "the pool's close hung on the refill"
    assert discarded == ["kh-late"] and pool.ready("python") == 0


async def test_stop_ends_a_full_pools_refill_and_discards_its_clones() -> None:
    discarded: list[str] = []
    made = asyncio.Event()

    async def make(template: str) -> Clone:
        made.set()
        return Clone("kh-1", _Agent(), "key")  # type: ignore[arg-type]

    async def discard(clone: Clone) -> Any:
        discarded.append(clone.domain)

    pool = WarmPool(1, make, discard, refill_delay=0.0)
    pool.start("python")
    await asyncio.wait_for(made.wait(), 5)
    await asyncio.sleep(0)
    stopping = asyncio.ensure_future(pool.stop("python"))
    done, _ = await asyncio.wait({stopping}, timeout=5)
    assert done == {stopping}
    assert discarded == ["kh-1"] and pool.ready("python") == 0
    await pool.close()
