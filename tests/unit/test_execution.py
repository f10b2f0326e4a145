"""run_cell against the fake agent: events, statuses, the timeout ladder (kernel death, loss of
the channel, a consumer leaving and a flooding kernel: ``test_execution_failures.py``).

The fake agent plays the kernel's part of the Jupyter protocol for each execute_request (iopub
status/execute_input/outputs, shell execute_reply) and records the requests run_cell sends
(``interrupt``, ``restart``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from kernelhost.channel import AgentClient, ChannelListener, Subscription
from kernelhost.sandboxes.execution import RunningCall

from .cells import cell as run
from .fake_agent import (
    WAIT,
    Closes,
    FakeAgent,
    display_data,
    error,
    execute_result,
    jupyter_msg,
    scripted,
    stream,
)

pytestmark = pytest.mark.unit

SESSION = "session-1"


@pytest.fixture
async def connect(sock_path):
    """``await connect(**kwargs) -> client``; every client is closed at teardown."""
    clients: list[AgentClient] = []

    async def make(listener: ChannelListener | None = None, **kwargs: Any) -> AgentClient:
        client = AgentClient(sock_path, **kwargs)
        client.add_listener(listener or Closes())
        clients.append(client)
        await client.connect(timeout=WAIT)
        return client

    yield make
    for client in clients:
        await asyncio.wait_for(client.close(), WAIT)


def cell(
    client: AgentClient,
    code: str = "1 + 1",
    *,
    timeout: float | None = None,
    interrupt_grace: float = WAIT,
    **kwargs: Any,
) -> AsyncGenerator[dict[str, Any], None]:
    return run(client, code, session=SESSION, timeout=timeout, interrupt_grace=interrupt_grace, **kwargs)


class KernelDeaths(ChannelListener):
    """The manager's wiring: a kernel_died event notifies the running call."""

    def __init__(self, running: RunningCall) -> None:
        self.running = running
        self.seen = asyncio.Event()

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "kernel_died":
            self.running.notify("kernel_died", exit_code=event.get("exit_code"))
        self.seen.set()


async def collect(gen: AsyncGenerator[dict[str, Any], None], timeout: float = WAIT) -> list[dict[str, Any]]:
    async def drain() -> list[dict[str, Any]]:
        async with contextlib.aclosing(gen):
            return [event async for event in gen]

    return await asyncio.wait_for(drain(), timeout)


