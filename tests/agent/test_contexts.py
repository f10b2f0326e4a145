"""Code contexts: kernels of their own beside the main one (``kernelhost_agent/contexts.py``)."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from kernelhost_agent.kernel import wait_process

from kernelhost.channel import protocol

from .conftest import KERNEL_NAME, START_TIMEOUT, Running, running_agent
from .host import WAIT, Execution, HostEnd

pytestmark = pytest.mark.unit

Start = Callable[..., Awaitable[dict[str, Any]]]


@pytest.fixture
async def start(host: HostEnd) -> AsyncIterator[Start]:
    """Start a context (``fields``: those of context_start); every one is stopped after the
    test, so the module's agent stays under its cap."""
    started: list[str] = []

    async def start_context(**fields: Any) -> dict[str, Any]:
        reply = await host.ok(protocol.Op.CONTEXT_START, timeout=START_TIMEOUT, **fields)
        started.append(reply["context"])
        return reply

    yield start_context
    for context in started:
        await host.request(protocol.Op.CONTEXT_STOP, context=context)


def value(run: Execution) -> str:
    """The text/plain of a cell's result, or the ename of its error."""
    if run.reply["content"]["status"] != "ok":
        return str(run.reply["content"]["ename"])
    [result] = run.of_type("execute_result")
    return str(result["content"]["data"]["text/plain"])


def drain(host: HostEnd) -> None:
    """Forget the events earlier tests left."""
    while not host.events.empty():
        host.events.get_nowait()


async def next_event(host: HostEnd, timeout: float = START_TIMEOUT) -> dict[str, Any]:
    return await asyncio.wait_for(host.events.get(), timeout)


async def test_hello_lists_the_installed_kernelspecs(host: HostEnd) -> None:
    reply = await host.ok(protocol.Op.HELLO)
    # the test's kernelspec, and ipykernel's own python3 that jupyter_client always finds
    # the main kernel's first, as the one to pick for its language
    assert reply["kernels"][0] == {"name": KERNEL_NAME, "language": "python"}
    assert {"name": "python3", "language": "python"} in reply["kernels"]
    assert protocol.Capability.CONTEXTS in reply["capabilities"]


async def test_a_context_of_a_named_kernelspec(host: HostEnd, start: Start) -> None:
    reply = await start(kernel="python3")
    assert (reply["kernel"], reply["language"]) == ("python3", "python")
    run = await host.execute("import sys; print(sys.argv[0])", context=reply["context"])
    assert run.stream().strip().endswith("ipykernel_launcher.py")  # not the main kernel's argv


async def test_contexts_have_their_own_variables(host: HostEnd, running: Running, start: Start) -> None:
    a, b = await start(), await start()
    for reply in (a, b):  # the defaults: the main kernel's kernelspec and directory
        assert re.fullmatch(r"ctx-[0-9a-f]{12}", reply["context"]), reply
        assert (reply["kernel"], reply["language"]) == (KERNEL_NAME, "python")
        assert reply["cwd"] == running.config.kernel_cwd
    assert a["context"] != b["context"]
    await host.execute("x = 'main'")
    await host.execute("x = 'a'; only_a = 1", context=a["context"])
    await host.execute("x = 'b'", context=b["context"])
    assert value(await host.execute("x", context=a["context"])) == "'a'"
    assert value(await host.execute("x", context=b["context"])) == "'b'"
    assert value(await host.execute("x")) == "'main'"
    assert value(await host.execute("only_a", context=b["context"])) == "NameError"
    assert value(await host.execute("only_a")) == "NameError"
    await host.execute("del x")
    listed = (await host.ok(protocol.Op.CONTEXT_LIST))["contexts"]
    assert [c["context"] for c in listed] == [a["context"], b["context"]]
    assert listed[0] == {k: a[k] for k in ("context", "kernel", "language", "cwd", "default")}
    assert a["default"] is False


async def test_the_default_mark_is_kept_and_listed(host: HostEnd, start: Start) -> None:
    """The host marks a language's default context; the mark lives with the guest (a fork's
    child, or a host that re-attached, finds the same context by it)."""
    marked, plain = await start(default=True), await start(default="yes")  # only true marks
    listed = {c["context"]: c["default"] for c in (await host.ok(protocol.Op.CONTEXT_LIST))["contexts"]}
    assert listed == {marked["context"]: True, plain["context"]: False}


