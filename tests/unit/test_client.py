"""Unit tests of the Python SDK (``kernelhost.client``) against a fake kernelhost server.

The fake is a small ``aiohttp.web`` app that speaks the HTTP API's contract: it records every
request, checks the bearer key, keeps sandboxes in a dict, and streams whatever NDJSON events a
test scripts for ``/execute``. Async tests run it on the test's event loop; the sync ``Sandbox``
tests run it on a loop in a thread of its own, since a blocking test never yields to a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import socket
import subprocess
import sys
import threading
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

import kernelhost
from kernelhost import (
    APIError,
    AsyncSandbox,
    AuthenticationError,
    ConflictError,
    Execution,
    ExecutionError,
    InvalidRequestError,
    KernelHostError,
    KernelHostTimeout,
    NotFoundError,
    RateLimitError,
    Result,
    Sandbox,
    SandboxInfo,
    ServerError,
    TransportError,
)
from kernelhost.client import _sandbox

from .offline import serving

pytestmark = pytest.mark.unit

KEY = "test-key"
REPO = Path(__file__).resolve().parents[2]

Send = Callable[[dict[str, Any]], Awaitable[None]]
Script = Callable[[dict[str, Any], Send], Awaitable[None]]


def _api_error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


async def _default_script(body: dict[str, Any], send: Send) -> None:
    await send({"type": "stdout", "text": "hello\n"})
    await send({"type": "result", "data": {"text/plain": "2"}, "is_main_result": True})
    await send({"type": "end", "status": "ok", "execution_count": 1, "duration_ms": 3.5})


class FakeKernelHost:
    """An in-process stand-in for ``kernelhost serve``'s HTTP API."""

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, JSON body or None)
        self.headers: list[dict[str, str]] = []
        self.peers: list[Any] = []  # the client address of each request: one per connection
        self.drop_next = 0  # requests to answer by closing the connection
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.script: Script = _default_script
        self._fail_next: Callable[[], web.Response] | None = None
        self.app = web.Application(middlewares=[self._middleware])
        self.app.router.add_post("/v1/sandboxes", self._create)
        self.app.router.add_get("/v1/sandboxes", self._list)
        self.app.router.add_get("/v1/sandboxes/{id}", self._get)
        self.app.router.add_delete("/v1/sandboxes/{id}", self._delete)
        self.app.router.add_post("/v1/sandboxes/{id}/execute", self._execute)
        self.app.router.add_post("/v1/sandboxes/{id}/interrupt", self._no_content)
        self.app.router.add_post("/v1/sandboxes/{id}/restart", self._no_content)

    def fail_next(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        """Answer the next authenticated request with this status and body (JSON, or text)."""

        def respond() -> web.Response:
            if isinstance(body, str):
                return web.Response(status=status, text=body, headers=headers)
            return web.json_response(body, status=status, headers=headers)

        self._fail_next = respond

    def calls(self, method: str) -> list[str]:
        return [path for m, path, _ in self.requests if m == method]

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.method, request.path, body))
        self.headers.append(dict(request.headers))
        transport = request.transport
        self.peers.append(transport.get_extra_info("peername") if transport else None)
        if self.drop_next:  # a connection the server had closed: no response at all
            self.drop_next -= 1
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return _api_error(401, "invalid_api_key", "the API key is not valid")
        if self._fail_next is not None:
            respond, self._fail_next = self._fail_next, None
            return respond()
        return await handler(request)

    def _sandbox(self, request: web.Request) -> dict[str, Any]:
        sandbox_id = request.match_info["id"]
        if sandbox_id not in self.sandboxes:
            raise web.HTTPNotFound(
                text=json.dumps({"error": {"code": "sandbox_not_found", "message": sandbox_id}}),
                content_type="application/json",
            )
        return self.sandboxes[sandbox_id]

    async def _create(self, request: web.Request) -> web.Response:
        body = await request.json()
        sandbox_id = f"sbx_{len(self.sandboxes) + 1}"
        self.sandboxes[sandbox_id] = {
            "id": sandbox_id,
            "template": body["template"],
            "state": "running",
            "created_at": "2026-01-02T03:04:05Z",
            "last_active_at": "2026-01-02T03:04:06+00:00",
            "idle_timeout_seconds": body.get("idle_timeout_seconds", 600),
            "accel": "tcg",
            "memory_mib": 512,
            "vcpus": 1,
            "metadata": body.get("metadata", {}),
            "some_future_field": True,
        }
        return web.json_response(self.sandboxes[sandbox_id], status=201)

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"sandboxes": list(self.sandboxes.values())})

    async def _get(self, request: web.Request) -> web.Response:
        return web.json_response(self._sandbox(request))

    async def _delete(self, request: web.Request) -> web.Response:
        del self.sandboxes[self._sandbox(request)["id"]]
        return web.Response(status=204)

    async def _no_content(self, request: web.Request) -> web.Response:
        self._sandbox(request)
        return web.Response(status=204)

    async def _execute(self, request: web.Request) -> web.StreamResponse:
        self._sandbox(request)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await resp.write(json.dumps(event).encode() + b"\n")

        await self.script(await request.json(), send)
        await resp.write_eof()
        return resp


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The vm tier points these at a real service for the whole session; unit tests choose.
    monkeypatch.delenv("KERNELHOST_URL", raising=False)
    monkeypatch.delenv("KERNELHOST_API_KEY", raising=False)


