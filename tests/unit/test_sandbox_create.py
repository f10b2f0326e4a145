"""A sandbox comes to life on the fake VM backend (``fake_backend.py``): a launch or a pooled VM
handed over, and what is left when that fails or the caller goes away (nothing); a lost VM;
delete; reconcile at service start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hypervisor import HypervisorError, LibvirtUnavailable
from kernelhost.channel import ChannelClosed
from kernelhost.sandboxes.errors import AgentUnresponsive, BackendUnavailable, BootFailed, SandboxNotFound
from kernelhost.sandboxes.network import parse_network
from kernelhost.sandboxes.sandbox import Sandbox
from kernelhost.sandboxes.states import SandboxState

from .fake_agent import WAIT
from .fake_backend import nothing_left, open_house, state_of, until

pytestmark = pytest.mark.unit


async def test_a_create_launches_a_vm_and_the_sandbox_runs(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        assert state_of(sbx) == SandboxState.RUNNING and sbx.live_agent is not None
        assert house.vms.domains_left() == {sbx.record.domain}
        # the key's id: its CPU partition (hypervisor/cgroups.py)
        meta = {"sandbox": sbx.id, "template": "python", "key": "k"}
        assert house.vms.vms[sbx.record.domain].meta == meta
        assert house.ctx.registry.store.get(sbx.id) is not None


async def test_a_pooled_vm_is_handed_over_and_labelled(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        clone = await house.vms.add_clone("python", house.image)
        sbx = await house.lifecycle.create("k", "python")
        assert sbx.record.domain == clone.domain and sbx.agent is clone.agent
        await until(lambda: clone.domain in house.vms.labels)
        # handed to the key: its metadata and its CPU partition from now on
        assert house.vms.labels[clone.domain] == {"sandbox": sbx.id, "template": "python", "key": "k"}


async def test_a_pooled_vm_of_an_older_image_is_discarded_and_a_vm_launched(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        clone = await house.vms.add_clone("python", house.image)
        clone.image_key = "older"
        sbx = await house.lifecycle.create("k", "python")
        assert sbx.record.domain != clone.domain
        await until(lambda: clone.domain in house.vms.destroyed)


@pytest.mark.parametrize(
    ("exc", "mapped"),
    [
        (HypervisorError("qemu died"), BootFailed),
        (ChannelClosed("no hello"), BootFailed),
        (TimeoutError(), BootFailed),
        (LibvirtUnavailable("qemu:///system", "libvirtd is away"), BackendUnavailable),
    ],
)
async def test_a_failed_launch_leaves_nothing_and_is_mapped(
    tmp_path: Path, exc: BaseException, mapped: type[Exception]
) -> None:
    async with open_house(tmp_path, max_sandboxes_per_key=1) as house:
        house.vms.fail["launch"] = exc
        with pytest.raises(mapped):
            await house.lifecycle.create("k", "python")
        nothing_left(house)
        await house.lifecycle.create("k", "python")  # the failed one's reservation was given back


async def test_a_create_cancelled_mid_launch_leaves_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        house.vms.hold["launch"] = asyncio.Event()
        task = asyncio.create_task(house.lifecycle.create("k", "python"))
        await asyncio.wait_for(house.vms.entered["launch"].wait(), WAIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        nothing_left(house)


async def test_a_hand_over_whose_network_set_up_fails_leaves_nothing(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        clone = await house.vms.add_clone("python", house.image)
        house.vms.vms[clone.domain].agent.replies["net_config"] = "error"
        network = parse_network({"mode": "allowlist", "allow": ["pypi.org"]})
        with pytest.raises(AgentUnresponsive):
            await house.lifecycle.create("k", "python", network=network)
        nothing_left(house)


async def test_a_vm_that_dies_marks_its_sandbox_dead_and_is_destroyed(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        domain = sbx.record.domain
        await house.vms.kill(domain)
        await until(lambda: state_of(sbx) == SandboxState.DEAD)
        assert "the VM stopped" in sbx.record.detail
        await until(lambda: domain in house.vms.destroyed)


async def test_delete_is_idempotent(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        sbx = await house.lifecycle.create("k", "python")
        await asyncio.gather(house.lifecycle.remove(sbx, "a"), house.lifecycle.remove(sbx, "b"))
        await house.lifecycle.remove(sbx, "again")
        assert house.vms.destroyed.count(sbx.record.domain) == 1
        nothing_left(house)
        with pytest.raises(SandboxNotFound):
            await house.lifecycle.delete("k", sbx.id)


async def test_reconcile_reattaches_known_vms_and_destroys_strays(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        kept = await house.lifecycle.create("k", "python")
        gone = await house.lifecycle.create("k", "python")
        stray = await house.vms.add_clone("other", house.image)
        await house.vms.kill(gone.record.domain)
        await until(lambda: gone.state == SandboxState.DEAD)
        # a service restart: the registry is empty again, the store and the VMs are not
        for sbx in (kept, gone):
            house.ctx.registry.pop(sbx)  # its record stays in the store
        await house.lifecycle.reconcile()
        again = house.ctx.registry.find(kept.id)
        assert isinstance(again, Sandbox) and again.live_agent is not None
        assert house.ctx.registry.find(gone.id) is None
        assert house.vms.domains_left() == {kept.record.domain}
        assert stray.domain in house.vms.destroyed


async def test_reconcile_with_the_backend_away_is_backend_unavailable(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:

        async def away() -> set[str]:
            raise LibvirtUnavailable("qemu:///system", "libvirtd is away")

        house.vms.running_domains = away  # type: ignore[method-assign]
        with pytest.raises(BackendUnavailable):
            await house.lifecycle.reconcile()
