"""A template's build VM's agent (``kh.build`` on the kernel command line): no Jupyter kernel is
started, ``hello`` answers at once, and what a build needs (bash commands, files, the network
mode) works without one."""

from __future__ import annotations

from pathlib import Path

import pytest
from kernelhost_agent.config import build_vm

from kernelhost.channel import protocol

from .conftest import running_agent
from .test_bash import bash

pytestmark = pytest.mark.unit


def test_the_kernel_command_line_names_a_build_vm(tmp_path: Path) -> None:
    cmdline = tmp_path / "cmdline"
    cmdline.write_text("console=ttyS0 kh.upper_size=25% kh.build quiet\n")
    assert build_vm(str(cmdline))
    cmdline.write_text("console=ttyS0 kh.builder=1 kh.upper_size=25%\n")
    assert not build_vm(str(cmdline))
    assert not build_vm(str(tmp_path / "missing"))


async def test_a_build_vms_agent_starts_no_kernel_and_runs_commands(tmp_path: Path) -> None:
    async with running_agent(tmp_path, start_kernel=False) as running:
        host = running.host
        hello = await host.ok(protocol.Op.HELLO)
        assert hello["kernel_info"] == {}, hello
        assert protocol.Capability.BASH in hello["capabilities"], hello
        assert not running.agent.kernel.km.has_kernel, "a kernel process was started"
        ping = await host.ok(protocol.Op.PING)
        assert ping["ready"] is False and ping["kernel_alive"] is False, ping
        run = await bash(host, "echo built > out.txt; cat out.txt; echo $HTTP_PROXY")
        assert run.reply["exit_code"] == 0 and run.streams["stdout"].startswith("built\n"), run
        env = {"HTTP_PROXY": "http://127.0.0.1:9"}
        await host.ok(protocol.Op.NET_CONFIG, mode="allowlist", env=env, pip={})
        run = await bash(host, "echo $HTTP_PROXY")
        assert run.streams["stdout"] == "http://127.0.0.1:9\n", run
        await host.ok(protocol.Op.NET_CONFIG, mode="none")
