"""A key at its limit: creates wait their turn in the key's queue (``Registry.admit``) on the fake
VM backend, and are refused only when the queue is full or the wait ends without room."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from kernelhost.sandboxes.errors import CapacityExceeded
from kernelhost.sandboxes.registry import ADMITTED, MAX_WAIT, Admitted
from kernelhost.sandboxes.sandbox import Sandbox

from .fake_backend import House, open_house, until

pytestmark = pytest.mark.unit

ONE: dict[str, Any] = {"max_sandboxes_per_key": 1, "create_queue_seconds": 20.0, "create_queue_length": 2}


async def _create(house: House) -> tuple[Sandbox, Admitted | None]:
    sbx = await house.lifecycle.create("k", "python")
    return sbx, ADMITTED.get()


def _waiting(house: House, n: int) -> Any:
    return lambda: len(house.ctx.registry._queues.get("k", ())) == n


async def test_a_create_over_the_limit_waits_for_room_and_gets_it(tmp_path: Path) -> None:
    async with open_house(tmp_path, **ONE) as house:
        first = await house.lifecycle.create("k", "python")
        second = asyncio.create_task(_create(house))
        await until(_waiting(house, 1))
        assert not second.done()
        await house.lifecycle.delete("k", first.id)
        sbx, admitted = await asyncio.wait_for(second, 10)
        assert admitted is not None and admitted.position == 1 and admitted.waited > 0, admitted
        assert house.ctx.registry._queues == {} and sbx.record.owner == "k"


async def test_waiting_creates_are_admitted_in_the_order_they_came(tmp_path: Path) -> None:
    async with open_house(tmp_path, **ONE) as house:
        first = await house.lifecycle.create("k", "python")
        second = asyncio.create_task(_create(house))
        await until(_waiting(house, 1))
        third = asyncio.create_task(_create(house))
        await until(_waiting(house, 2))
        await house.lifecycle.delete("k", first.id)
        sbx2, admitted2 = await asyncio.wait_for(second, 10)
        assert admitted2 is not None and admitted2.position == 1
        await asyncio.sleep(0.3)
        assert not third.done()  # the one key's limit: one sandbox
        await house.lifecycle.delete("k", sbx2.id)
        _, admitted3 = await asyncio.wait_for(third, 10)
        assert admitted3 is not None and admitted3.position == 2


async def test_a_full_queue_is_refused_at_once_with_when_to_come_back(tmp_path: Path) -> None:
    async with open_house(tmp_path, **{**ONE, "create_queue_length": 1}) as house:
        await house.lifecycle.create("k", "python")
        waiting = asyncio.create_task(_create(house))
        await until(_waiting(house, 1))
        t0 = time.monotonic()
        with pytest.raises(CapacityExceeded) as refused:
            await house.lifecycle.create("k", "python")
        assert time.monotonic() - t0 < 1.0
        assert "the most that may (create_queue_length)" in refused.value.message
        details: dict[str, Any] = refused.value.details
        assert details["queue_length"] == 1 and details["retry_after"] >= 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert house.ctx.registry._queues == {}  # a caller that went away left its place


async def test_a_wait_that_ends_without_room_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path, **{**ONE, "create_queue_seconds": 0.5}) as house:
        await house.lifecycle.create("k", "python")
        t0 = time.monotonic()
        with pytest.raises(CapacityExceeded) as refused:
            await house.lifecycle.create("k", "python")
        assert 0.4 < time.monotonic() - t0 < 5
        assert "max_sandboxes_per_key" in refused.value.message and "waited 0.5 s" in refused.value.message
        assert house.ctx.registry._queues == {} and len(house.vms.domains_left()) == 1


async def test_the_caller_may_ask_not_to_wait(tmp_path: Path) -> None:
    async with open_house(tmp_path, **ONE) as house:
        await house.lifecycle.create("k", "python")
        MAX_WAIT.set(0.0)
        t0 = time.monotonic()
        with pytest.raises(CapacityExceeded, match="max_sandboxes_per_key"):
            await house.lifecycle.create("k", "python")
        assert time.monotonic() - t0 < 1.0


async def test_another_keys_queue_does_not_hold_a_key_with_room(tmp_path: Path) -> None:
    async with open_house(tmp_path, **ONE) as house:
        await house.lifecycle.create("k", "python")
        waiting = asyncio.create_task(_create(house))
        await until(_waiting(house, 1))
        other = await asyncio.wait_for(house.lifecycle.create("other", "python"), 10)
        assert other.record.owner == "other" and not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting


async def test_a_call_no_wait_could_admit_is_refused_at_once_not_queued(tmp_path: Path) -> None:
    """A fork of more sandboxes than the key may ever hold, or a key whose limit is 0, is told so
    at once: waiting in line for room that can never come would only delay the same 429."""
    async with open_house(tmp_path, **ONE) as house:
        started = time.monotonic()
        with pytest.raises(CapacityExceeded, match="max_sandboxes_per_key"):
            async with house.ctx.registry.admit("k", 2, 256):
                pass
        with pytest.raises(CapacityExceeded, match="max_memory_mib_per_key"):
            async with house.ctx.registry.admit("k", 1, 10**9):
                pass
        assert time.monotonic() - started < 2, "queued for room that can never come"
        assert house.ctx.registry._queues == {}
        first = await house.lifecycle.create("k", "python")
        waiting = asyncio.create_task(_create(house))  # in line for the one sandbox's room
        await until(_waiting(house, 1))
        started = time.monotonic()
        with pytest.raises(CapacityExceeded, match="max_sandboxes_per_key"):
            async with house.ctx.registry.admit("k", 2, 256):  # behind it, and never to fit
                pass
        assert time.monotonic() - started < 2 and len(house.ctx.registry._queues["k"]) == 1
        await house.lifecycle.delete("k", first.id)
        await asyncio.wait_for(waiting, 10)
