"""Checkpoint, restore, undo and branch on the fake VM backend (``fake_backend.py``), with a
freeze, a store or a load that fails, and a delete during a restore."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from hypervisor import HypervisorError
from kernelhost.sandboxes.errors import BootFailed, CheckpointNotFound, SandboxError, SandboxNotFound
from kernelhost.sandboxes.sandbox import Sandbox
from kernelhost.sandboxes.states import SandboxState

from .fake_agent import WAIT
from .fake_backend import House, nothing_left, open_house, state_of, until

pytestmark = pytest.mark.unit


async def a_call(house: House, sbx: Sandbox, x: int) -> None:
    """What a call does for its automatic checkpoint: the state before it, then a change."""
    async with sbx.lock.hold("call"):
        await house.checkpoints.auto.before_call(sbx)
        house.vm_of(sbx.id).state["x"] = x
        house.ctx.registry.update(sbx, calls=sbx.record.calls + 1)
    sbx.checkpoint_stale = True


async def test_a_restore_rewinds_the_sandbox_in_a_new_vm(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vm_of(sbx.id).state["x"] = 1
        cp = await house.checkpoints.checkpoint(sbx, "one")
        house.vm_of(sbx.id).state["x"] = 2
        old = sbx.record.domain
        await house.checkpoints.restore(sbx, cp.id)
        assert sbx.record.domain != old and state_of(sbx) == SandboxState.RUNNING
        assert house.vm_of(sbx.id).state == {"x": 1}
        await until(lambda: house.vms.domains_left() == {sbx.record.domain})


async def test_a_checkpoint_whose_freeze_fails_loses_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vms.fail["freeze"] = HypervisorError("qemu refused the save")
        with pytest.raises(BootFailed):
            await house.checkpoints.checkpoint(sbx)
        assert house.checkpoints.of(sbx) == [] and state_of(sbx) == SandboxState.RUNNING
        assert not sbx.vm_lock.locked() and not sbx.lock.locked()
        house.vms.fail["store"] = OSError("disk full")
        with pytest.raises(BootFailed):
            await house.checkpoints.checkpoint(sbx)
        assert house.checkpoints.of(sbx) == []
        await house.checkpoints.checkpoint(sbx)  # both slots were given back
        await house.checkpoints.checkpoint(sbx)
        await house.checkpoints.checkpoint(sbx)
        assert len(house.checkpoints.of(sbx)) == 3


async def test_a_restore_that_fails_to_load_marks_the_sandbox_dead(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        cp = await house.checkpoints.checkpoint(sbx)
        house.vms.fail["restore"] = HypervisorError("the state does not load")
        with pytest.raises(BootFailed):
            await house.checkpoints.restore(sbx, cp.id)
        assert state_of(sbx) == SandboxState.DEAD and "restoring checkpoint" in sbx.record.detail
        assert house.vms.domains_left() == set()
        assert [c.id for c in house.checkpoints.of(sbx)] == [cp.id]  # the checkpoint stays
        await house.checkpoints.restore(sbx, cp.id)  # and a second try brings the sandbox back
        assert state_of(sbx) == SandboxState.RUNNING


async def test_a_delete_during_a_restore_leaves_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        cp = await house.checkpoints.checkpoint(sbx)
        house.vms.hold["restore"] = asyncio.Event()
        task = asyncio.create_task(house.checkpoints.restore(sbx, cp.id))
        await asyncio.wait_for(house.vms.entered["restore"].wait(), WAIT)
        await house.lifecycle.remove(sbx, reason="deleted")
        house.vms.hold["restore"].set()
        with contextlib.suppress(SandboxError):
            await asyncio.wait_for(task, WAIT)
        await until(lambda: house.vms.domains_left() == set())
        assert house.checkpoints.of(sbx) == []  # they went with the sandbox
        nothing_left(house)


async def test_a_delete_before_the_restored_vm_starts_leaves_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        cp = await house.checkpoints.checkpoint(sbx)
        house.vms.hold["restore_start"] = asyncio.Event()
        task = asyncio.create_task(house.checkpoints.restore(sbx, cp.id))
        await asyncio.wait_for(house.vms.entered["restore_start"].wait(), WAIT)
        await house.lifecycle.remove(sbx, reason="deleted")
        house.vms.hold["restore_start"].set()  # the new VM starts after the delete
        with pytest.raises(SandboxNotFound):
            await asyncio.wait_for(task, WAIT)
        await until(lambda: house.vms.domains_left() == set())
        nothing_left(house)


async def test_a_restore_whose_caller_goes_away_still_ends(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vm_of(sbx.id).state["x"] = 1
        cp = await house.checkpoints.checkpoint(sbx)
        house.vms.hold["restore"] = asyncio.Event()
        task = asyncio.create_task(house.checkpoints.restore(sbx, cp.id))
        await asyncio.wait_for(house.vms.entered["restore"].wait(), WAIT)
        task.cancel()
        house.vms.hold["restore"].set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sbx.replacement is not None
        assert await asyncio.wait_for(asyncio.shield(sbx.replacement), WAIT) is True
        assert house.vm_of(sbx.id).state == {"x": 1} and not sbx.lock.locked()


async def test_undo_rewinds_to_before_the_last_call(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python", auto_checkpoint=2)
        for x in (1, 2, 3):
            await a_call(house, sbx, x)
        await house.checkpoints.wait_writes(sbx)
        cp = await house.checkpoints.undo(sbx, 1)
        assert cp.call_index == 3 and sbx.record.calls == 2
        assert house.vm_of(sbx.id).state == {"x": 2}
        await house.checkpoints.undo(sbx, 2)  # now calls 1 and 2 go
        assert house.vm_of(sbx.id).state == {} and sbx.record.calls == 0
        with pytest.raises(CheckpointNotFound):
            await house.checkpoints.undo(sbx, 1)  # no call left to undo


async def test_a_branch_is_a_new_sandbox_with_the_checkpoints_state(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vm_of(sbx.id).state["x"] = 9
        cp = await house.checkpoints.checkpoint(sbx)
        other = await house.checkpoints.branch("k", cp.id, 60, {})
        assert other.id != sbx.id and house.vm_of(other.id).state == {"x": 9}
        assert other.record.metadata == {"branched_from": cp.id}


async def test_a_branch_that_fails_to_load_leaves_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        cp = await house.checkpoints.checkpoint(sbx)
        house.vms.fail["restore"] = HypervisorError("the state does not load")
        with pytest.raises(BootFailed):
            await house.checkpoints.branch("k", cp.id, 60, {})
        assert [s.id for s in house.ctx.registry.owned("k")] == [sbx.id]
        assert house.vms.domains_left() == {sbx.record.domain}


async def test_a_checkpoint_of_a_hibernated_sandbox_restores(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vm_of(sbx.id).state["x"] = 6
        await house.hibernation.hibernate(sbx)
        cp = await house.checkpoints.checkpoint(sbx)
        assert state_of(sbx) == SandboxState.HIBERNATED
        await house.checkpoints.restore(sbx, cp.id)
        assert state_of(sbx) == SandboxState.RUNNING and house.vm_of(sbx.id).state == {"x": 6}
