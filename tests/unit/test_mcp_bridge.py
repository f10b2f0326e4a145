"""The aiohttp-to-ASGI bridge of ``/mcp`` (``kernelhost.api.mcp_http._asgi_call``) when the client
goes away: aiohttp cancels the handler, but the ASGI app is told (``http.disconnect``) and left
to finish. LangChain's MCP adapters (an MCP 1.x client) close a session's opening stream as soon
as they have read its answer; cancelled there, the transport dropped the session and the
client's next request got a 404 ("Session terminated", tests/clients/agents/test_langchain_mcp.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from kernelhost.api import mcp_http

pytestmark = pytest.mark.unit


async def test_a_client_that_goes_away_does_not_cancel_the_app(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mcp_http, "DISCONNECT_GRACE", 2.0)
    answered, told, finished = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"mcp-session-id", b"s1")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        answered.set()
        assert (await receive())["type"] == "http.request"
        assert (await receive())["type"] == "http.disconnect"  # only once the client is gone
        told.set()
        await send({"type": "http.response.body", "body": b"", "more_body": False})  # goes nowhere
        finished.set()  # the transport's bookkeeping after its answer: it must run

    request = make_mocked_request("POST", "/mcp", headers={"Content-Length": "0"})
    handler = asyncio.create_task(mcp_http._asgi_call(app, request, {}))
    await asyncio.wait_for(answered.wait(), 5)
    handler.cancel()  # what aiohttp does when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await handler
    assert told.is_set() and finished.is_set()


async def test_an_app_that_ignores_the_disconnect_is_cancelled_after_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mcp_http, "DISCONNECT_GRACE", 0.2)
    answered, cancelled = asyncio.Event(), asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        answered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    request = make_mocked_request("GET", "/mcp")
    handler = asyncio.create_task(mcp_http._asgi_call(app, request, {}))
    await asyncio.wait_for(answered.wait(), 5)
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(handler, 5)
    await asyncio.wait_for(cancelled.wait(), 5)