def without_duration(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    end = events[-1]
    assert end["type"] == "end"
    assert isinstance(end["duration_ms"], float) and end["duration_ms"] >= 0
    return [{k: v for k, v in e.items() if k != "duration_ms"} for e in events]


def end(status: str, count: int | None, recovery: str | None = None, **extra: Any) -> dict[str, Any]:
    event = {"type": "end", "status": status, "execution_count": count, "output_truncated": False, **extra}
    if recovery is not None:
        event["recovery"] = recovery
    return event


def timeout_error(value_part: str, events: list[dict[str, Any]]) -> None:
    assert any(
        e["type"] == "error" and e["name"] == "TimeoutError" and value_part in e["value"] for e in events
    ), events


async def hang(agent: FakeAgent, request: dict[str, Any]) -> None:
    """A kernel that starts the cell and never finishes it (the fake cancels this at stop)."""
    await agent.status(request, "busy")
    await agent.iopub(request, "execute_input", {"code": "", "execution_count": 1})
    await asyncio.Event().wait()


# -- events --------------------------------------------------------------------------------------


async def test_events_in_order_with_content(agent, connect):
    client = await connect()
    agent.on_execute = scripted(
        [
            stream("hello\n"),
            stream(["warn", "ing\n"], "stderr"),  # list text is joined
            execute_result({"text/plain": "42"}, count=7, metadata={"m": 1}),
            display_data({"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}),
            ("clear_output", {"wait": True}),
            ("comm_open", {"comm_id": "c1", "target_name": "t", "data": {}}),  # unknown: ignored
            ("update_display_data", {"data": {}, "metadata": {}, "transient": {}}),  # ignored
            stream("bye\n"),
        ],
        execution_count=7,
    )

    events = without_duration(await collect(cell(client, "print('hello')")))
    assert events == [
        {"type": "stdout", "text": "hello\n"},
        {"type": "stderr", "text": "warning\n"},
        {"type": "result", "data": {"text/plain": "42"}, "metadata": {"m": 1}, "is_main_result": True},
        {
            "type": "result",
            "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"},
            "metadata": {},
            "is_main_result": False,
        },
        {"type": "clear_output", "wait": True},
        {"type": "stdout", "text": "bye\n"},
        end("ok", 7),
    ]
    request = await agent.wait_for_execute()
    assert request["header"]["session"] == SESSION
    assert request["content"]["code"] == "print('hello')"
    assert request["content"]["silent"] is False
    assert request["content"]["allow_stdin"] is False
    [frame] = [f for f in agent.received if f["op"] == "jupyter"]
    assert frame["channel"] == "shell"
    assert client._subs == {}  # the subscription is gone after the cell
    assert "interrupt" not in agent.ops()


async def test_error_cell(agent, connect):
    client = await connect()
    agent.on_execute = scripted(
        [
            stream("before\n"),
            error("ZeroDivisionError", "division by zero", ["Traceback", "  1/0", "ZeroDivisionError"]),
        ],
        status="error",
        execution_count=3,
    )
    events = without_duration(await collect(cell(client, "1/0")))
    assert events == [
        {"type": "stdout", "text": "before\n"},
        {
            "type": "error",
            "name": "ZeroDivisionError",
            "value": "division by zero",
            "traceback": ["Traceback", "  1/0", "ZeroDivisionError"],
        },
        end("error", 3),
    ]


@pytest.mark.parametrize(
    ("input_count", "reply_count", "expected"),
    [
        (5, 9, 9),  # the reply wins
        (5, "9", 5),  # a reply count that is not an int is not used
        (5, None, 5),
    ],
)
async def test_execution_count_comes_from_the_reply(agent, connect, input_count, reply_count, expected):
    client = await connect()

    async def kernel(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.iopub(request, "execute_input", {"code": "", "execution_count": input_count})
        await fake.status(request, "idle")
        await fake.execute_reply(request, "ok", reply_count)

    agent.on_execute = kernel
    events = without_duration(await collect(cell(client)))
    assert events == [end("ok", expected)]


async def test_cell_waits_for_both_reply_and_idle(agent, connect):
    client = await connect()

    async def kernel(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.execute_reply(request, "ok", 2)
        await fake.iopub(request, "stream", {"name": "stdout", "text": "after the reply\n"})
        await fake.status(request, "idle")

    agent.on_execute = kernel
    events = without_duration(await collect(cell(client)))
    assert events == [{"type": "stdout", "text": "after the reply\n"}, end("ok", 2)]


async def test_messages_of_other_requests_are_not_events(agent, connect):
    client = await connect()

    async def kernel(fake: FakeAgent, request: dict[str, Any]) -> None:
        other = {"msg_id": "someone-else", "msg_type": "execute_request"}
        await fake.status(request, "busy")
        await fake.emit("iopub", jupyter_msg("stream", {"name": "stdout", "text": "nope"}, other))
        await fake.emit("iopub", jupyter_msg("status", {"execution_state": "idle"}, other))
        await fake.iopub(request, "stream", {"name": "stdout", "text": "mine"})
        await fake.status(request, "idle")
        await fake.execute_reply(request, "ok", 1)

    agent.on_execute = kernel
    events = without_duration(await collect(cell(client)))
    assert events == [{"type": "stdout", "text": "mine"}, end("ok", 1)]


async def test_the_running_call_holds_the_cells_subscription(agent, connect):
    client = await connect()
    seen: list[Subscription | None] = []

    async def kernel(fake: FakeAgent, request: dict[str, Any]) -> None:
        seen.append(running.sub)
        await fake.run_execute(request)

    agent.on_execute = kernel
    running = RunningCall()
    await collect(cell(client, running=running))
    [sub] = seen
    assert isinstance(sub, Subscription)
    request = await agent.wait_for_execute()
    assert sub.msg_id == request["header"]["msg_id"] == running.run_id
    assert running.sub is None  # gone with the cell


# -- timeouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("interrupt_reply", ["ok", "error"])
async def test_timeout_interrupts_the_kernel(agent, connect, interrupt_reply):
    client = await connect()
    agent.replies["interrupt"] = interrupt_reply

    async def interruptible(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.iopub(request, "execute_input", {"code": "", "execution_count": 4})
        await fake.wait_for_request("interrupt")
        await fake.iopub(
            request, "error", {"ename": "KeyboardInterrupt", "evalue": "", "traceback": ["KeyboardInterrupt"]}
        )
        await fake.status(request, "idle")
        await fake.execute_reply(request, "error", 4)

    agent.on_execute = interruptible
    t0 = time.monotonic()
    events = without_duration(await collect(cell(client, "while True: pass", timeout=0.2)))
    assert time.monotonic() - t0 >= 0.19
    # one error: the timeout, carrying the KeyboardInterrupt's traceback (where it stopped)
    assert events == [
        {
            "type": "error",
            "name": "TimeoutError",
            "value": "execution exceeded its timeout of 0.2s; the kernel was interrupted "
            "(KeyboardInterrupt); its state is kept",
            "traceback": ["KeyboardInterrupt"],
        },
        end("timeout", 4, "interrupted"),
    ]
    assert agent.ops().count("interrupt") == 1
    assert "restart" not in agent.ops()


@pytest.mark.parametrize("restart_reply", ["ok", "error", "ignore"])
async def test_kernel_ignoring_the_interrupt_is_restarted(agent, connect, restart_reply):
    client = await connect()
    agent.on_execute = hang
    agent.replies["restart"] = restart_reply
    t0 = time.monotonic()
    events = await collect(
        cell(client, "import time; time.sleep(1e9)", timeout=0.2, interrupt_grace=0.2, restart_timeout=0.3)
    )
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.39
    events = without_duration(events)
    assert [e["type"] for e in events] == ["error", "end"]
    if restart_reply == "ok":
        timeout_error("was restarted; variables and imports were lost", events)
        assert events[-1] == end("timeout", 1, "kernel_restarted")
    else:  # no manager to replace the VM in this test: the failure is said, not hidden
        timeout_error("could not be stopped and replacing the VM failed", events)
        assert events[-1] == end("timeout", 1, "failed")
    ops = [op for op in agent.ops() if op in ("interrupt", "ping", "restart")]
    assert ops == ["interrupt", "ping", "restart"]
    interrupt, restart = agent.requests("interrupt")[0], agent.requests("restart")[0]
    assert agent.received.index(interrupt) < agent.received.index(restart)


async def test_no_timeout_means_no_interrupt(agent, connect):
    client = await connect()
    release = asyncio.Event()

    async def slow(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await asyncio.wait_for(release.wait(), WAIT)
        await fake.run_execute(request, [stream("done\n")])

    agent.on_execute = slow
    gen = cell(client, timeout=None)
    task = asyncio.ensure_future(collect(gen))
    await agent.wait_for_execute()
    release.set()
    events = without_duration(await asyncio.wait_for(task, WAIT))
    assert events[-2:] == [{"type": "stdout", "text": "done\n"}, end("ok", 1)]
    assert "interrupt" not in agent.ops()
