"""Interrupt, kernel restart and VM replacement on the fake VM backend (``fake_backend.py``),
with a replacement that fails, is asked for twice, or meets a delete."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hypervisor import HypervisorError
from kernelhost.sandboxes.errors import AgentUnresponsive, BootFailed, SandboxNotFound
from kernelhost.sandboxes.states import Recovery, SandboxState

from .fake_agent import WAIT
from .fake_backend import nothing_left, open_house, state_of, until

pytestmark = pytest.mark.unit


async def test_an_interrupt_with_nothing_running_is_skipped(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        assert await house.recovery.interrupt(sbx) is False
        assert not house.vm_of(sbx.id).agent.requests("interrupt")


async def test_an_interrupt_the_agent_does_not_answer_is_agent_unresponsive(tmp_path: Path) -> None:
    async with open_house(tmp_path, agent_timeout=0.2) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vm_of(sbx.id).agent.replies["interrupt"] = "ignore"
        sbx.kernel = type("Busy", (), {"running": True})()
        with pytest.raises(AgentUnresponsive):
            await house.recovery.interrupt(sbx)
        sbx.kernel = None


async def test_a_restart_restarts_the_kernel_in_the_same_vm(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        domain = sbx.record.domain
        assert await house.recovery.restart(sbx) == Recovery.KERNEL_RESTARTED
        agent = house.vm_of(sbx.id).agent
        assert sbx.record.domain == domain and agent.requests("restart") and agent.requests("bash_reset")


async def test_a_restart_the_kernel_refuses_replaces_the_vm(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        old = sbx.record.domain
        house.vm_of(sbx.id).state["x"] = 1
        house.vm_of(sbx.id).agent.replies["restart"] = "error"
        assert await house.recovery.restart(sbx) == Recovery.VM_REPLACED
        assert sbx.record.domain != old and old in house.vms.destroyed
        assert state_of(sbx) == SandboxState.RUNNING and house.vm_of(sbx.id).state == {}
        assert house.vms.domains_left() == {sbx.record.domain}


async def test_a_restart_of_a_dead_vm_replaces_it(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        await house.vms.kill(sbx.record.domain)
        await until(lambda: state_of(sbx) == SandboxState.DEAD)
        assert await house.recovery.restart(sbx) == Recovery.VM_REPLACED
        assert state_of(sbx) == SandboxState.RUNNING and sbx.live_agent is not None


async def test_a_replacement_that_fails_marks_the_sandbox_dead_and_leaves_no_vm(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vms.fail["launch"] = HypervisorError("no memory")
        with pytest.raises(BootFailed):
            await house.recovery.replace_vm(sbx, "a test")
        assert state_of(sbx) == SandboxState.DEAD and "no memory" in sbx.record.detail
        assert house.vms.domains_left() == set()
        assert await house.recovery.restart(sbx) == Recovery.VM_REPLACED  # a restart brings it back


async def test_two_replacements_asked_together_are_one(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vms.hold["launch"] = asyncio.Event()
        first = asyncio.create_task(house.recovery.replace_vm(sbx, "one"))
        await asyncio.wait_for(house.vms.entered["launch"].wait(), WAIT)
        second = asyncio.create_task(house.recovery.replace_vm(sbx, "two"))
        await asyncio.sleep(0)
        house.vms.hold["launch"].set()
        assert list(await asyncio.wait_for(asyncio.gather(first, second), WAIT)) == [True, True]
        assert house.vms.domains_left() == {sbx.record.domain}


async def test_a_replacement_outlives_its_cancelled_caller(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vms.hold["launch"] = asyncio.Event()
        caller = asyncio.create_task(house.recovery.replace_vm(sbx, "a client went away"))
        await asyncio.wait_for(house.vms.entered["launch"].wait(), WAIT)
        caller.cancel()
        house.vms.hold["launch"].set()
        assert sbx.replacement is not None
        assert await asyncio.wait_for(asyncio.shield(sbx.replacement), WAIT) is True
        assert state_of(sbx) == SandboxState.RUNNING and house.vms.domains_left() == {sbx.record.domain}


async def test_a_delete_during_a_replacement_leaves_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        house.vms.hold["launch"] = asyncio.Event()
        task = asyncio.create_task(house.recovery.replace_vm(sbx, "a test"))
        await asyncio.wait_for(house.vms.entered["launch"].wait(), WAIT)
        await house.lifecycle.remove(sbx, reason="deleted")
        house.vms.hold["launch"].set()
        assert await asyncio.wait_for(task, WAIT) is False
        await until(lambda: house.vms.domains_left() == set())
        nothing_left(house)
        with pytest.raises(SandboxNotFound):
            await house.recovery.restart(sbx)
