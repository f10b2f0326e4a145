"""run_cell against the fake agent: output and result caps, usage figures, bash calls, every
rung of the timeout ladder, loss of the VM, host notices, a consumer leaving."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from kernelhost.channel import AgentClient
from kernelhost.sandboxes.execution import Result, RunningCall

from .cells import cell
from .fake_agent import (
    WAIT,
    FakeAgent,
    Handler,
    error,
    jupyter_msg,
    scripted,
    stream,
)

pytestmark = pytest.mark.unit


@pytest.fixture
async def client(sock_path, agent):
    c = AgentClient(sock_path)
    await c.connect(timeout=WAIT)
    yield c
    await asyncio.wait_for(c.close(), WAIT)


def call(client: AgentClient, code: str = "1", **kwargs: Any) -> AsyncGenerator[dict[str, Any], None]:
    kwargs.setdefault("timeout", None)
    kwargs.setdefault("interrupt_grace", WAIT)
    return cell(client, code, session="session", **kwargs)


async def collect(gen: AsyncGenerator[dict[str, Any], None], timeout: float = WAIT) -> list[dict[str, Any]]:
    async def drain() -> list[dict[str, Any]]:
        async with contextlib.aclosing(gen):
            return [event async for event in gen]

    return await asyncio.wait_for(drain(), timeout)


def texts(events: list[dict[str, Any]], kind: str = "stdout") -> str:
    return "".join(e["text"] for e in events if e["type"] == kind)


class Replacer:
    """A ``replace_vm`` stand-in that records its calls."""

    def __init__(self, outcome: bool | Exception = True) -> None:
        self.outcome = outcome
        self.reasons: list[str] = []

    async def __call__(self, reason: str) -> bool:
        self.reasons.append(reason)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


async def hang(agent: FakeAgent, request: dict[str, Any]) -> None:
    await agent.status(request, "busy")
    await asyncio.Event().wait()


# -- output and result caps ------------------------------------------------------------------------


async def test_output_is_cut_at_the_cap_with_one_visible_marker(agent, client):
    agent.on_execute = scripted([stream("a" * 600), stream("b" * 600, "stderr"), stream("c" * 600)])
    events = await collect(call(client, max_output_bytes=1000))
    request = await agent.wait_for_execute()
    assert request["metadata"]["kernelhost"]["max_output_bytes"] == 1000
    kept = texts(events) + texts(events, "stderr")
    assert kept.startswith("a" * 600 + "b" * 400)
    assert kept.count("output truncated") == 1 and "max_output_bytes" in kept
    assert "c" * 10 not in kept
    assert events[-1]["output_truncated"] is True and events[-1]["status"] == "ok"


async def test_cut_never_splits_a_character(agent, client):
    agent.on_execute = scripted([stream("é" * 10)])  # 2 bytes each
    events = await collect(call(client, max_output_bytes=5))
    assert texts(events).startswith("éé\n[kernelhost: output truncated")


async def test_result_over_the_cap_loses_its_largest_formats_with_a_marker(agent, client):
    agent.on_execute = scripted(
        [
            (
                "display_data",
                {
                    "data": {"text/plain": "<Figure>", "image/png": "A" * 5000, "text/html": "<b>small</b>"},
                    "metadata": {"m": 1},
                },
            ),
            (
                "display_data",
                {"data": {"text/plain": "ok", "application/octet-stream": b"raw"}, "metadata": {}},
            ),
        ]
    )
    events = await collect(call(client, max_result_bytes=1000))
    big, raw = [e for e in events if e["type"] == "result"]
    assert set(big["data"]) == {"text/plain", "text/html"} and big["truncated"] is True
    assert big["data"]["text/plain"].startswith("<Figure>\n[kernelhost: image/png dropped")
    assert big["metadata"] == {"m": 1}
    assert set(raw["data"]) == {"text/plain"}  # bytes are not JSON: dropped, and said so
    assert "application/octet-stream" in raw["data"]["text/plain"]


# -- usage figures and kernel replies --------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ({"cpu_ms": 12.5, "peak_memory_bytes": 4096}, {"cpu_ms": 12.5, "peak_memory_bytes": 4096}),
        ({"cpu_ms": float("nan"), "peak_memory_bytes": -1}, {}),
        ({"cpu_ms": "fast", "peak_memory_bytes": True}, {}),
        ("not a map", {}),
    ],
)
async def test_usage_figures_are_passed_on_only_when_sane(agent, client, sent, kept):
    async def kernel(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.status(request, "idle")
        await fake.emit(
            "shell",
            jupyter_msg(
                "execute_reply",
                {"status": "ok", "execution_count": 1},
                request["header"],
                metadata={"kernelhost": sent},
            ),
        )

    agent.on_execute = kernel
    end = (await collect(call(client)))[-1]
    assert {k: end[k] for k in ("cpu_ms", "peak_memory_bytes") if k in end} == kept
    assert end["duration_ms"] >= 0


async def test_input_error_says_why_and_what_to_do(agent, client):
    agent.on_execute = scripted(
        [
            error(
                "StdinNotImplementedError",
                "raw_input was called, but this frontend does not support input requests.",
                [],
            )
        ],
        status="error",
    )
    events = await collect(call(client, "input()"))
    [err] = [e for e in events if e["type"] == "error"]
    assert "without a terminal" in err["value"] and "files.write" in err["value"]


async def test_an_aborted_request_is_an_error_not_silence(agent, client):
    agent.on_execute = scripted(status="aborted")
    events = await collect(call(client))
    assert [e["type"] for e in events] == ["error", "end"]
    assert events[0]["name"] == "Aborted" and events[-1]["status"] == "error"


# -- bash --------------------------------------------------------------------------------------------


def bash_runner(outputs: list[tuple[str, str]], content: dict[str, Any], *, ends: bool = True) -> Handler:
    async def handler(fake: FakeAgent, frame: dict[str, Any]) -> None:
        await fake.reply(frame, pid=123)
        parent = {"msg_id": frame["run_id"], "msg_type": "bash_request"}
        for name, text in outputs:
            await fake.emit("iopub", jupyter_msg("stream", {"name": name, "text": text}, parent))
        if ends:
            await fake.emit("shell", jupyter_msg("bash_reply", content, parent))

    return handler


async def test_bash_streams_and_reports_exit_code_and_usage(agent, client):
    agent.replies["bash"] = bash_runner(
        [("stdout", "one\n"), ("stderr", "warn\n")],
        {"exit_code": 2, "signal": None, "cpu_ms": 3.5, "peak_memory_bytes": 2048},
    )
    events = await collect(call(client, "ls /nope", language="bash", max_output_bytes=100))
    [request] = agent.requests("bash")
    assert request["command"] == "ls /nope" and request["max_output_bytes"] == 100
    assert [e["type"] for e in events] == ["stdout", "stderr", "error", "end"]
    assert events[2]["name"] == "CommandFailed" and "code 2" in events[2]["value"]
    end = events[-1]
    assert (end["status"], end["exit_code"], end["execution_count"]) == ("error", 2, None)
    assert end["cpu_ms"] == 3.5 and end["peak_memory_bytes"] == 2048


async def test_bash_success_has_no_error(agent, client):
    agent.replies["bash"] = bash_runner([("stdout", "hi\n")], {"exit_code": 0, "signal": None})
    events = await collect(call(client, "echo hi", language="bash"))
    assert [e["type"] for e in events] == ["stdout", "end"]
    assert events[-1]["status"] == "ok" and events[-1]["exit_code"] == 0


async def test_bash_on_an_image_without_it_says_to_rebuild(agent, client):
    # an agent whose hello announces no bash capability: the host does not even try
    agent.reply_fields["hello"] = {"agent_version": 2, "capabilities": ["files"]}
    await client.hello(timeout=WAIT)
    events = await collect(call(client, "echo", language="bash"))
    assert events[0]["name"] == "BashUnavailable" and "make image" in events[0]["value"]
    assert events[-1]["status"] == "error"
    assert not agent.requests("bash")


async def test_a_failing_bash_start_is_an_error_event(agent, client):
    agent.replies["bash"] = "error"
    events = await collect(call(client, "echo", language="bash"))
    assert events[0]["name"] == "BashUnavailable"
    assert "could not start the command" in events[0]["value"]


async def test_bash_timeout_interrupts_then_kills(agent, client):
    agent.replies["bash"] = bash_runner([("stdout", "started\n")], {}, ends=False)
    agent.replies["bash_signal"] = "ok"  # acknowledged, but the command never ends
    events = await collect(
        call(client, "trap '' INT; sleep 1e9", language="bash", timeout=0.2, interrupt_grace=0.2),
        timeout=WAIT,
    )
    signals = [f["signal"] for f in agent.requests("bash_signal")]
    assert signals == ["INT", "KILL"]
    assert [op for op in agent.ops() if op in ("bash_signal", "ping")] == [
        "bash_signal",
        "ping",
        "bash_signal",
    ]
    [err] = [e for e in events if e["type"] == "error"]
    assert err["name"] == "TimeoutError" and "killed" in err["value"]
    assert events[-1]["status"] == "timeout" and events[-1]["recovery"] == "killed"


async def test_bash_interrupted_at_the_timeout_reports_one_timeout_error(agent, client):
    async def runner(fake: FakeAgent, frame: dict[str, Any]) -> None:
        await fake.reply(frame)
        await fake.wait_for_request("bash_signal")
        parent = {"msg_id": frame["run_id"]}
        await fake.emit("shell", jupyter_msg("bash_reply", {"exit_code": 130, "signal": 2}, parent))

    agent.replies["bash"] = runner
    events = await collect(call(client, "sleep 1e9", language="bash", timeout=0.2))
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["name"] == "TimeoutError"
    assert "SIGINT" in errors[0]["value"]
    assert events[-1]["recovery"] == "interrupted" and events[-1]["exit_code"] == 130


# -- the ladder's last rung and the loss of the VM -------------------------------------------------


async def test_unanswered_ping_gets_the_sandbox_a_new_vm(agent, client):
    agent.on_execute = hang
    agent.replies["ping"] = "ignore"
    agent.replies["interrupt"] = "ignore"
    replace = Replacer()
    t0 = time.monotonic()
    events = await collect(
        call(client, timeout=0.2, interrupt_grace=0.2, agent_timeout=0.3, replace_vm=replace)
    )
    assert time.monotonic() - t0 < 3
    assert len(replace.reasons) == 1 and "did not answer" in replace.reasons[0]
    assert "restart" not in agent.ops()
    [err] = [e for e in events if e["type"] == "error"]
    assert "fresh VM" in err["value"] and events[-1]["recovery"] == "vm_replaced"


async def test_failed_kernel_restart_falls_back_to_a_new_vm(agent, client):
    agent.on_execute = hang
    agent.replies["restart"] = "error"
    replace = Replacer()
    events = await collect(call(client, timeout=0.2, interrupt_grace=0.2, replace_vm=replace))
    assert replace.reasons == ["stopping the code failed"]
    assert events[-1]["recovery"] == "vm_replaced"


async def test_failed_replacement_is_reported(agent, client):
    agent.on_execute = hang
    agent.replies["ping"] = "ignore"
    events = await collect(
        call(
            client,
            timeout=0.2,
            interrupt_grace=0.2,
            agent_timeout=0.2,
            replace_vm=Replacer(RuntimeError("no capacity")),
        )
    )
    [err] = [e for e in events if e["type"] == "error"]
    assert "replacing the VM failed" in err["value"]
    assert events[-1]["recovery"] == "failed"


@pytest.mark.parametrize("replaced", [True, False])
async def test_lost_channel_mid_call_gets_a_new_vm(agent, client, replaced):
    async def vanishes(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.disconnect()

    agent.on_execute = vanishes
    replace = Replacer(replaced)
    events = await collect(call(client, replace_vm=replace))
    [err] = [e for e in events if e["type"] == "error"]
    assert err["name"] == "SandboxLost" and len(replace.reasons) == 1
    if replaced:
        assert "fresh VM" in err["value"] and events[-1]["recovery"] == "vm_replaced"
    else:  # the sandbox is going away (deleted): nothing was replaced, nothing is claimed
        assert "create a new sandbox" in err["value"] and "recovery" not in events[-1]
    assert events[-1]["status"] == "kernel_died"


# -- notices from the host: interrupt and restart requests ----------------------------------------


async def test_restart_notice_ends_the_running_call(agent, client):
    agent.on_execute = hang
    running = RunningCall()
    gen = call(client, running=running)
    task = asyncio.ensure_future(collect(gen))
    await agent.wait_for_execute()
    await asyncio.sleep(0.05)
    assert running.sub is not None and running.language == "python"
    running.notify("restarted")
    events = await asyncio.wait_for(task, WAIT)
    assert events[-2]["name"] == "KernelRestarted"
    assert events[-1]["status"] == "restarted" and running.sub is None


async def test_requested_interrupt_gives_status_interrupted(agent, client):
    running = RunningCall()

    async def interrupted(fake: FakeAgent, request: dict[str, Any]) -> None:
        running.interrupt_requested = True  # what SandboxManager.interrupt does
        await fake.run_execute(request, [error("KeyboardInterrupt", "", ["..."])], status="error")

    agent.on_execute = interrupted
    events = await collect(call(client, running=running))
    assert events[-2]["name"] == "KeyboardInterrupt" and events[-1]["status"] == "interrupted"


async def test_code_that_swallows_the_interrupt_still_reports_the_timeout(agent, client):
    async def stubborn(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.wait_for_request("interrupt")
        await fake.status(request, "idle")
        await fake.execute_reply(request, "ok", 1)

    agent.on_execute = stubborn
    events = await collect(call(client, timeout=0.2))
    assert [e["type"] for e in events] == ["error", "end"]
    assert events[0]["name"] == "TimeoutError" and events[-1]["status"] == "timeout"


# -- the consumer leaving --------------------------------------------------------------------------


async def test_consumer_leaving_waits_until_the_kernel_is_idle(agent, client):
    finished_at: list[float] = []

    async def slow_to_stop(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.iopub(request, "stream", {"name": "stdout", "text": "working\n"})
        await fake.wait_for_request("interrupt")
        await asyncio.sleep(0.3)  # the KeyboardInterrupt takes a while to unwind
        await fake.status(request, "idle")
        await fake.execute_reply(request, "error", 1)
        finished_at.append(time.monotonic())

    agent.on_execute = slow_to_stop
    gen = call(client)
    assert (await asyncio.wait_for(anext(gen), WAIT))["text"] == "working\n"
    await asyncio.wait_for(gen.aclose(), WAIT)
    assert finished_at and finished_at[0] <= time.monotonic()  # the call ended before aclose did
    assert client._subs == {} and "restart" not in agent.ops()


async def test_consumer_leaving_a_kernel_that_will_not_stop_restarts_it(agent, client):
    async def spins(fake: FakeAgent, request: dict[str, Any]) -> None:
        await fake.status(request, "busy")
        await fake.iopub(request, "stream", {"name": "stdout", "text": "spin\n"})
        await asyncio.Event().wait()

    agent.on_execute = spins
    gen = call(client, interrupt_grace=0.2)
    await asyncio.wait_for(anext(gen), WAIT)
    await asyncio.wait_for(gen.aclose(), WAIT)
    assert [op for op in agent.ops() if op in ("interrupt", "ping", "restart")] == [
        "interrupt",
        "ping",
        "restart",
    ]


def test_update_display_data_is_an_update_event_and_caps_keep_its_id() -> None:
    from kernelhost.channel.messages import JupyterMessage
    from kernelhost.sandboxes.execution.calls import iopub_event
    from kernelhost.sandboxes.execution.output import OutputBudget, OutputLimits

    def msg(kind: str, content: dict[str, Any]) -> JupyterMessage:
        return JupyterMessage(
            "iopub",
            {
                "header": {"msg_type": kind},
                "parent_header": {},
                "metadata": {},
                "content": content,
                "buffers": [],
            },
        )

    shown = iopub_event(msg("display_data", {"data": {"text/plain": "0"}, "transient": {"display_id": "d1"}}))
    update = iopub_event(
        msg("update_display_data", {"data": {"text/plain": "1"}, "transient": {"display_id": "d1"}})
    )
    assert shown is not None and shown.wire() == {
        "type": "result",
        "is_main_result": False,
        "display_id": "d1",
        "data": {"text/plain": "0"},
        "metadata": {},
    }
    assert update is not None and update.wire()["type"] == "update_display"
    assert update.wire()["display_id"] == "d1"
    assert iopub_event(msg("update_display_data", {"data": {"text/plain": "1"}})) is None  # of nothing
    assert isinstance(update, Result)
    big = Result({"text/plain": "1", "text/html": "x" * 100}, display_id="d1", update=True)
    capped = OutputBudget(OutputLimits(1024, 64)).result(big)
    assert capped.update and capped.display_id == "d1" and capped.truncated
