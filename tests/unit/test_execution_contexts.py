"""A cell in a code context (a kernel of its own beside the main one) against the fake agent:
its frames name the context, its timeout ladder acts on the context's kernel only, and the
channel's checks of what a guest says about contexts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kernelhost.channel import AgentClient, JupyterMessage, NotSupportedByAgent, ProtocolViolation
from kernelhost.channel.messages import AgentInfo, check_jupyter
from kernelhost.sandboxes.execution import RunningCall

from .cells import cell
from .fake_agent import WAIT, Closes, FakeAgent, jupyter_msg, scripted, stream
from .test_execution import collect, end, hang, timeout_error, without_duration

pytestmark = pytest.mark.unit

CONTEXT = "ctx-0123456789ab"


@pytest.fixture
async def client(agent: FakeAgent, sock_path: str) -> AsyncIterator[AgentClient]:
    """A channel to an agent that announced code contexts."""
    agent.reply_fields["hello"] = {"agent_version": 3, "capabilities": ["contexts", "bash"]}
    client = AgentClient(sock_path)
    client.add_listener(Closes())
    await client.connect(timeout=WAIT)
    await client.hello(timeout=WAIT)
    yield client
    await asyncio.wait_for(client.close(), WAIT)


async def test_a_context_cell_is_sent_to_its_kernel(agent: FakeAgent, client: AgentClient) -> None:
    agent.on_execute = scripted([stream("hi\n")])
    events = without_duration(await collect(cell(client, "print('hi')", context=CONTEXT)))
    assert events == [{"type": "stdout", "text": "hi\n"}, end("ok", 1)]
    [frame] = [f for f in agent.received if f["op"] == "jupyter"]
    assert frame["context"] == CONTEXT and frame["channel"] == "shell"


async def test_a_main_kernel_cell_names_no_context(agent: FakeAgent, client: AgentClient) -> None:
    agent.on_execute = scripted()
    await collect(cell(client))
    [frame] = [f for f in agent.received if f["op"] == "jupyter"]
    assert "context" not in frame


async def test_the_timeout_ladder_interrupts_then_restarts_the_context_not_the_main_kernel(
    agent: FakeAgent, client: AgentClient
) -> None:
    agent.on_execute = hang
    events = without_duration(
        await collect(
            cell(client, "import time; time.sleep(1e9)", context=CONTEXT, timeout=0.2, interrupt_grace=0.2)
        )
    )
    timeout_error("was restarted; variables and imports were lost", events)
    assert events[-1] == end("timeout", 1, "kernel_restarted")
    ops = [op for op in agent.ops() if op in ("interrupt", "restart", "context_interrupt", "context_restart")]
    assert ops == ["context_interrupt", "context_restart"]
    assert agent.requests("context_interrupt")[0]["context"] == CONTEXT
    assert agent.requests("context_restart")[0]["context"] == CONTEXT


async def test_a_context_the_agent_does_not_have_ends_the_cell_with_its_error(
    agent: FakeAgent, client: AgentClient
) -> None:
    async def unknown(fake: FakeAgent, request: dict[str, Any]) -> None:  # the agent's answer
        said = {"ename": "ContextNotFound", "evalue": f"no code context {CONTEXT!r}", "traceback": []}
        await fake.iopub(request, "error", said)
        await fake.status(request, "idle")
        await fake.execute_reply(request, "error", None, **said)

    agent.on_execute = unknown
    events = without_duration(await collect(cell(client, context=CONTEXT), timeout=WAIT))
    assert events[0]["name"] == "ContextNotFound" and events[-1]["status"] == "error"


async def test_an_agent_without_contexts_is_told_so_before_anything_is_sent(
    agent: FakeAgent, sock_path: str
) -> None:
    client = AgentClient(sock_path)
    await client.connect(timeout=WAIT)
    try:
        with pytest.raises(NotSupportedByAgent, match="contexts"):
            await client.send_jupyter("shell", jupyter_msg("execute_request", {}), context=CONTEXT)
        assert not [f for f in agent.received if f["op"] == "jupyter"]
    finally:
        await client.close()


def test_the_running_call_knows_its_context() -> None:
    assert RunningCall("python", CONTEXT).context == CONTEXT and RunningCall().context is None


def test_a_guest_frame_names_its_context_or_is_cut_off() -> None:
    frame = {"op": "jupyter", "channel": "iopub", "msg": jupyter_msg("status", {"execution_state": "idle"})}
    assert check_jupyter(frame).context is None
    assert check_jupyter({**frame, "context": CONTEXT}).context == CONTEXT
    for bad in (5, "", "x" * 65, ["ctx"]):
        with pytest.raises(ProtocolViolation, match="context"):
            check_jupyter({**frame, "context": bad})
    assert isinstance(check_jupyter(frame), JupyterMessage)


def test_hello_lists_the_guests_kernels_and_drops_nonsense() -> None:
    info = AgentInfo.from_hello(
        {
            "capabilities": ["contexts"],
            "kernels": [
                {"name": "python3", "language": "Python"},
                {"name": "ir", "language": "R"},
                {"name": 7, "language": "r"},
                {"name": "x" * 65, "language": "r"},
                "nonsense",
            ]
            + [{"name": f"k{i}", "language": "python"} for i in range(40)],
        }
    )
    assert info.kernels[:2] == (("python3", "python"), ("ir", "r"))
    assert len(info.kernels) == 32 - 3  # the first 32 entries are read; three were nonsense
    assert AgentInfo.from_hello({}).kernels == ()