@pytest.fixture
async def fake() -> AsyncIterator[FakeKernelHost]:
    server = FakeKernelHost()
    async with serving(server):
        yield server


@pytest.fixture
def threaded_fake() -> Iterator[FakeKernelHost]:
    server = FakeKernelHost()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-kernelhost", daemon=True)
    thread.start()
    stack = contextlib.AsyncExitStack()
    asyncio.run_coroutine_threadsafe(stack.enter_async_context(serving(server)), loop).result(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


_threads_before: set[int] = set()


@pytest.fixture(autouse=True)
def _sdk_thread_baseline() -> None:
    """SDK threads alive before a test (e.g. a session-scoped Sandbox of another tier) are not
    this test's to account for."""
    _threads_before.clear()
    _threads_before.update(t.ident for t in threading.enumerate() if t.ident is not None)


def _sdk_threads() -> list[threading.Thread]:
    """SDK loop threads started during the current test and still alive."""
    return [
        t for t in threading.enumerate() if t.name == "kernelhost-sandbox" and t.ident not in _threads_before
    ]


# -- public surface ------------------------------------------------------------------------


def test_all_lists_exactly_the_public_names() -> None:
    expected = {
        "APIError", "AsyncFiles", "AsyncSandbox", "AsyncTemplate", "AuthenticationError", "BuildInfo",
        "Checkpoint",
        "ConflictError", "Template", "TemplateBuildError", "TemplateInfo",
        "Execution", "ExecutionError", "ExecutionStatus", "FileInfo", "FileTooLargeError", "Files",
        "InvalidRequestError", "KernelHostError", "KernelHostTimeout", "NotFoundError",
        "RateLimitError", "Recovery", "Result", "Sandbox", "SandboxInfo", "SandboxState",
        "ServerError", "TransportError",
    }  # fmt: skip
    assert set(kernelhost.__all__) == expected
    assert kernelhost.__all__ == sorted(kernelhost.__all__)
    assert kernelhost.client.__all__ == kernelhost.__all__
    # submodules (kernelhost.client, and server modules other tests import) are not API names
    public = {
        name
        for name, value in vars(kernelhost).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == expected


def test_importing_kernelhost_loads_no_server_code() -> None:
    code = (
        "import json, sys, kernelhost\n"
        "banned = ('kernelhost.api', 'kernelhost.sandboxes', 'kernelhost.channel', 'hypervisor',"
        " 'libvirt', 'jupyter_client', 'aiohttp.web')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(banned))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == []


def test_exception_tree() -> None:
    for cls in (AuthenticationError, InvalidRequestError, NotFoundError, ConflictError,
                RateLimitError, ServerError):  # fmt: skip
        assert issubclass(cls, APIError)
    assert issubclass(APIError, KernelHostError)
    assert issubclass(TransportError, KernelHostError)
    assert issubclass(KernelHostTimeout, KernelHostError)
    assert issubclass(KernelHostTimeout, TimeoutError)


def test_sync_methods_take_signature_and_docstring_from_async() -> None:
    for name in ("run_code", "info", "interrupt", "restart"):
        sync, async_ = getattr(Sandbox, name), getattr(AsyncSandbox, name)
        assert sync.__doc__ == async_.__doc__, name
        assert inspect.signature(sync) == inspect.signature(async_), name
        assert not inspect.iscoroutinefunction(sync), name
    for name in ("close", "detach", "connect", "list"):
        assert getattr(Sandbox, name).__doc__ == getattr(AsyncSandbox, name).__doc__, name


def test_models() -> None:
    main = Result(data={"text/plain": "2", "text/html": "<b>2</b>"}, is_main_result=True)
    shown = Result(data={"image/png": "iVBO", "application/json": {"a": 1}})
    assert (main.text, main.html, main.png, main.markdown) == ("2", "<b>2</b>", None, None)
    assert (shown.png, shown.json, shown.jpeg, shown.svg) == ("iVBO", {"a": 1}, None, None)
    assert main.formats() == ["text/plain", "text/html"]
    assert Execution(results=[shown, main]).text == "2"
    assert Execution(results=[shown]).text is None
    error = ExecutionError(name="ZeroDivisionError", value="division by zero", traceback=["tb"])
    assert str(error) == "ZeroDivisionError: division by zero"


# -- configuration ---------------------------------------------------------------------------


async def test_missing_api_key_fails_before_any_request(fake: FakeKernelHost) -> None:
    with pytest.raises(AuthenticationError) as info:
        await AsyncSandbox.create(url=fake.url)
    message = str(info.value)
    assert "api_key=" in message and "KERNELHOST_API_KEY" in message
    assert "kernelhost serve" in message
    with pytest.raises(AuthenticationError):
        await AsyncSandbox.list(url=fake.url)
    with pytest.raises(AuthenticationError):
        AsyncSandbox(url=fake.url)
    assert fake.requests == []


async def test_url_and_key_come_from_the_environment(
    fake: FakeKernelHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELHOST_URL", fake.url + "/")
    monkeypatch.setenv("KERNELHOST_API_KEY", KEY)
    async with AsyncSandbox() as sbx:
        assert sbx.id == "sbx_1"
    assert fake.headers[0]["Authorization"] == f"Bearer {KEY}"


def test_bad_url_names_the_value() -> None:
    with pytest.raises(ValueError, match="'localhost:8999'"):
        AsyncSandbox(url="localhost:8999", api_key=KEY)


async def test_wrong_key_is_an_authentication_error(fake: FakeKernelHost) -> None:
    with pytest.raises(AuthenticationError) as info:
        await AsyncSandbox.create(url=fake.url, api_key="wrong")
    assert info.value.status == 401
    assert info.value.code == "invalid_api_key"
    assert "KERNELHOST_API_KEY" in str(info.value)


async def test_server_down_is_a_transport_error() -> None:
    url = _closed_port_url()
    with pytest.raises(TransportError) as info:
        await AsyncSandbox.create(url=url, api_key=KEY)
    assert url in str(info.value)
    assert "make serve" in str(info.value) and "KERNELHOST_URL" in str(info.value)


# -- lifecycle -------------------------------------------------------------------------------


async def test_async_with_creates_then_deletes(fake: FakeKernelHost) -> None:
    async with AsyncSandbox(
        url=fake.url, api_key=KEY, metadata={"owner": "me"}, idle_timeout_seconds=60
    ) as sbx:
        assert sbx.id == "sbx_1"
        info = await sbx.info()
    assert fake.requests[0] == (
        "POST",
        "/v1/sandboxes",
        {"template": "python", "metadata": {"owner": "me"}, "idle_timeout_seconds": 60},
    )
    assert info.metadata == {"owner": "me"} and info.idle_timeout_seconds == 60
    assert info.created_at is not None and info.created_at.tzinfo is not None
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]
    assert fake.sandboxes == {}


async def test_create_omits_unset_idle_timeout(fake: FakeKernelHost) -> None:
    async with await AsyncSandbox.create(url=fake.url, api_key=KEY) as sbx:
        assert sbx.id == "sbx_1"
    assert fake.requests[0][2] == {"template": "python", "metadata": {}}
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]


async def test_close_is_idempotent_and_blocks_further_use(fake: FakeKernelHost) -> None:
    sbx = await AsyncSandbox.create(url=fake.url, api_key=KEY)
    await sbx.close()
    await sbx.close()
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]
    with pytest.raises(KernelHostError, match="sandbox sbx_1 is closed"):
        await sbx.run_code("1")
    with pytest.raises(KernelHostError, match="is closed"):
        async with sbx:
            pass


async def test_detach_keeps_the_sandbox_and_retires_the_handle(fake: FakeKernelHost) -> None:
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        await sbx.detach()
        await sbx.detach()  # idempotent
        assert sbx.id == "sbx_1" and "detached" in repr(sbx)
        with pytest.raises(KernelHostError, match=r"sbx_1 was detached .*connect\('sbx_1'\)"):
            await sbx.run_code("1")
        with pytest.raises(KernelHostError, match="was detached"):
            await sbx.files.read("x")
        await sbx.close()  # not this handle's to delete any more
    # neither close() nor the block's exit deleted it: another handle still can use it
    assert fake.calls("DELETE") == [] and "sbx_1" in fake.sandboxes
    again = await AsyncSandbox.connect("sbx_1", url=fake.url, api_key=KEY)
    assert (await again.run_code("1")).text == "2"
    await again.close()
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]


