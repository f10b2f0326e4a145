"""Serving the app: the listening socket, its limits, TLS, and a clean stop on SIGTERM/SIGINT.

Every connection costs a descriptor before its request is authenticated, so what an
unauthenticated client can hold is bounded here: at most ``max_connections`` at once (the next
one is closed at once), and a connection must send its first request's head within
``header_timeout`` seconds (``_Guarded``); later requests of a kept-alive connection get the
same time by aiohttp's keep-alive deadline. The process's descriptor limit is
raised to its hard limit at start, so the cap is what binds, not ``EMFILE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import resource
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable, Iterator

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


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with a deadline for the first request's head and
    a place in the count of open connections (taken when the connection is accepted, so a burst
    accepted in one go cannot pass the cap before aiohttp has seen any of it)."""

    def __init__(self, inner: asyncio.Protocol, live: set[_Guarded], header_timeout: float) -> None:
        self.inner = inner
        self.live = live
        self.header_timeout = header_timeout
        self._head = b""  # the first request's bytes until its head is complete
        self._deadline: asyncio.TimerHandle | None = None
        self._transport: asyncio.BaseTransport | None = None
        live.add(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._deadline = asyncio.get_running_loop().call_later(self.header_timeout, self._too_slow)
        self.inner.connection_made(transport)

    def _too_slow(self) -> None:
        log.info("server.header_timeout", seconds=self.header_timeout)
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._deadline is not None:
            self._head = (self._head + data)[-(1 << 16) :]
            if b"\r\n\r\n" in self._head:
                self._deadline.cancel()
                self._deadline, self._head = None, b""
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.live.discard(self)
        if self._deadline is not None:
            self._deadline.cancel()
        self.inner.connection_lost(exc)


def capped(runner: web.BaseRunner, limit: int, header_timeout: float) -> Callable[[], asyncio.BaseProtocol]:
    """The protocol factory of ``runner``'s server: connections past ``limit`` are refused,
    the others must send their first request's head within ``header_timeout`` seconds (later
    ones are aiohttp's keep-alive deadline)."""
    live: set[_Guarded] = set()

    def factory() -> asyncio.BaseProtocol:
        server = runner.server
        assert server is not None
        if len(live) >= limit:
            log.warning("server.connection_refused", connections=len(live), limit=limit)
            return _Refused()
        return _Guarded(server(), live, header_timeout)

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
            capped(runner, settings.max_connections, settings.header_timeout),
            sock=sock,
            ssl=ssl_context(settings),
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
        with _stop_reported():
            await runner.cleanup()
            sock.close()


STOP_SLOW = 20.0  # a stop still under way this long reports what it waits for


@contextlib.contextmanager
def _stop_reported() -> Iterator[None]:
    """The stop's start and end in the log, and, if it takes longer than ``STOP_SLOW`` seconds,
    what it waits for: the tasks still pending with their stacks, and (a loop blocked in a call)
    every thread's stack on stderr. A stop that hangs is then diagnosed from its log alone."""
    log.info("service.stopping")
    t0 = time.monotonic()
    report = asyncio.get_running_loop().call_later(STOP_SLOW, _report_pending)
    with contextlib.suppress(ValueError, OSError, AttributeError):  # stderr without a descriptor
        faulthandler.dump_traceback_later(STOP_SLOW + 5, file=sys.stderr)
    try:
        yield
    finally:
        report.cancel()
        faulthandler.cancel_dump_traceback_later()
        log.info("service.stopped", ms=round((time.monotonic() - t0) * 1000))


def _report_pending() -> None:
    for task in asyncio.all_tasks():
        log.warning("service.stop_waits_for", task=task.get_name(), awaiting=_await_chain(task.get_coro()))


def _await_chain(coro: object) -> list[str]:
    """Where a suspended task is: each coroutine (or async generator) of its await chain,
    innermost last, then what the innermost awaits (a future, a thread's result)."""
    chain: list[str] = []
    frame = None
    while coro is not None and len(chain) < 40:
        if type(coro).__name__ == "async_generator_asend" and frame is not None:
            coro = getattr(frame.f_locals.get("self"), "gen", coro)  # contextlib's generator
        inner = (
            getattr(coro, "cr_frame", None)
            or getattr(coro, "gi_frame", None)
            or getattr(coro, "ag_frame", None)
        )
        if inner is None:
            chain.append(repr(coro)[:200])
            break
        frame = inner
        chain.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )
    return chain
