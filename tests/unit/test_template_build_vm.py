"""A template's build VM on the fake VM backend (``fake_backend.py``): a VM that fails before the
build script starts (nothing of the tenant's has run) is replaced once, and whatever ends the
build, no VM is left."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hypervisor import HypervisorError
from kernelhost.channel import ChannelClosed
from kernelhost.sandboxes.network.indexes import BuildIndexes
from kernelhost.sandboxes.templates.build_vm import BOOT_ATTEMPTS, build_in_vm
from kernelhost.sandboxes.templates.builds import Build, BuildFailed

from .fake_backend import House, open_house, until

pytestmark = pytest.mark.unit


async def _build(house: House, tmp_path: Path) -> tuple[Build, BaseException]:
    build = Build("bld_0123abcd", "k", "tools", "key", tmp_path / "build.log")
    indexes = BuildIndexes(house.ctx.network.host, apt_dir=tmp_path / "no-apt")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(BuildFailed) as failed:
        await build_in_vm(house.ctx, indexes, build, house.image, {"name": "tools"}, None, scratch)
    return build, failed.value


def _logged(build: Build) -> list[str]:
    return [json.loads(line).get("log", "") for line in build.log_path.read_text().splitlines()]


async def test_a_build_vm_that_fails_to_start_is_replaced_once(tmp_path: Path) -> None:
    async with open_house(tmp_path) as house:
        house.vms.fail["builder_start"] = HypervisorError("QEMU was killed")
        house.vms.fail["builder"] = ChannelClosed("the channel closed")  # the second one, too
        build, failed = await _build(house, tmp_path)
        assert isinstance(failed, BuildFailed) and failed.stage == "vm", failed
        assert "the build VM failed: the channel closed" in str(failed)
        assert any("QEMU was killed; starting another build VM" in line for line in _logged(build))
        names = {d for d in house.vms.destroyed if "build" in d}
        assert len(names) == BOOT_ATTEMPTS, house.vms.destroyed  # a new name for each VM
        assert house.vms.domains_left() == set()
        assert house.ctx.registry._reserved_mib["k"] == 0  # its memory is given back


async def test_a_build_vm_that_dies_once_the_script_runs_is_not_replaced(tmp_path: Path) -> None:
    """Once the build script runs, the VM is the tenant's: its end fails the build."""
    async with open_house(tmp_path) as house:

        async def kill_when_the_script_starts() -> None:
            await until(lambda: any("build" in d for d in house.vms.vms))
            (domain,) = [d for d in house.vms.vms if "build" in d]
            await house.vms.vms[domain].agent.wait_for_request("bash")
            await house.vms.kill(domain)

        killer = asyncio.create_task(kill_when_the_script_starts())
        build, failed = await _build(house, tmp_path)
        await killer
        assert "the build VM" in str(failed), failed
        assert not any("another build VM" in line for line in _logged(build))
        assert len({d for d in house.vms.destroyed if "build" in d}) == 1, house.vms.destroyed
        assert house.vms.domains_left() == set()