def test_sync_detach_keeps_the_sandbox(threaded_fake: FakeKernelHost) -> None:
    with Sandbox(url=threaded_fake.url, api_key=KEY) as sbx:
        sbx.detach()
        assert _sdk_threads() == []  # the handle's loop thread is gone
        with pytest.raises(KernelHostError, match="was detached"):
            sbx.run_code("1")
        sbx.detach()
    assert threaded_fake.calls("DELETE") == []
    with Sandbox.connect("sbx_1", url=threaded_fake.url, api_key=KEY) as again:
        assert again.run_code("1").text == "2"
    assert threaded_fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]


async def test_close_tolerates_a_sandbox_already_gone(fake: FakeKernelHost) -> None:
    sbx = await AsyncSandbox.create(url=fake.url, api_key=KEY)
    fake.sandboxes.clear()  # the idle reaper got there first
    await sbx.close()
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]


async def test_unopened_sandbox_says_how_to_create_it() -> None:
    sbx = AsyncSandbox(url="http://127.0.0.1:1", api_key=KEY)
    with pytest.raises(KernelHostError, match="not been created yet"):
        await sbx.run_code("1")


async def test_connect_list_interrupt_restart(fake: FakeKernelHost) -> None:
    first = await AsyncSandbox.create(url=fake.url, api_key=KEY, metadata={"n": "1"})
    try:
        listed = await AsyncSandbox.list(url=fake.url, api_key=KEY)
        assert [s.id for s in listed] == ["sbx_1"] and isinstance(listed[0], SandboxInfo)
        again = await AsyncSandbox.connect("sbx_1", url=fake.url, api_key=KEY)
        assert again.id == "sbx_1"
        await again.interrupt()
        await again.restart()
        assert (await again.run_code("1")).text == "2"
        assert fake.calls("POST")[-3:] == [
            "/v1/sandboxes/sbx_1/interrupt",
            "/v1/sandboxes/sbx_1/restart",
            "/v1/sandboxes/sbx_1/execute",
        ]
        await again.close()
    finally:
        await first.close()  # already deleted through `again`: a 404 that close() absorbs
    with pytest.raises(NotFoundError) as info:
        await AsyncSandbox.connect("sbx_9", url=fake.url, api_key=KEY)
    assert info.value.code == "sandbox_not_found"


