"""Fork on the fake VM backend (``fake_backend.py``): children hold the parent's state, and a
parent that dies mid-fork, a child that fails to start or a caller that goes away leave no
child behind."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hypervisor import HypervisorError
from kernelhost.sandboxes.errors import BootFailed, CapacityExceeded, InvalidRequest, SandboxNotRunning
from kernelhost.sandboxes.states import SandboxState

from .fake_agent import WAIT
from .fake_backend import House, open_house, state_of, until

pytestmark = pytest.mark.unit


def only_the_parent_is_left(house: House, parent_id: str) -> None:
    assert [s.id for s in house.ctx.registry.owned("k")] == [parent_id]
    assert [r.id for r in house.ctx.registry.store.all()] == [parent_id]


async def test_children_hold_the_parents_state(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        parent = await house.lifecycle.create("k", "python", metadata={"a": "b"})
        house.vm_of(parent.id).state["x"] = 3
        kids = await house.forker.fork("k", parent.id, 2)
        assert len(kids) == 2 and state_of(parent) == SandboxState.RUNNING
        for kid in kids:
            assert state_of(kid) == SandboxState.RUNNING and kid.live_agent is not None
            assert house.vm_of(kid.id).state == {"x": 3}
            assert kid.record.metadata == {"a": "b", "forked_from": parent.id}
        house.vm_of(kids[0].id).state["x"] = 4  # copies, not one state
        assert house.vm_of(kids[1].id).state == {"x": 3}


async def test_a_hibernated_parent_is_woken_and_forked(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        parent = await house.lifecycle.create("k", "python")
        house.vm_of(parent.id).state["x"] = 5
        await house.hibernation.hibernate(parent)
        (kid,) = await house.forker.fork("k", parent.id, 1)
        assert state_of(parent) == SandboxState.RUNNING and house.vm_of(kid.id).state == {"x": 5}


async def test_a_parent_that_dies_mid_fork_leaves_no_child(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        parent = await house.lifecycle.create("k", "python")
        house.vms.hold["fork"] = asyncio.Event()
        task = asyncio.create_task(house.forker.fork("k", parent.id, 3))
        await asyncio.wait_for(house.vms.entered["fork"].wait(), WAIT)
        await house.vms.kill(parent.record.domain)
        house.vms.hold["fork"].set()
        with pytest.raises(BootFailed, match="fork of"):
            await asyncio.wait_for(task, WAIT)
        await until(lambda: state_of(parent) == SandboxState.DEAD)
        only_the_parent_is_left(house, parent.id)
        assert house.vms.domains_left() == set()


async def test_a_child_that_fails_to_start_takes_its_siblings_with_it(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        parent = await house.lifecycle.create("k", "python")
        house.vms.fail["fork_child"] = HypervisorError("no memory for a child")
        with pytest.raises(BootFailed):
            await house.forker.fork("k", parent.id, 2)
        only_the_parent_is_left(house, parent.id)
        assert house.vms.domains_left() == {parent.record.domain}
        assert len(await house.forker.fork("k", parent.id, 2)) == 2  # the reservation was given back


async def test_a_fork_cancelled_midway_leaves_no_child(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        parent = await house.lifecycle.create("k", "python")
        house.vms.hold["fork_child"] = asyncio.Event()
        task = asyncio.create_task(house.forker.fork("k", parent.id, 2))
        await asyncio.wait_for(house.vms.entered["fork_child"].wait(), WAIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        only_the_parent_is_left(house, parent.id)
        assert house.vms.domains_left() == {parent.record.domain}
        assert not parent.vm_lock.locked() and not parent.lock.locked()


async def test_a_fork_of_a_dead_sandbox_is_refused(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        parent = await house.lifecycle.create("k", "python")
        await house.vms.kill(parent.record.domain)
        await until(lambda: state_of(parent) == SandboxState.DEAD)
        with pytest.raises(SandboxNotRunning):
            await house.forker.fork("k", parent.id, 1)
        only_the_parent_is_left(house, parent.id)


async def test_a_fork_counts_against_the_keys_limits(tmp_path: Path) -> None:
    async with open_house(tmp_path, max_sandboxes_per_key=2) as house:
        parent = await house.lifecycle.create("k", "python")
        with pytest.raises(CapacityExceeded):
            await house.forker.fork("k", parent.id, 2)
        with pytest.raises(InvalidRequest):
            await house.forker.fork("k", parent.id, 0)
        only_the_parent_is_left(house, parent.id)