async def test_the_frames_of_a_context_carry_its_id(host: HostEnd, start: Start) -> None:
    context = (await start())["context"]
    # ASCII output takes the relay's raw path (streamwire), other text the parsed one: both
    # are tagged (one cell each: a cell's prints arrive as one stream message)
    for code, out in (("print('ascii'); 1 + 1", "ascii\n"), ("print('é'); 1 + 1", "é\n")):
        run = await host.execute(code, context=context)
        assert run.stream() == out and value(run) == "2"
        for msg in [*run.iopub, run.reply]:
            assert host.context_of[msg["header"]["msg_id"]] == context, msg["header"]["msg_type"]
        main = await host.execute(code)
        assert {host.context_of[m["header"]["msg_id"]] for m in [*main.iopub, main.reply]} == {None}


async def test_a_contexts_cwd_is_honoured_and_created(host: HostEnd, running: Running, start: Start) -> None:
    cwd = running.root / "projects" / "deep"
    assert not cwd.exists()
    reply = await start(cwd=str(cwd))
    assert reply["cwd"] == str(cwd) and cwd.is_dir()
    run = await host.execute("import os; os.getcwd()", context=reply["context"])
    assert value(run) == repr(str(cwd))
    assert value(await host.execute("import os; os.getcwd()")) == repr(running.config.kernel_cwd)


async def test_restart_clears_one_context_and_leaves_the_other(host: HostEnd, start: Start) -> None:
    a, b = (await start())["context"], (await start())["context"]
    await host.execute("y = 1", context=a)
    await host.execute("y = 2", context=b)
    drain(host)
    reply = await host.ok(protocol.Op.CONTEXT_RESTART, timeout=START_TIMEOUT, context=a)
    assert reply["kernel_info"]["language_info"]["name"] == "python"
    event = await next_event(host)
    assert event == {"op": "event", "event": "kernel_restarted", "reason": "requested", "context": a}
    assert value(await host.execute("y", context=a)) == "NameError"
    assert value(await host.execute("y", context=b)) == "2"


async def test_interrupt_stops_that_context_only(host: HostEnd, start: Start) -> None:
    a, b = (await start())["context"], (await start())["context"]
    sleeper = await host.start("import time; print('asleep', flush=True); time.sleep(60)", context=a)
    while True:  # the cell runs: an interrupt now reaches it
        _, msg = await host.next_message(sleeper)
        if msg["header"]["msg_type"] == "stream":
            break
    slow = "import time; time.sleep(2); print('done')"
    other, main = await host.start(slow, context=b), await host.start(slow)
    await host.ok(protocol.Op.CONTEXT_INTERRUPT, context=a)
    assert value(await host.collect(sleeper)) == "KeyboardInterrupt"
    for run in (await host.collect(other), await host.collect(main)):
        assert run.reply["content"]["status"] == "ok" and run.stream() == "done\n"


async def test_stop_forgets_the_context(host: HostEnd, running: Running) -> None:
    context = (await host.ok(protocol.Op.CONTEXT_START, timeout=START_TIMEOUT))["context"]
    pid = int(value(await host.execute("import os; os.getpid()", context=context)))
    assert await host.ok(protocol.Op.CONTEXT_STOP, context=context)
    assert context not in [c["context"] for c in (await host.ok(protocol.Op.CONTEXT_LIST))["contexts"]]
    await gone(pid)
    for op in (protocol.Op.CONTEXT_STOP, protocol.Op.CONTEXT_RESTART, protocol.Op.CONTEXT_INTERRUPT):
        error = await host.refused(op, context=context)
        assert error.startswith("ContextNotFound: ") and repr(context) in error, error
    # a cell sent to it gets the documented error at once, as an execution's end looks
    run = await host.execute("1 + 1", context=context)
    assert run.reply["content"]["ename"] == protocol.CONTEXT_NOT_FOUND
    assert run.reply["header"]["msg_type"] == "execute_reply"
    assert repr(context) in run.reply["content"]["evalue"]
    assert [m["header"]["msg_type"] for m in run.iopub] == ["error", "status"]
    assert {host.context_of[m["header"]["msg_id"]] for m in [*run.iopub, run.reply]} == {context}
    assert value(await host.execute("1 + 1")) == "2"  # the main kernel is untouched


async def test_a_stop_waits_for_a_restart_in_progress(host: HostEnd, running: Running) -> None:
    context = (await host.ok(protocol.Op.CONTEXT_START, timeout=START_TIMEOUT))["context"]
    kernel = running.agent.contexts.kernels()[-1]
    assert kernel.context_id == context
    restart = asyncio.ensure_future(host.request(protocol.Op.CONTEXT_RESTART, START_TIMEOUT, context=context))
    async with asyncio.timeout(WAIT):
        while kernel.ready.is_set():  # noqa: ASYNC110  (polled: the restart has begun)
            await asyncio.sleep(0.01)
    await host.ok(protocol.Op.CONTEXT_STOP, timeout=START_TIMEOUT, context=context)
    assert (await restart)["ok"] is True  # it finished first, then the stop took its kernel
    assert not await kernel.is_alive()
    assert running.agent.contexts.kernels() == []


