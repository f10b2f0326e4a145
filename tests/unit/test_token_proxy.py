"""The proxy that gives Enterprise Gateway's credential-less test client the key
(tests/clients/token_proxy.py), against a recording upstream: the key's header on every request
and upgrade, and nothing else changed (status, body, headers, query; WebSocket text as text,
binary as binary, a close's code and reason; a refused upgrade's status)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.clients.token_proxy import serve

pytestmark = pytest.mark.unit


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[TestServer, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []

    async def kernels(request: web.Request) -> web.Response:
        seen.append({"auth": request.headers.get("Authorization", ""), "path_qs": request.path_qs})
        body = await request.read()
        return web.Response(status=201, body=body, headers={"Location": "/api/kernels/k1", "X-Kept": "1"})

    async def channels(request: web.Request) -> web.WebSocketResponse:
        seen.append({"auth": request.headers.get("Authorization", ""), "path_qs": request.path_qs})
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT and msg.data == "close":
                await ws.close(code=4004, message=b"the sandbox was deleted")
            elif msg.type == aiohttp.WSMsgType.TEXT:
                await ws.send_str(msg.data.upper())
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data[::-1])
        return ws

    app = web.Application()
    app.router.add_post("/api/kernels", kernels)
    app.router.add_get("/api/kernels/k1/channels", channels)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield server, seen
    finally:
        await server.close()


async def test_requests_get_the_key_and_answers_come_back_unchanged(
    upstream: tuple[TestServer, list[dict[str, str]]],
) -> None:
    server, seen = upstream
    with serve(str(server.make_url("")), "kh_secret") as host:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"http://{host}/api/kernels?user=bob",
                data=b'{"name": "python3"}',
                headers={"Authorization": "token not-the-key"},
            ) as answer,
        ):
            assert answer.status == 201
            assert await answer.read() == b'{"name": "python3"}'
            assert answer.headers["Location"] == "/api/kernels/k1"
            assert answer.headers["X-Kept"] == "1"
    assert seen == [{"auth": "token kh_secret", "path_qs": "/api/kernels?user=bob"}]


async def test_websocket_messages_and_close_pass_both_ways(
    upstream: tuple[TestServer, list[dict[str, str]]],
) -> None:
    server, seen = upstream
    with serve(str(server.make_url("")), "kh_secret") as host:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"ws://{host}/api/kernels/k1/channels?session_id=s") as ws:
                await ws.send_str("hello")
                text = await ws.receive(timeout=10)
                await ws.send_bytes(b"\x00\x01\x02")
                binary = await ws.receive(timeout=10)
                await ws.send_str("close")
                closed = await ws.receive(timeout=10)
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(f"ws://{host}/api/kernels/k2/channels")
    assert (text.type, text.data) == (aiohttp.WSMsgType.TEXT, "HELLO")
    assert (binary.type, binary.data) == (aiohttp.WSMsgType.BINARY, b"\x02\x01\x00")
    assert (closed.type, closed.data) == (aiohttp.WSMsgType.CLOSE, 4004)
    assert closed.extra == "the sandbox was deleted"
    assert refused.value.status == 404
    assert seen == [{"auth": "token kh_secret", "path_qs": "/api/kernels/k1/channels?session_id=s"}]
