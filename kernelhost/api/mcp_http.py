"""The MCP server over streamable HTTP at ``/mcp``, inside the aiohttp service.

The ``mcp`` package implements the transport as an ASGI app (its session manager); this module
bridges one aiohttp request to it (``_asgi_call``) and runs the session manager for the app's
lifetime. Authentication is the service's own: the auth middleware has already checked the
``Authorization: Bearer`` key before a request gets here, and the MCP tools act with that key by
calling the service through the SDK, like any other client.

If the ``mcp`` package is missing, ``/mcp`` answers 501 with the command that installs it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import structlog
from aiohttp import web

from ..config import Settings
from .errors import error_response
from .state import KEY_ID

log = structlog.get_logger("kernelhost.api")

MCP_PATH = "/mcp"
#: MCP sessions one API key may hold open at once: the transport's own limit is shared by every
#: key, so without this one key could open them all and every other key would get 503s
MAX_SESSIONS_PER_KEY = 32
#: How long the session manager may take to start and to stop.
MANAGER_TIMEOUT = 10.0
#: Bytes of request body handed to the ASGI app per ``http.request`` message.
BODY_CHUNK = 64 * 1024
#: How long the ASGI app may take to finish a request after its client went away.
DISCONNECT_GRACE = 5.0

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]


def loopback_url(settings: Settings) -> str:
    """The URL at which the service reaches itself (a wildcard listen address is not one)."""
    host = settings.host
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def setup_mcp(app: web.Application, settings: Settings) -> None:
    """Serve the MCP server at ``/mcp`` (GET, POST, DELETE), or a 501 if mcp is not installed."""
    try:
        from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
        from mcp.server.auth.provider import AccessToken
        from mcp.server.transport_security import TransportSecuritySettings

        from ..integrations.mcp_server import bearer_credentials, create_server
    except ImportError as exc:
        _serve_missing(app, str(exc))
        return

    server = create_server(bearer_credentials(loopback_url(settings)))
    # The transport's DNS-rebinding guard protects servers that trust ambient credentials
    # (cookies, being on localhost); every request here must carry the API key, which a
    # rebinding page cannot have, so the guard is off and any Host name the service is reached
    # by works.
    server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        max_request_body_size=settings.max_code_bytes + 1024 * 1024,
    )
    manager = server.session_manager
    sessions = KeySessions(manager)

    async def handle(request: web.Request) -> web.StreamResponse:
        # MCP sessions belong to the API key that opened them: the manager compares this
        # principal on every request of a session.
        kid = request[KEY_ID]
        opening = "mcp-session-id" not in request.headers
        if opening and sessions.count(kid) >= MAX_SESSIONS_PER_KEY:
            return error_response(
                429,
                "capacity_exceeded",
                f"this API key holds {MAX_SESSIONS_PER_KEY} MCP sessions, its limit; end some "
                "(DELETE /mcp with their mcp-session-id) or let them expire",
                limit="mcp_sessions_per_key",
                value=MAX_SESSIONS_PER_KEY,
            )
        user = AuthenticatedUser(AccessToken(token=kid, client_id=kid, scopes=[]))
        response = await _asgi_call(manager.handle_request, request, {"user": user})
        session_id = response.headers.get("mcp-session-id")
        if opening and session_id:
            sessions.add(kid, session_id)
        return response

    for method in ("GET", "POST", "DELETE"):
        app.router.add_route(method, MCP_PATH, handle)

    app.cleanup_ctx.append(_lifetime(manager))


def _serve_missing(app: web.Application, reason: str) -> None:
    async def missing(request: web.Request) -> web.Response:
        return error_response(
            501,
            "mcp_not_installed",
            f"this server has no MCP support ({reason}); install it with "
            "pip install 'kernelhost[mcp]' and restart the service",
        )

    for method in ("GET", "POST", "DELETE"):
        app.router.add_route(method, MCP_PATH, missing)


def _lifetime(manager: Any) -> Callable[[web.Application], AsyncIterator[None]]:
    """The session manager's lifetime as an app cleanup context."""

    async def run_manager(app: web.Application) -> AsyncIterator[None]:
        # The manager's anyio task group must be entered and left in one task, so it lives in a
        # task of its own for the app's lifetime.
        started, stop = asyncio.Event(), asyncio.Event()

        async def serve() -> None:
            async with manager.run():
                started.set()
                await stop.wait()

        task = asyncio.create_task(serve(), name="kernelhost-mcp")
        ready = asyncio.create_task(started.wait())
        await asyncio.wait({task, ready}, timeout=MANAGER_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():
            ready.cancel()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # re-raises the manager's own start-up error, if it had one
            raise RuntimeError(f"the MCP session manager did not start in {MANAGER_TIMEOUT} s")
        log.info("mcp.ready", path=MCP_PATH)
        try:
            yield
        finally:
            stop.set()
            try:
                async with asyncio.timeout(MANAGER_TIMEOUT):
                    await task
            except TimeoutError:
                log.warning("mcp.stop_timeout", seconds=MANAGER_TIMEOUT)

    return run_manager


class KeySessions:
    """The MCP sessions each key opened, for the per-key limit. A session is forgotten once the
    transport no longer knows it (ended by DELETE, or expired idle)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.by_key: dict[str, set[str]] = {}

    def add(self, kid: str, session_id: str) -> None:
        self.by_key.setdefault(kid, set()).add(session_id)

    def count(self, kid: str) -> int:
        live = getattr(self.manager, "_server_instances", None)  # the transport's open sessions
        mine = self.by_key.get(kid, set())
        if isinstance(live, dict):
            mine &= set(live)
        self.by_key[kid] = mine
        return len(mine)


async def _asgi_call(asgi: ASGIApp, request: web.Request, extra_scope: dict[str, Any]) -> web.StreamResponse:
    """Serve one aiohttp request with an ASGI app; stream its answer back as it is sent."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.raw_path.split("?", 1)[0].encode(),
        "root_path": "",
        "query_string": request.query_string.encode(),
        "headers": [(name.lower(), value) for name, value in request.raw_headers],
        "client": (request.remote or "", 0),
        "server": None,
        **extra_scope,
    }
    response: web.StreamResponse | None = None
    body_done = False
    gone = asyncio.Event()  # the client went away

    async def receive() -> Message:
        nonlocal body_done
        if not body_done:
            chunk = await request.content.read(BODY_CHUNK)
            body_done = request.content.at_eof()
            return {"type": "http.request", "body": chunk, "more_body": not body_done}
        # After the body there is only the disconnect; until then there is nothing to receive.
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            return  # nothing reaches a client that went away
        try:
            await _send(message)
        except ConnectionResetError:
            gone.set()

    async def _send(message: Message) -> None:
        nonlocal response
        if message["type"] == "http.response.start":
            response = web.StreamResponse(status=message["status"])
            for name, value in message.get("headers", []):
                response.headers.add(name.decode("latin-1"), value.decode("latin-1"))
            await response.prepare(request)
        elif message["type"] == "http.response.body":
            if response is None:
                raise RuntimeError("the ASGI app sent a body before starting the response")
            body = message.get("body", b"")
            if body:
                await response.write(body)
            if not message.get("more_body", False):
                await response.write_eof()

    # aiohttp cancels this handler when the client goes away. The app is not cancelled with it: it
    # is told (``http.disconnect``) and may finish. Cancelled in the middle, the transport drops a
    # session whose opening request the client had already read the answer to (an MCP 1.x client
    # closes that stream as soon as it has the answer), and the client's next request gets a 404.
    app = asyncio.ensure_future(asgi(scope, receive, send))
    try:
        await asyncio.shield(app)
    except asyncio.CancelledError:
        gone.set()
        await asyncio.wait({app}, timeout=DISCONNECT_GRACE)
        if not app.done():
            app.cancel()
        elif not app.cancelled() and app.exception() is not None:
            log.warning("mcp.request_failed_after_disconnect", error=repr(app.exception()))
        raise
    if response is None:
        return error_response(500, "internal_error", "the MCP transport sent no response")
    return response