async def gone(pid: int) -> None:
    """Wait (at most WAIT) until the process ``pid`` no longer exists."""
    async with asyncio.timeout(WAIT):
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            await asyncio.sleep(0.05)


async def test_unknown_kernelspec_and_relative_cwd_are_refused(host: HostEnd) -> None:
    error = await host.refused(protocol.Op.CONTEXT_START, kernel="no-such-kernel")
    assert "'no-such-kernel'" in error and f"installed: {KERNEL_NAME}, python3" in error, error
    error = await host.refused(protocol.Op.CONTEXT_START, kernel=5)
    assert "kernel must be the name of a kernelspec, got 5" in error, error
    error = await host.refused(protocol.Op.CONTEXT_START, cwd="work/dir")
    assert "'work/dir'" in error and "absolute" in error, error
    error = await host.refused(protocol.Op.CONTEXT_RESTART, context=None)
    assert "no code context None" in error, error
    assert (await host.ok(protocol.Op.CONTEXT_LIST))["contexts"] == []


async def test_a_killed_context_kernel_is_reported_and_comes_back(host: HostEnd, start: Start) -> None:
    context = (await start())["context"]
    await host.execute("z = 1", context=context)
    pid = int(value(await host.execute("import os; os.getpid()", context=context)))
    drain(host)
    os.kill(pid, signal.SIGKILL)
    died = await next_event(host)
    assert (died["event"], died["context"], died["exit_code"]) == ("kernel_died", context, -9), died
    restarted = await next_event(host)
    assert restarted == {"op": "event", "event": "kernel_restarted", "reason": "died", "context": context}
    assert value(await host.execute("z", context=context)) == "NameError"  # a fresh kernel
    assert value(await host.execute("1 + 1", context=context)) == "2"
    assert host.events.empty()  # the main kernel said nothing


async def test_resumed_reseeds_every_context(host: HostEnd, start: Start) -> None:
    context = (await start())["context"]
    await host.execute("import random; random.seed(1234)", context=context)
    await host.ok(protocol.Op.RESUMED, time_ns=1, entropy=b"\x01" * 16)
    run = await host.execute("print(random.random())", context=context)
    assert float(run.stream()) != random.Random(1234).random()


async def test_the_cap_and_the_agents_stop(tmp_path: Path) -> None:
    async with running_agent(tmp_path, max_contexts=1, standby_kernel=False) as running:
        host = running.host
        first = (await host.ok(protocol.Op.CONTEXT_START, timeout=START_TIMEOUT))["context"]
        error = await host.refused(protocol.Op.CONTEXT_START)
        assert "max_contexts=1" in error and "context_stop" in error, error
        await host.ok(protocol.Op.CONTEXT_STOP, context=first)
        second = (await host.ok(protocol.Op.CONTEXT_START, timeout=START_TIMEOUT))["context"]
        pid = int(value(await host.execute("import os; os.getpid()", context=second)))
    await gone(pid)  # the agent's stop stopped the context's kernel


async def test_waiting_on_kernel_processes_parks_no_thread() -> None:
    """Each context's monitor waits on its kernel process: a thread each would exhaust the
    loop's default executor (min(32, CPUs + 4) threads) that the agent's blocking calls share."""
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(12)]  # noqa: ASYNC220  (no waiting)
    try:
        threads = threading.active_count()
        waits = [asyncio.ensure_future(wait_process(p)) for p in procs]
        await asyncio.sleep(0.2)
        assert threading.active_count() == threads
        procs[0].kill()
        assert await asyncio.wait_for(waits[0], WAIT) == -signal.SIGKILL
        for wait in waits[1:]:
            wait.cancel()
        await asyncio.gather(*waits[1:], return_exceptions=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def test_net_config_reaches_running_contexts_and_later_ones(host: HostEnd, start: Start) -> None:
    proxy = {"HTTP_PROXY": "http://127.0.0.1:3128"}
    earlier = (await start())["context"]
    await host.ok(protocol.Op.NET_CONFIG, mode="outbound", env=proxy)
    try:
        later = (await start())["context"]
        for context in (earlier, later):
            run = await host.execute("import os; print(os.environ.get('HTTP_PROXY'))", context=context)
            assert run.stream() == proxy["HTTP_PROXY"] + "\n", context
    finally:
        await host.ok(protocol.Op.NET_CONFIG, mode="none")
    run = await host.execute("import os; print(os.environ.get('HTTP_PROXY'))", context=earlier)
    assert run.stream() == "None\n"
