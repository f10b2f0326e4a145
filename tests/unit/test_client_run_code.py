"""Unit tests of the Python SDK's ``run_code`` (events, callbacks, streams, deadlines, retries)
and of the sync twin, against the fake kernelhost server of ``client_fake.py``."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from typing import Any

import pytest

from kernelhost import (
    AsyncSandbox,
    AuthenticationError,
    ExecutionError,
    KernelHostError,
    KernelHostTimeout,
    NotFoundError,
    Result,
    Sandbox,
    ServerError,
    TransportError,
)
from kernelhost.client import _sandbox

from .client_fake import KEY, REPO, FakeKernelHost, Send, _closed_port_url, _sdk_threads

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("no_env", "sdk_thread_baseline")]


# -- run_code --------------------------------------------------------------------------------


async def test_a_dropped_connection_is_retried_where_no_work_can_have_started(
    fake: FakeKernelHost,
) -> None:
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        fake.drop_next = 1
        assert (await sbx.run_code("1")).status == "ok"  # execute: nothing ran before a response
        fake.drop_next = 1
        assert (await sbx.info()).id == sbx.id  # GET
        fake.drop_next = 1
        with pytest.raises(TransportError):  # POST /interrupt: not sent twice
            await sbx.interrupt()
    fake.drop_next = 1
    with pytest.raises(TransportError):  # a create may have happened: not sent twice
        await AsyncSandbox.create(url=fake.url, api_key=KEY)
    assert fake.drop_next == 0


async def test_calls_reuse_one_connection_when_the_body_ends_after_its_last_event(
    fake: FakeKernelHost,
) -> None:
    async def script(body: dict[str, Any], send: Send) -> None:
        await send({"type": "end", "status": "ok", "execution_count": 1})
        await asyncio.sleep(0.05)  # the end of the body comes in a later packet

    fake.script = script
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        for _ in range(4):
            assert (await sbx.run_code("1")).status == "ok"
    executes = [
        peer
        for (method, path, _), peer in zip(fake.requests, fake.peers, strict=True)
        if path.endswith("/execute")
    ]
    assert len(executes) == 4 and len(set(executes)) == 1, executes


async def test_run_code_collects_every_event(fake: FakeKernelHost) -> None:
    async def script(body: dict[str, Any], send: Send) -> None:
        assert body == {"code": "1/0", "language": "python", "timeout": 5.0}
        await send({"type": "stdout", "text": "a"})
        await send({"type": "progress", "percent": 50})  # from a newer server: ignored
        await send({"type": "stdout", "text": "b\n"})
        await send({"type": "stderr", "text": "warn\n"})
        await send({"type": "result", "data": {"image/png": "iVBO"}, "metadata": {"w": 1}})
        await send({"type": "result", "data": {"text/plain": "42"}, "is_main_result": True})
        await send(
            {
                "type": "error",
                "name": "ZeroDivisionError",
                "value": "division by zero",
                "traceback": ["line 1", "line 2"],
            }
        )
        await send({"type": "end", "status": "error", "execution_count": 3, "duration_ms": 41.2})
        await send({"type": "stdout", "text": "after end: never read"})

    fake.script = script
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        execution = await sbx.run_code("1/0", timeout=5)
    assert execution.stdout == "ab\n" and execution.stderr == "warn\n"
    assert [r.is_main_result for r in execution.results] == [False, True]
    assert execution.results[0].png == "iVBO" and execution.results[0].metadata == {"w": 1}
    assert execution.text == "42"
    assert execution.error == ExecutionError("ZeroDivisionError", "division by zero", ["line 1", "line 2"])
    assert execution.status == "error"
    assert (execution.execution_count, execution.duration_ms) == (3, 41.2)


async def test_callbacks_fire_as_events_arrive(fake: FakeKernelHost) -> None:
    fired = {kind: asyncio.Event() for kind in ("stdout", "stderr", "result", "error")}

    async def script(body: dict[str, Any], send: Send) -> None:
        # Each event waits for its callback before the next is sent, so the call cannot have
        # returned yet, and the 'end' event tells whether every callback was seen in time.
        status = "ok"
        events: list[dict[str, Any]] = [
            {"type": "stdout", "text": "out"},
            {"type": "stderr", "text": "err"},
            {"type": "result", "data": {"text/plain": "1"}, "is_main_result": True},
            {"type": "error", "name": "E", "value": "v", "traceback": []},
        ]
        for event in events:
            await send(event)
            try:
                await asyncio.wait_for(fired[event["type"]].wait(), 5)
            except TimeoutError:
                status = f"no callback for {event['type']}"
        await send({"type": "end", "status": status, "execution_count": 1, "duration_ms": 1.0})

    seen: list[Any] = []

    def on_stdout(text: str) -> None:
        seen.append(text)
        fired["stdout"].set()

    async def on_stderr(text: str) -> None:  # coroutine callbacks are awaited
        await asyncio.sleep(0)
        seen.append(text)
        fired["stderr"].set()

    def on_result(result: Result) -> None:
        seen.append(result.text)
        fired["result"].set()

    async def on_error(error: ExecutionError) -> None:
        seen.append(str(error))
        fired["error"].set()

    fake.script = script
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        execution = await sbx.run_code(
            "x", on_stdout=on_stdout, on_stderr=on_stderr, on_result=on_result, on_error=on_error
        )
    assert execution.status == "ok"
    assert seen == ["out", "err", "1", "E: v"]


async def test_callback_exception_propagates(fake: FakeKernelHost) -> None:
    def on_stdout(text: str) -> None:
        raise ValueError(f"callback rejected {text!r}")

    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        with pytest.raises(ValueError, match="callback rejected 'hello"):
            await sbx.run_code("x", on_stdout=on_stdout)
        assert (await sbx.run_code("x")).stdout == "hello\n"  # the sandbox is still usable


async def test_stream_without_end_is_a_transport_error(fake: FakeKernelHost) -> None:
    async def script(body: dict[str, Any], send: Send) -> None:
        await send({"type": "stdout", "text": "partial"})

    fake.script = script
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        with pytest.raises(TransportError, match="ended early"):
            await sbx.run_code("x")


async def test_large_events_are_read_whole(fake: FakeKernelHost) -> None:
    image = "A" * (3 * 1024 * 1024)  # beyond aiohttp's 128 KiB line limit

    async def script(body: dict[str, Any], send: Send) -> None:
        await send({"type": "result", "data": {"image/png": image}, "is_main_result": False})
        await send({"type": "end", "status": "ok", "execution_count": 1, "duration_ms": 1.0})

    fake.script = script
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        execution = await sbx.run_code("x")
    assert execution.results[0].png == image


async def test_client_deadline_is_timeout_plus_margin(
    fake: FakeKernelHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_sandbox, "EXECUTE_DEADLINE_MARGIN", 0.2)
    release = asyncio.Event()

    async def hung_server(body: dict[str, Any], send: Send) -> None:
        await send({"type": "stdout", "text": "started"})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), 10)

    fake.script = hung_server
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(KernelHostTimeout) as info:
            await sbx.run_code("x", timeout=0.1)
        elapsed = loop.time() - started
        release.set()
    assert isinstance(info.value, TimeoutError)
    assert "timeout=" in str(info.value)
    assert 0.25 <= elapsed < 5


async def test_invalid_timeout_names_the_value(fake: FakeKernelHost) -> None:
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        with pytest.raises(ValueError, match="timeout=0"):
            await sbx.run_code("x", timeout=0)


# -- the sync twin ---------------------------------------------------------------------------


def test_sync_sandbox_runs_code_and_closes(threaded_fake: FakeKernelHost) -> None:
    fired = threading.Event()

    async def script(body: dict[str, Any], send: Send) -> None:
        await send({"type": "stdout", "text": "out"})
        ok = await asyncio.to_thread(fired.wait, 5)
        await send({"type": "end", "status": "ok" if ok else "callback late", "execution_count": 1})

    seen: list[str] = []

    def on_stdout(text: str) -> None:
        seen.append(text)
        fired.set()

    threaded_fake.script = script
    with Sandbox(url=threaded_fake.url, api_key=KEY, metadata={"k": "v"}) as sbx:
        assert sbx.id == "sbx_1"
        assert len(_sdk_threads()) == 1
        execution = sbx.run_code("print('out')", on_stdout=on_stdout)
        assert sbx.info().metadata == {"k": "v"}
    assert (execution.status, execution.stdout, seen) == ("ok", "out", ["out"])
    assert threaded_fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]
    assert _sdk_threads() == []
    sbx.close()  # idempotent
    with pytest.raises(KernelHostError, match="sandbox sbx_1 is closed"):
        sbx.run_code("1")


def test_sync_connect_list_interrupt_restart(threaded_fake: FakeKernelHost) -> None:
    url = threaded_fake.url
    sbx = Sandbox(url=url, api_key=KEY)
    try:
        assert [s.id for s in Sandbox.list(url=url, api_key=KEY)] == ["sbx_1"]
        with Sandbox.connect("sbx_1", url=url, api_key=KEY) as again:
            again.interrupt()
            again.restart()
            assert again.run_code("1").text == "2"
    finally:
        sbx.close()
    assert threaded_fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"] * 2
    assert _sdk_threads() == []


def test_sync_construction_failure_leaks_no_thread(threaded_fake: FakeKernelHost) -> None:
    threaded_fake.fail_next(500, {"error": {"code": "boot_failed", "message": "VM did not boot"}})
    with pytest.raises(ServerError, match="VM did not boot"):
        Sandbox(url=threaded_fake.url, api_key=KEY)
    with pytest.raises(AuthenticationError):
        Sandbox(url=threaded_fake.url)
    with pytest.raises(TransportError):
        Sandbox(url=_closed_port_url(), api_key=KEY)
    with pytest.raises(NotFoundError):
        Sandbox.connect("sbx_404", url=threaded_fake.url, api_key=KEY)
    assert _sdk_threads() == []


def test_sync_callback_cannot_reenter_the_sandbox(threaded_fake: FakeKernelHost) -> None:
    with Sandbox(url=threaded_fake.url, api_key=KEY) as sbx:

        def on_stdout(text: str) -> None:
            sbx.info()

        with pytest.raises(KernelHostError, match="would deadlock"):
            sbx.run_code("x", on_stdout=on_stdout)
    assert _sdk_threads() == []


LEFT_OPEN = """
import sys
from kernelhost import Sandbox
kept = Sandbox(url=sys.argv[1], api_key=sys.argv[2])   # left to its idle timeout at exit
print(kept.run_code("1 + 1").text)
dropped = Sandbox(url=sys.argv[1], api_key=sys.argv[2])
dropped.run_code("1 + 1")
del dropped                                             # collected while the program runs
import gc; gc.collect()
"""


async def test_a_sync_handle_left_open_lets_go_quietly(fake: FakeKernelHost) -> None:
    """Scripts and notebooks often leave a sandbox to its idle timeout: at exit (or when the
    handle is collected) the SDK closes its connection without aiohttp's warnings, and does
    not delete the sandbox."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-W",
        "error::ResourceWarning",
        "-c",
        LEFT_OPEN,
        fake.url,
        KEY,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "2"
    assert err.decode() == "", err.decode()  # no "Unclosed client session", nothing at all
    assert fake.calls("DELETE") == []  # both sandboxes live on


def test_a_displays_new_versions_replace_it_in_the_results() -> None:
    from kernelhost.client._models import Execution, Result

    execution = Execution()
    shown = {"type": "result", "data": {"text/plain": "'0'"}, "display_id": "d1"}
    execution._keep(Result.from_wire(shown))
    execution._keep(Result.from_wire({"type": "result", "data": {"text/plain": "'other'"}}))
    for i in range(1, 4):
        update = Result.from_wire(
            {"type": "update_display", "data": {"text/plain": f"'{i}'"}, "display_id": "d1"}
        )
        assert update.is_update and update.display_id == "d1"
        execution._keep(update)
    execution._keep(Result.from_wire({"type": "update_display", "data": {}, "display_id": "unknown"}))
    assert [(r.data["text/plain"], r.is_update) for r in execution.results] == [
        ("'3'", True),
        ("'other'", False),
    ]
