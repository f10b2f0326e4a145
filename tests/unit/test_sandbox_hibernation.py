"""Hibernate and wake on the fake VM backend (``fake_backend.py``): the state survives, and a
hibernation or wake that fails, or a delete in the middle of one, leaves a sandbox that is
either whole or gone, never a VM or a file behind."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from hypervisor import HypervisorError
from kernelhost.sandboxes.errors import Remedy, SandboxError, SandboxNotFound, SandboxNotRunning
from kernelhost.sandboxes.states import SandboxState

from .fake_agent import WAIT
from .fake_backend import nothing_left, open_house, state_of, until

pytestmark = pytest.mark.unit


async def test_a_hibernated_sandbox_wakes_with_its_state(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vm_of(sbx.id).state["x"] = 42
        await house.hibernation.hibernate(sbx)
        path = house.ctx.hibernation_file(sbx.record)
        assert state_of(sbx) == SandboxState.HIBERNATED and sbx.agent is None and path.is_file()
        assert house.vms.domains_left() == set()
        await house.hibernation.ensure_awake(sbx)
        assert state_of(sbx) == SandboxState.RUNNING and sbx.live_agent is not None
        assert house.vm_of(sbx.id).state == {"x": 42}
        assert not path.exists()


async def test_a_wake_that_fails_keeps_the_saved_vm_for_the_next_try(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vm_of(sbx.id).state["x"] = 1
        await house.hibernation.hibernate(sbx)
        house.vms.fail["wake"] = HypervisorError("the state does not load")
        with pytest.raises(SandboxNotRunning) as caught:
            await house.hibernation.ensure_awake(sbx)
        assert caught.value.remedy == Remedy.RECREATE
        assert state_of(sbx) == SandboxState.HIBERNATED and house.vms.domains_left() == set()
        assert house.ctx.hibernation_file(sbx.record).is_file()
        await house.hibernation.ensure_awake(sbx)  # the next call wakes it
        assert house.vm_of(sbx.id).state == {"x": 1}


async def test_a_wake_cancelled_midway_leaves_no_vm_and_the_sandbox_hibernated(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        await house.hibernation.hibernate(sbx)
        house.vms.hold["wake"] = asyncio.Event()
        task = asyncio.create_task(house.hibernation.ensure_awake(sbx))
        await asyncio.wait_for(house.vms.entered["wake"].wait(), WAIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert state_of(sbx) == SandboxState.HIBERNATED and house.vms.domains_left() == set()
        assert not sbx.vm_lock.locked()
        del house.vms.hold["wake"]
        await house.hibernation.ensure_awake(sbx)
        assert state_of(sbx) == SandboxState.RUNNING


async def test_a_hibernation_that_fails_removes_the_sandbox(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vms.fail["hibernate"] = HypervisorError("disk full")
        await house.hibernation.hibernate(sbx)
        assert house.ctx.registry.find(sbx.id) is None
        assert not house.ctx.hibernation_file(sbx.record).exists()
        nothing_left(house)


async def test_a_delete_during_a_hibernation_leaves_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vms.hold["hibernate"] = asyncio.Event()
        task = asyncio.create_task(house.hibernation.hibernate(sbx))
        await asyncio.wait_for(house.vms.entered["hibernate"].wait(), WAIT)
        await house.lifecycle.remove(sbx, reason="deleted")
        house.vms.hold["hibernate"].set()
        await asyncio.wait_for(task, WAIT)
        assert not house.ctx.hibernation_file(sbx.record).exists()
        nothing_left(house)


async def test_a_delete_during_a_wake_leaves_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        await house.hibernation.hibernate(sbx)
        house.vms.hold["wake"] = asyncio.Event()
        task = asyncio.create_task(house.hibernation.ensure_awake(sbx))
        await asyncio.wait_for(house.vms.entered["wake"].wait(), WAIT)
        await house.lifecycle.remove(sbx, reason="deleted")
        house.vms.hold["wake"].set()
        with contextlib.suppress(SandboxError):
            await asyncio.wait_for(task, WAIT)
        await until(lambda: house.vms.domains_left() == set())
        assert house.ctx.registry.find(sbx.id) is None
        assert not house.ctx.hibernation_file(sbx.record).exists()
        nothing_left(house)


async def test_a_restart_of_a_hibernated_sandbox_wakes_it_first(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vm_of(sbx.id).state["x"] = 7
        await house.hibernation.hibernate(sbx)
        await house.recovery.restart(sbx)
        assert state_of(sbx) == SandboxState.RUNNING
        assert house.vm_of(sbx.id).agent.requests("restart")


async def test_a_delete_before_the_woken_vm_starts_leaves_nothing(tmp_path: Path) -> None:
    """``Lifecycle.remove`` takes no ``vm_lock``: its destroy can come before the wake's start;
    the wake then finds the sandbox gone and destroys the VM it started."""
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        await house.hibernation.hibernate(sbx)
        house.vms.hold["wake_start"] = asyncio.Event()
        task = asyncio.create_task(house.hibernation.ensure_awake(sbx))
        await asyncio.wait_for(house.vms.entered["wake_start"].wait(), WAIT)
        await house.lifecycle.remove(sbx, reason="deleted")
        house.vms.hold["wake_start"].set()
        with pytest.raises(SandboxNotFound):
            await asyncio.wait_for(task, WAIT)
        assert house.vms.domains_left() == set()
