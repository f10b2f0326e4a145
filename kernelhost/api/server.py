"""Serving the app: the listening socket, its limits, TLS, and a clean stop on SIGTERM/SIGINT.

Every connection costs a descriptor before its request is authenticated, so what an
unauthenticated client can hold is bounded here: at most ``max_connections`` at once (the next
one is closed at once), and a connection must send a request's head within ``header_timeout``
seconds (aiohttp closes a connection whose request has not begun by its keep-alive deadline,
which is also how long an idle kept-alive connection stays). The process's descriptor limit is
raised to its hard limit at start, so the cap is what binds, not ``EMFILE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import socket
import ssl
from collections.abc import Callable

import structlog
from aiohttp import web

from ..config import Settings

log = structlog.get_logger("kernelhost.api")


def raise_descriptor_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit; the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


class _Refused(asyncio.Protocol):
    """What a connection over the cap gets: closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


def capped(runner: web.BaseRunner, limit: int) -> Callable[[], asyncio.BaseProtocol]:
    """The protocol factory of ``runner``'s server, refusing connections past ``limit``."""

    def factory() -> asyncio.BaseProtocol:
        server = runner.server
        assert server is not None
        if len(server.connections) >= limit:
            log.warning("server.connection_refused", connections=len(server.connections), limit=limit)
            return _Refused()
        return server()

    return factory


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    if not settings.tls_cert_file:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    return context


async def serve(app: web.Application, settings: Settings, ready: Callable[[], None]) -> None:
    """Run ``app`` until SIGTERM or SIGINT; ``ready()`` once it listens. The port is bound before
    the service starts: a port taken by another process fails before any VM is touched."""
    raise_descriptor_limit()
    sock = socket.create_server((settings.host, settings.port), backlog=128, reuse_port=False)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        keepalive_timeout=settings.header_timeout,
        access_log=None,
        shutdown_timeout=10,
    )
    await runner.setup()  # starts the service (cleanup_ctx): libvirt, the manager, the pool
    try:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            capped(runner, settings.max_connections), sock=sock, ssl=ssl_context(settings)
        )
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ready()
        try:
            await stop.wait()
        finally:
            server.close()
            await server.wait_closed()
    finally:
        await runner.cleanup()
        sock.close()
