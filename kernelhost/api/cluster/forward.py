"""Forwarding one request to another node, streamed both ways: bodies (uploads, downloads, NDJSON
execute streams) pass through in chunks as they come, never buffered whole, and a WebSocket is
bridged message by message, each under the size a node takes on its own WebSocket routes (a
client's message: ``max_ws_message_bytes``; the peer's: ``max_ws_relay_bytes``), so a bridge
never buffers more of one message than the route it stands for would. A client that hangs up
closes the upstream request with it.

The call to the peer is signed (``signing.py``; the signer gets the body's binding) and carries
none of the client's credentials (``CREDENTIALS``; a Kernel Gateway route's ``?token=`` is taken
out of the query): the peer acts for the signed owner. It carries this node's ``traceparent``
(a ``cluster.forward`` span's, when tracing is on), so the peer's spans join the client's trace;
a node that does not trace passes the client's own on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
from aiohttp import web
from yarl import URL

from ... import tracing
from ..credentials import without_token
from ..state import SETTINGS
from .signing import body_binding

CHUNK = 256 * 1024
# headers of one hop, never passed on (RFC 9110 7.6.1), and what the forwarder sets itself
HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Authorization",
        "Sec-WebSocket-Key", "Sec-WebSocket-Version", "Sec-WebSocket-Extensions",
        "Sec-WebSocket-Protocol", "Sec-WebSocket-Accept",
    )
)  # fmt: skip
# what a client proves itself with: checked by the node it called, never passed on
CREDENTIALS = frozenset({"authorization", "proxy-authorization", "x-api-key", "x-access-token", "cookie"})
Signer = Callable[[str], Mapping[str, str]]


class PeerUnreachable(ConnectionError):
    """The node that holds the sandbox did not answer."""


def new_session() -> aiohttp.ClientSession:
    """The one client session a node uses for its peers: no total deadline (an execute may run
    for hours), a short one to connect, bytes passed through undecoded."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, connect=10)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    return aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)


def _headers(source: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    out = {
        k: v
        for k, v in source.items()
        if k.lower() not in HOP and k.lower() not in CREDENTIALS and not k.lower().startswith("x-kernelhost-")
    }
    out.update(extra)
    tracing.inject(out)  # the current span's traceparent, in place of the client's
    return out


def _url(base_url: str, request: web.Request) -> URL:
    """The peer's URL for ``request``: its path and query as they came (still encoded, as signed),
    less a key given as ``?token=``."""
    return URL(base_url.rstrip("/") + without_token(request.rel_url.raw_path_qs), encoded=True)


async def _body(request: web.Request) -> AsyncIterator[bytes]:
    async for chunk in request.content.iter_chunked(CHUNK):
        yield chunk


async def forward(
    session: aiohttp.ClientSession,
    request: web.Request,
    base_url: str,
    signer: Signer,
    body: bytes | None = None,
) -> web.StreamResponse:
    """Send ``request`` to the node at ``base_url`` and stream its answer back (``body``: the
    request's body, when it was read already: signed whole)."""
    with tracing.client_span("cluster.forward", **{"server.address": URL(base_url).host}):
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await _bridge(session, request, base_url, signer("none"))
        return await _forward(session, request, base_url, signer, body)


async def _forward(
    session: aiohttp.ClientSession,
    request: web.Request,
    base_url: str,
    signer: Signer,
    body: bytes | None,
) -> web.StreamResponse:
    data: bytes | AsyncIterator[bytes] | None = body
    streamed = data is None and request.body_exists
    extra = dict(signer(body_binding(body, streamed=streamed, length=request.content_length)))
    if streamed:
        data = _body(request)
        if request.content_length is not None:  # the peer checks sizes up front, as we would
            extra["Content-Length"] = str(request.content_length)
    url = _url(base_url, request)
    try:
        upstream_cm = session.request(
            request.method, url, headers=_headers(request.headers, extra), data=data, allow_redirects=False
        )
        upstream = await upstream_cm.__aenter__()
    except (TimeoutError, aiohttp.ClientConnectionError) as exc:
        raise PeerUnreachable(f"{base_url}: {exc or type(exc).__name__}") from None
    try:
        headers = {
            k: v for k, v in upstream.headers.items() if k.lower() not in HOP or k.lower() == "content-length"
        }
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        await resp.prepare(request)
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp
    finally:
        await upstream_cm.__aexit__(None, None, None)


async def _bridge(
    session: aiohttp.ClientSession, request: web.Request, base_url: str, extra: Mapping[str, str]
) -> web.StreamResponse:
    """A WebSocket to the peer, and one to the client speaking the subprotocol the peer chose."""
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    url = _url(base_url, request)
    settings = request.app[SETTINGS]
    try:
        upstream = await session.ws_connect(
            url,
            headers=_headers(request.headers, extra),
            protocols=offered,
            max_msg_size=settings.max_ws_relay_bytes,
            autoping=True,
        )
    except aiohttp.WSServerHandshakeError as exc:
        return web.json_response({"error": "forward_failed", "message": exc.message}, status=exc.status)
    except (TimeoutError, aiohttp.ClientConnectionError) as exc:
        raise PeerUnreachable(f"{base_url}: {exc or type(exc).__name__}") from None
    chosen = (upstream.protocol,) if upstream.protocol else ()
    client = web.WebSocketResponse(protocols=chosen, max_msg_size=settings.max_ws_message_bytes)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(upstream.close)
        await client.prepare(request)
        pumps = [
            asyncio.ensure_future(_pump(client, upstream)),
            asyncio.ensure_future(_pump(upstream, client)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        code = upstream.close_code or 1000
        await client.close(code=code)
    return client


async def _pump(
    source: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
    sink: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
) -> None:
    async for msg in source:
        if msg.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(msg.data)
        elif msg.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(msg.data)
        else:
            break
