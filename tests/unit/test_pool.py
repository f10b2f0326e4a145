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
