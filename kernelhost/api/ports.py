"""Requests for ``{port}-{sandbox id}.{domain}``, routed by their ``Host`` header to a server
listening on that port in the sandbox (docs/ports.md): E2B's ``get_host(port)``.

The first middleware: a request whose ``Host`` names a sandbox's port is this module's, whatever
its path; every other request goes on to the service's routes. The caller proves it may reach
the sandbox with one of the sandbox's access tokens (``E2B-Traffic-Access-Token``, or
``X-Access-Token``) or its owner's API key (``Authorization: Bearer``), unless the operator made
ports public (``ports_public``). An unknown sandbox, a missing or wrong credential and a sandbox
of a key no longer configured get the same 404. kernelhost's own credential headers never reach
the tenant's server.

HTTP is relayed request by request (the body streamed, with its length when it has one, the
answer streamed back as it comes), a WebSocket message by message, each over its own connection into
the guest (``SandboxManager.ports``): the host speaks HTTP to the tenant's server as a client,
it never runs what the sandbox sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from aiohttp.client_proto import ResponseHandler

from ..sandboxes import Sandbox, SandboxError
from .errors import Handler, error_body, status_for
from .state import KEYS, RUNTIME, SETTINGS

log = structlog.get_logger("kernelhost.api.ports")

TOKEN_HEADERS = ("E2B-Traffic-Access-Token", "X-Access-Token")
#: hop-by-hop headers (RFC 9110), and those aiohttp sets itself, never relayed
HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Content-Length", "Sec-WebSocket-Key", "Sec-WebSocket-Version",
        "Sec-WebSocket-Extensions", "Sec-WebSocket-Accept", "Sec-WebSocket-Protocol",
    )
)  # fmt: skip
NO_SUCH_PORT = (
    "no sandbox of this host name accepts this credential: send the sandbox's "
    "trafficAccessToken as E2B-Traffic-Access-Token (or its owner's API key as "
    "'Authorization: Bearer <key>')"
)
WS_TOUCH_SECONDS = 30.0  # an open WebSocket counts as use of its sandbox this often


def host_pattern(domain: str) -> re.Pattern[str]:
    """``{port}-{sandbox id}.{domain}`` (the id as E2B's SDKs write it, or with ``sbx-`` for
    ``sbx_``, for DNS names and certificates that refuse an underscore), any port after it."""
    return re.compile(rf"(\d{{1,5}})-(sbx[_-][0-9a-f]{{16}})\.{re.escape(domain)}(?::\d{{1,5}})?")


def port_routing(domain: str) -> Any:
    pattern = host_pattern(domain)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        found = pattern.fullmatch(request.headers.get("Host", "").lower()) if domain else None
        if found is None:
            return await handler(request)
        structlog.contextvars.clear_contextvars()
        port, sandbox_id = int(found[1]), found[2].replace("sbx-", "sbx_", 1)
        structlog.contextvars.bind_contextvars(sandbox_id=sandbox_id, port=port)
        sbx = _checked(request, sandbox_id)
        if sbx is None:
            return _error(404, "not_found", NO_SUCH_PORT)
        try:
            sock = await request.app[RUNTIME].manager.ports.connect(sbx, port)
        except SandboxError as exc:
            return web.json_response({"error": error_body(exc)}, status=status_for(exc))
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await _relay_websocket(request, sbx, sock, port)
        return await _relay_http(request, sock, port)

    return middleware


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def _checked(request: web.Request, sandbox_id: str) -> Sandbox | None:
    """The sandbox, if the request may reach it (one check, the same work for every answer)."""
    manager = request.app[RUNTIME].manager
    sbx = manager.find(sandbox_id)
    rec = sbx.record if sbx is not None else None
    token = next((v for h in TOKEN_HEADERS if (v := request.headers.get(h, "").strip())), "")
    by_token = manager.access_token_valid(rec, token)
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    owner = request.app[KEYS].identify(key.strip()) if scheme.lower() == "bearer" and key.strip() else None
    if rec is None or rec.owner not in request.app[KEYS].digests:
        return None
    if request.app[SETTINGS].ports_public or by_token or owner == rec.owner:
        request["ports_owner_key"] = owner == rec.owner  # its Authorization was ours: not relayed
        return sbx
    return None


def _headers(request: web.Request) -> dict[str, str]:
    """The request's headers for the tenant's server: end-to-end ones only, and none of
    kernelhost's credentials."""
    drop = HOP | {h.lower() for h in TOKEN_HEADERS}
    if request.get("ports_owner_key"):
        drop |= {"authorization"}
    out = {k: v for k, v in request.headers.items() if k.lower() not in drop}
    peer = request.remote or ""
    out["X-Forwarded-For"] = ", ".join(filter(None, (request.headers.get("X-Forwarded-For"), peer)))
    out["X-Forwarded-Proto"] = request.scheme
    return out


