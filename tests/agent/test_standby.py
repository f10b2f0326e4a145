"""The standby kernel: a restart swaps it in (a fresh kernel of this sandbox, at once), and the
next standby is started behind it; the guest's OOM killer takes the standby first, and a
standby that died is not swapped in."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kernelhost.channel import protocol

from .conftest import Running
from .host import WAIT, HostEnd

pytestmark = pytest.mark.unit


async def ready_standby(running: Running) -> int:
    """The pid of the agent's standby kernel, once it answers."""
    kernel = running.agent.kernel
    assert await kernel.until_standby(3 * WAIT), "no standby kernel became ready"
    assert kernel.standby is not None
    pid = getattr(kernel.standby.km.provisioner, "pid", None)
    assert isinstance(pid, int)
    return pid


async def restart(host: HostEnd) -> None:
    await host.ok(protocol.Op.RESTART, timeout=3 * WAIT)
    event = await asyncio.wait_for(host.events.get(), WAIT)
    assert event == {"op": "event", "event": "kernel_restarted", "reason": "requested"}


async def test_a_restart_swaps_in_the_standby(host: HostEnd, running: Running) -> None:
    standby_pid = await ready_standby(running)
    old_pid = running.agent.kernel.pid()
    await host.execute("kept = 1")
    await restart(host)
    assert running.agent.kernel.pid() == standby_pid
    # the next standby waits (kernel.STANDBY_AFTER_SWAP): the calls after a restart come first
    assert running.agent.kernel.standby is None
    run = await host.execute("'kept' in globals()")
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "False"
    assert run.reply["content"]["execution_count"] == 1  # as in a new kernel
    await asyncio.sleep(0.2)
    assert old_pid is not None
    assert not await asyncio.to_thread(_alive, old_pid), "the replaced kernel still runs"
    # the relay follows the new kernel's sockets: output, errors, stdin's absence, iopub status
    err = await host.execute("print('out'); raise ValueError('x')")
    assert err.stream() == "out\n" and err.reply["content"]["ename"] == "ValueError"
    # ...and a next standby is started behind it, a process of its own
    assert await ready_standby(running) not in (standby_pid, old_pid)
    assert host.strays() == []


async def test_a_restart_while_the_standby_starts_waits_for_it(host: HostEnd, running: Running) -> None:
    await ready_standby(running)
    await restart(host)  # swaps it in; the next one starts kernel.STANDBY_AFTER_SWAP later
    kernel = running.agent.kernel
    deadline = time.monotonic() + 3 * WAIT
    while kernel.standby is None:
        assert time.monotonic() < deadline, "no next standby was started"
        await asyncio.sleep(0.01)
    starting = kernel.standby
    assert not starting.ready.is_set(), "the next standby answered before the restart was sent"
    await restart(host)
    # the starting standby was waited for and promoted: no third Python started beside it
    assert kernel.pid() == getattr(starting.km.provisioner, "pid", None)
    run = await host.execute("6 * 7")
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "42"


async def test_the_promoted_standby_gets_the_environment_set_since(host: HostEnd, running: Running) -> None:
    await ready_standby(running)
    env = {"HTTP_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    await host.ok(protocol.Op.NET_CONFIG, mode="outbound", env=env)
    try:
        await restart(host)
        run = await host.execute(
            "import os; print(os.environ.get('HTTP_PROXY'), os.environ.get('https_proxy'))"
        )
        assert run.stream() == "http://127.0.0.1:9 http://127.0.0.1:9\n"
        await ready_standby(running)
        await host.ok(protocol.Op.NET_CONFIG, mode="none")
        await restart(host)  # and what was unset since is unset in it
        run = await host.execute("import os; print(os.environ.get('HTTP_PROXY'))")
        assert run.stream() == "None\n"
    finally:
        await host.ok(protocol.Op.NET_CONFIG, mode="none")


async def test_the_oom_killer_takes_the_standby_first_and_a_dead_one_is_not_swapped_in(
    host: HostEnd, running: Running
) -> None:
    kernel = running.agent.kernel
    standby_pid = await ready_standby(running)
    assert _oom_score_adj(standby_pid) == 1000
    await restart(host)  # promoted: an ordinary process again
    assert kernel.pid() == standby_pid and _oom_score_adj(standby_pid) == 0

    dead = await ready_standby(running)
    os.kill(dead, signal.SIGKILL)  # as the OOM killer would
    await asyncio.sleep(0.5)
    await host.execute("kept = 1")
    await restart(host)  # the slow way: a new process, not the dead standby
    assert kernel.pid() not in (None, dead, standby_pid)
    run = await host.execute("'kept' in globals()")
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "False"
    assert kernel.standby is None  # the next one starts behind the restart...
    assert await ready_standby(running) not in (dead, standby_pid)  # ...a process of its own
    assert host.strays() == []


def _oom_score_adj(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
