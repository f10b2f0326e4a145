"""run_cell against the fake agent when things go wrong (``test_execution.py`` has the events and
the timeout ladder): the kernel dies, the channel is lost, the consumer goes away, a kernel floods
output while the host has stopped reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from kernelhost.channel import AgentClient
from kernelhost.sandboxes.execution import RunningCall

from .fake_agent import (
    WAIT,
    Closes,
    FakeAgent,
    raw_frame,
    wait_until_stalled,
)
from .test_execution import KernelDeaths, cell, collect, end, timeout_error, without_duration
from .test_execution import connect as connect  # the fixture: pytest finds it by its name

pytestmark = pytest.mark.unit


# -- kernel death and loss of the channel --------------------------------------------------------


async def test_injected_kernel_death_ends_the_cell(agent, connect):
    client = await connect()

    async def dies(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.iopub(request, "execute_input", {"code": "", "execution_count": 2})
        await fake.iopub(request, "stream", {"name": "stdout", "text": "partial\n"})
        await asyncio.Event().wait()

    agent.on_execute = dies
    running = RunningCall()
    gen = cell(client, "import os; os._exit(9)", running=running)
    async with contextlib.aclosing(gen):
        first = await asyncio.wait_for(anext(gen), WAIT)
        assert first == {"type": "stdout", "text": "partial\n"}
        assert running.sub is not None
        running.notify("kernel_died", exit_code=9)
        rest = without_duration(await collect(gen))
    assert rest == [
        {
            "type": "error",
            "name": "KernelDied",
            "value": "the kernel process died (exit code 9) while running this cell; it was "
            "restarted and its state is lost",
            "traceback": [],
        },
        end("kernel_died", 2, "kernel_restarted"),
    ]
    assert "interrupt" not in agent.ops()


async def test_kernel_died_event_from_the_agent_ends_the_cell(agent, connect):
    """The manager's wiring: a kernel_died event -> RunningCall.notify."""
    running = RunningCall()
    client = await connect(KernelDeaths(running))

    async def dies(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.iopub(request, "stream", {"name": "stderr", "text": "Killed\n"})
        await fake.event("kernel_died", exit_code=None)
        await fake.event("kernel_restarted", reason="died")

    agent.on_execute = dies
    events = without_duration(await collect(cell(client, running=running)))
    assert [e["type"] for e in events] == ["stderr", "error", "end"]
    assert events[1]["name"] == "KernelDied"
    assert "exit code None" in events[1]["value"]
    assert events[-1] == end("kernel_died", None, "kernel_restarted")


async def test_kernel_death_is_not_lost_when_the_queue_is_full(agent, connect):
    running = RunningCall()
    deaths = KernelDeaths(running)
    client = await connect(deaths, queue_size=2)

    async def dies(fake: FakeAgent, request: dict[str, Any]) -> None:
        for i in range(3):
            await fake.iopub(request, "stream", {"name": "stdout", "text": f"{i}\n"})
        await fake.event("kernel_died", exit_code=-9)

    agent.on_execute = dies
    gen = cell(client, running=running)
    async with contextlib.aclosing(gen):
        first = await asyncio.wait_for(anext(gen), WAIT)
        assert first == {"type": "stdout", "text": "0\n"}
        # The consumer is behind: "1" and "2" fill the queue, then the kernel dies.
        await asyncio.wait_for(deaths.seen.wait(), WAIT)
        rest = await collect(gen, timeout=1.0)
    assert rest[-2]["name"] == "KernelDied"
    assert rest[-1]["status"] == "kernel_died"


@pytest.mark.parametrize("how", ["eof", "violation"])
async def test_channel_lost_mid_cell(agent, connect, how):
    closes = Closes()
    client = await connect(closes)

    async def vanishes(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.iopub(request, "stream", {"name": "stdout", "text": "partial\n"})
        if how == "eof":
            await fake.disconnect()
        else:
            await fake.send_raw(raw_frame(b"\x91\x01"))  # not a map

    agent.on_execute = vanishes
    events = without_duration(await collect(cell(client)))
    # On EOF all output before it is delivered. A bad frame fails the decoder's whole feed(), so
    # output read in the same chunk as the bad frame may be dropped: the VM is distrusted anyway.
    expected = ["stdout", "error", "end"] if how == "eof" else ["error", "end"]
    assert [e["type"] for e in events if e["type"] != "stdout"] == ["error", "end"]
    assert [e["type"] for e in events][-len(expected) :] == expected
    assert events[-2]["name"] == "SandboxLost"
    reason, violation = await closes.wait()
    assert reason in events[-2]["value"]
    assert violation is (how == "violation")
    assert events[-1] == end("kernel_died", None)
    assert "interrupt" not in agent.ops()


async def test_cell_on_a_closed_channel(agent, connect):
    client = await connect()
    await client.close()
    events = without_duration(await collect(cell(client)))
    assert [e["type"] for e in events] == ["error", "end"]
    assert events[0]["name"] == "SandboxLost"
    assert "closed by the host" in events[0]["value"]
    assert events[-1] == end("kernel_died", None)
    assert client._subs == {}


# -- the consumer going away ---------------------------------------------------------------------


async def test_consumer_leaving_early_interrupts_the_kernel(agent, connect):
    client = await connect()

    async def long_running(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.iopub(request, "stream", {"name": "stdout", "text": "step 1\n"})
        await fake.wait_for_request("interrupt")
        await fake.iopub(request, "error", {"ename": "KeyboardInterrupt", "evalue": "", "traceback": []})
        await fake.status(request, "idle")
        await fake.execute_reply(request, "error", 1)

    agent.on_execute = long_running
    gen = cell(client)
    first = await asyncio.wait_for(anext(gen), WAIT)
    assert first == {"type": "stdout", "text": "step 1\n"}
    await asyncio.wait_for(gen.aclose(), WAIT)
    assert agent.ops().count("interrupt") == 1
    assert client._subs == {}
    assert (await client.request("ping", timeout=WAIT))["ok"]  # the channel is fine
    assert client.connected


# -- a kernel flooding output (host stops reading: backpressure) ---------------------------------


async def flooder(fake: FakeAgent, request: dict[str, Any], stop_on: str) -> None:
    """A kernel printing as fast as it can until the host sends ``stop_on``."""
    await fake.status(request, "busy")
    i = 0
    while not fake.requests(stop_on):
        await fake.iopub(request, "stream", {"name": "stdout", "text": f"{i:08d}" * 512})
        i += 1
    await fake.status(request, "idle")
    await fake.execute_reply(request, "error", 1)


async def _finish_or_close(task: asyncio.Task[Any], client: AgentClient, deadline: float) -> float:
    """Seconds ``task`` took; if it misses ``deadline``, close the channel to end it promptly."""
    t0 = time.monotonic()
    done, _ = await asyncio.wait({task}, timeout=deadline)
    took = time.monotonic() - t0
    if not done:
        await asyncio.wait_for(client.close(), WAIT)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, WAIT)
        took = float("inf")
    return took


async def test_timeout_ladder_with_a_flooding_kernel_is_prompt(agent, connect):
    client = await connect(queue_size=8, max_frame_bytes=1 << 20)
    agent.on_execute = lambda fake, request: flooder(fake, request, stop_on="restart")
    task = asyncio.ensure_future(
        collect(cell(client, timeout=0.3, interrupt_grace=0.3, restart_timeout=WAIT), timeout=60)
    )
    took = await _finish_or_close(task, client, deadline=2.0)
    assert took < 2.0, "the cell did not end within timeout + grace + slack"
    events = without_duration(task.result())
    timeout_error("was restarted", events)
    assert events[-1]["status"] == "timeout"


async def test_consumer_leaving_a_flooding_cell_is_prompt(agent, connect):
    client = await connect(queue_size=8, max_frame_bytes=1 << 20)
    agent.on_execute = lambda fake, request: flooder(fake, request, stop_on="interrupt")
    gen = cell(client)
    await asyncio.wait_for(anext(gen), WAIT)
    [flood] = agent.executions
    await wait_until_stalled(lambda: agent.frames_sent, flood)  # the host stopped reading
    closing = asyncio.ensure_future(gen.aclose())
    took = await _finish_or_close(closing, client, deadline=1.5)
    assert took < 1.5, "aclose() waited for an interrupt reply stuck behind output"
    assert "interrupt" in agent.ops()