class _OneSocket(aiohttp.BaseConnector):
    """A connector whose one connection is a socket already connected into the sandbox."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(force_close=True, limit=1)
        self._sock: socket.socket | None = sock

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> ResponseHandler:
        sock, self._sock = self._sock, None
        if sock is None:
            raise aiohttp.ClientConnectionError("one request per connection into the sandbox")
        _, proto = await self._loop.create_connection(self._factory, sock=sock)
        return proto

    async def close(self, *args: Any, **kwargs: Any) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        await super().close(*args, **kwargs)


def _session(sock: socket.socket) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=None, sock_read=None)
    return aiohttp.ClientSession(connector=_OneSocket(sock), timeout=timeout, auto_decompress=False)


async def _relay_http(request: web.Request, sock: socket.socket, port: int) -> web.StreamResponse:
    url = f"http://127.0.0.1:{port}{request.raw_path}"
    headers = _headers(request)
    body: Any = None
    if request.body_exists:  # streamed, with its length when it has one (else chunked)
        body = request.content
        if request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)
    async with _session(sock) as session:
        try:
            upstream = await session.request(
                request.method, url, headers=headers, data=body, allow_redirects=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )  # fmt: skip
        except aiohttp.ClientError as exc:
            return _error(
                502, "bad_gateway", f"the server on port {port} in the sandbox gave no answer: {exc}"
            )
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP - {"content-length"}:
                    response.headers.add(name, value)
            await response.prepare(request)
            with contextlib.suppress(aiohttp.ClientError):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            await response.write_eof()
            return response


async def _relay_websocket(
    request: web.Request, sbx: Sandbox, sock: socket.socket, port: int
) -> web.StreamResponse:
    url = f"http://127.0.0.1:{port}{request.raw_path}"
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    async with _session(sock) as session:
        try:
            upstream = await session.ws_connect(
                url, headers=_headers(request), protocols=protocols, max_msg_size=0
            )
        except (aiohttp.ClientError, aiohttp.WSServerHandshakeError) as exc:
            return _error(
                502, "bad_gateway", f"the server on port {port} in the sandbox refused the WebSocket: {exc}"
            )
        async with upstream:
            ws = web.WebSocketResponse(
                protocols=[upstream.protocol] if upstream.protocol else [], max_msg_size=0
            )
            await ws.prepare(request)
            ports = request.app[RUNTIME].manager.ports
            down = asyncio.ensure_future(_pipe(upstream, ws, lambda: ports.touch(sbx)))
            try:
                await _pipe(ws, upstream, lambda: None)
            finally:
                down.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError, aiohttp.ClientError):
                    await down
                await ws.close()
            return ws


async def _pipe(source: Any, sink: Any, touch: Any) -> None:
    """Messages from one WebSocket to the other until either closes."""
    loop = asyncio.get_running_loop()
    touched = loop.time()
    async for msg in source:
        if msg.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(msg.data)
        elif msg.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(msg.data)
        else:
            break
        if loop.time() - touched > WS_TOUCH_SECONDS:
            touch()
            touched = loop.time()
    await sink.close()
