"""A reverse proxy on 127.0.0.1 that adds ``Authorization: token <key>`` to every request and
WebSocket upgrade it relays to the service, and changes nothing else: for clients that send no
credentials at all, as a deployment's proxy in front of a gateway does (nginx's
``proxy_set_header Authorization``). Enterprise Gateway's test client (its itests' harness) is
one: it was written for a gateway without ``EG_AUTH_TOKEN``.

Statuses, bodies and headers go back as the service sent them; WebSocket messages are relayed
one for one, text as text and binary as binary, and a close with its code, either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Mapping

import aiohttp
from aiohttp import web

#: headers of one hop, never relayed (RFC 9110 7.6.1), and what aiohttp sets itself
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
        "Authorization",
    )
)


def _relayed(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


async def _pump(
    source: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
    sink: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
) -> None:
    code, reason = int(aiohttp.WSCloseCode.OK), ""
    while True:
        msg = await source.receive()
        if msg.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(msg.data)
        elif msg.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(msg.data)
        else:  # a close (its code and reason go on), or the connection gone
            if msg.type == aiohttp.WSMsgType.CLOSE:
                code, reason = int(msg.data), str(msg.extra or "")
            break
    if not sink.closed:
        await sink.close(code=code, message=reason.encode())


class TokenProxy:
    """``http://127.0.0.1:<port>`` relaying to ``upstream`` with ``key``; started by ``serve``."""

    def __init__(self, upstream: str, key: str) -> None:
        self.upstream, self.key = upstream.rstrip("/"), key
        self.session: aiohttp.ClientSession | None = None

    def _headers(self, request: web.Request) -> dict[str, str]:
        return {**_relayed(request.headers), "Authorization": f"token {self.key}"}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request)
        async with self.session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=self._headers(request),
            data=await request.read(),
            allow_redirects=False,
        ) as answer:
            body = await answer.read()
            return web.Response(status=answer.status, body=body, headers=_relayed(answer.headers))

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        headers = self._headers(request)
        headers = {k: v for k, v in headers.items() if not k.lower().startswith("sec-websocket")}
        try:
            upstream = await self.session.ws_connect(
                self.upstream + request.path_qs, headers=headers, protocols=[p for p in offered if p]
            )
        except aiohttp.WSServerHandshakeError as refused:  # the service's refusal, as it was
            return web.Response(status=refused.status, text=refused.message)
        async with upstream:
            client = web.WebSocketResponse(  # pings every 30 s, as the service's own
                protocols=[upstream.protocol] if upstream.protocol else (), heartbeat=30.0
            )
            await client.prepare(request)
            pumps = [asyncio.ensure_future(_pump(a, b)) for a, b in ((client, upstream), (upstream, client))]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            if not client.closed:
                await client.close(code=upstream.close_code or aiohttp.WSCloseCode.OK)
        return client


@contextlib.contextmanager
def serve(upstream: str, key: str) -> Iterator[str]:
    """A running proxy to ``upstream`` (in a thread of its own); its ``host:port``."""
    proxy = TokenProxy(upstream, key)
    loop = asyncio.new_event_loop()
    ready: list[str] = []
    runner_box: list[web.AppRunner] = []

    async def start() -> None:
        proxy.session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", proxy.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runner_box.append(runner)
        host, port = runner.addresses[0][:2]
        ready.append(f"{host}:{port}")

    async def stop() -> None:
        await runner_box[0].cleanup()
        assert proxy.session is not None
        await proxy.session.close()

    thread = threading.Thread(target=loop.run_forever, name="token-proxy", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield ready[0]
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