# -- error mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, InvalidRequestError),
        (401, AuthenticationError),
        (404, NotFoundError),
        (409, ConflictError),
        (422, InvalidRequestError),
        (429, RateLimitError),
        (500, ServerError),
        (503, ServerError),
        (418, APIError),
    ],
)
async def test_error_statuses_map_to_exceptions(
    fake: FakeKernelHost, status: int, expected: type[APIError]
) -> None:
    fake.fail_next(status, {"error": {"code": "some_code", "message": "human text", "n": 1}})
    with pytest.raises(APIError) as info:
        await AsyncSandbox.create(url=fake.url, api_key=KEY)
    exc = info.value
    assert type(exc) is expected
    assert (exc.status, exc.code, exc.message) == (status, "some_code", "human text")
    assert exc.details["n"] == 1
    assert "human text" in str(exc) and "POST /v1/sandboxes" in str(exc)


async def test_error_without_json_body(fake: FakeKernelHost) -> None:
    fake.fail_next(502, "<html>Bad Gateway</html>")
    with pytest.raises(ServerError) as info:
        await AsyncSandbox.create(url=fake.url, api_key=KEY)
    assert info.value.code == "http_502"
    assert "Bad Gateway" in info.value.message


async def test_rate_limit_carries_retry_after(fake: FakeKernelHost) -> None:
    fake.fail_next(429, {"error": {"code": "too_many", "message": "slow down"}}, {"Retry-After": "7"})
    with pytest.raises(RateLimitError) as info:
        await AsyncSandbox.create(url=fake.url, api_key=KEY)
    assert info.value.retry_after == 7.0


async def test_execute_error_status_is_mapped(fake: FakeKernelHost) -> None:
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        fake.fail_next(409, {"error": {"code": "sandbox_busy", "message": "busy"}})
        with pytest.raises(ConflictError, match="busy"):
            await sbx.run_code("1")


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
