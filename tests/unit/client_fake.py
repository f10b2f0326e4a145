"""The fake kernelhost server the SDK's unit tests run against (``test_client.py``,
``test_client_run_code.py``), and their fixtures (``conftest.py`` makes them the unit tier's).

The fake is a small ``aiohttp.web`` app that speaks the HTTP API's contract: it records every
request, checks the bearer key, keeps sandboxes in a dict, and streams whatever NDJSON events a
test scripts for ``/execute``. Async tests run it on the test's event loop; the sync ``Sandbox``
tests run it on a loop in a thread of its own, since a blocking test never yields to a loop.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from .offline import serving, serving_in_thread

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


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
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
    with serving_in_thread(server):
        yield server


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


_threads_before: set[int] = set()


@pytest.fixture
def sdk_thread_baseline() -> None:
    """SDK threads alive before a test (e.g. a session-scoped Sandbox of another tier) are not
    this test's to account for."""
    _threads_before.clear()
    _threads_before.update(t.ident for t in threading.enumerate() if t.ident is not None)


def _sdk_threads() -> list[threading.Thread]:
    """SDK loop threads started during the current test and still alive."""
    return [
        t for t in threading.enumerate() if t.name == "kernelhost-sandbox" and t.ident not in _threads_before
    ]
