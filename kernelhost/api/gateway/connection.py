"""One WebSocket attached to a sandbox's kernel: its framing, its outbound queue and writer, its
ordered shell sender, and the close codes it ends with.

``Connection`` is a ``SessionClient`` of the sandbox's ``KernelSession`` (the sandbox layer
routes the kernel's messages and holds the execution lock); this module only moves frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from typing import Any

import structlog
from aiohttp import WSMsgType, web

from ...channel import ChannelError, FrameError
from ...channel.protocol import JUPYTER_PROTOCOL_VERSION
from ...jupyter import wire
from ...sandboxes import KernelSession, Remedy, SandboxError, SandboxNotFound, SessionEnd

log = structlog.get_logger("kernelhost.gateway")

#: messages and bytes a WebSocket may have waiting to be written before it is cut off as too slow
SEND_QUEUE_MESSAGES, SEND_QUEUE_BYTES = 4096, 64 * 1024 * 1024
SHELL_QUEUE = 256  # shell messages a client may queue behind an execute waiting for the lock

# close codes: 1000 detached, 1007 not a Jupyter message, 1009 too large, 1011 channel closed,
# 1013 client too slow, 4004 sandbox deleted, 4009 sandbox not usable (dead, hibernation failed)
CLOSE_DETACHED, CLOSE_DELETED, CLOSE_UNUSABLE = 1000, 4004, 4009


class Closed(Exception):
    """End a WebSocket with ``code`` and a reason for the client."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def gateway_hint(exc: SandboxError) -> str:
    """An error's message with its remedy worded for a Jupyter client."""
    hint = (
        {
            Remedy.RESTART: "restart the kernel",
            Remedy.RECREATE: "shut this kernel down and start a new one",
            Remedy.LIST_SANDBOXES: "list the running kernels",
            Remedy.LIST_TEMPLATES: "list the kernelspecs",
        }.get(exc.remedy)
        if exc.remedy is not None
        else None
    )
    return f"{exc.message}; {hint}" if hint else exc.message


def closed_for(exc: Exception) -> Closed:
    if isinstance(exc, Closed):
        return exc
    if isinstance(exc, SandboxNotFound):
        return Closed(CLOSE_DELETED, "the sandbox was deleted")
    if isinstance(exc, SandboxError):
        return Closed(CLOSE_UNUSABLE, gateway_hint(exc))
    if isinstance(exc, FrameError):
        return Closed(1009, f"message too large for the sandbox channel: {exc}")
    return Closed(1011, f"the sandbox's channel closed: {exc}")


def _reason(text: str) -> bytes:
    """A close reason fits in 123 bytes."""
    data = text.encode()
    return data if len(data) <= 123 else data[:120].decode("utf-8", "ignore").encode() + b"..."


def fill_header(header: dict[str, Any]) -> None:
    """Give a client's header the fields the kernel needs, where the client left them out."""
    for name, value in (("session", ""), ("username", ""), ("version", JUPYTER_PROTOCOL_VERSION)):
        header.setdefault(name, value)
    header.setdefault("date", datetime.now(UTC).isoformat())


def presentable(msg: dict[str, Any]) -> dict[str, Any]:
    """JupyterLab rejects a message whose header fields are not strings; fix them in a copy."""
    header = msg.get("header") or {}
    names = ("msg_id", "msg_type", "session", "username", "version", "date")
    if all(isinstance(header.get(n), str) for n in names):
        return msg
    fixed = {**header, **{n: str(header.get(n) or "") for n in names if not isinstance(header.get(n), str)}}
    return {**msg, "header": fixed}


class Connection:
    """One attached WebSocket."""

    def __init__(self, ws: web.WebSocketResponse, session: KernelSession) -> None:
        self.ws = ws
        self.session = session
        self.v1 = ws.ws_protocol == wire.V1_PROTOCOL
        self.out: asyncio.Queue[str | bytes] = asyncio.Queue(SEND_QUEUE_MESSAGES)
        self.out_bytes = 0
        self.shell: asyncio.Queue[dict[str, Any]] = asyncio.Queue(SHELL_QUEUE)
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False

    def start(self) -> None:
        self._spawn(self._write_loop())
        self._spawn(self._shell_loop())

    def _spawn(self, coro: Any, name: str = "ws-io") -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- SessionClient ---------------------------------------------------------------------------

    def deliver(self, channel: str, msg: dict[str, Any], cache: dict[Any, Any]) -> None:
        """Queue one message for the client (called on the channel's reader: never blocks)."""
        if self.closing:
            return
        payload = cache.get(self.v1)
        if payload is None:
            msg = presentable(msg)
            payload = cache[self.v1] = wire.to_v1(channel, msg) if self.v1 else wire.to_text(channel, msg)
        if self.out.full() or self.out_bytes + len(payload) > SEND_QUEUE_BYTES:
            self.close(
                1013,
                f"client too slow: over {SEND_QUEUE_MESSAGES} messages or "
                f"{SEND_QUEUE_BYTES >> 20} MiB waiting; reconnect",
            )
            return
        self.out_bytes += len(payload)
        self.out.put_nowait(payload)

    def end(self, why: SessionEnd) -> None:
        self.close(CLOSE_DELETED if why.deleted else CLOSE_UNUSABLE, why.reason)

    # -- the socket ------------------------------------------------------------------------------

    def close(self, code: int, reason: str) -> None:
        if not self.closing:
            self.closing = True
            self._spawn(self.ws.close(code=code, message=_reason(reason)), name="ws-close")

    async def _write_loop(self) -> None:
        while True:
            payload = await self.out.get()
            self.out_bytes -= len(payload)
            try:
                if isinstance(payload, str):
                    await self.ws.send_str(payload)
                else:
                    await self.ws.send_bytes(payload)
            except (ConnectionError, RuntimeError):  # closed under us: the reader ends it
                return

    async def _shell_loop(self) -> None:
        while True:
            msg = await self.shell.get()
            try:
                await self.session.send_shell(self, msg)
            except (SandboxError, ChannelError, FrameError, Closed) as exc:
                closed = closed_for(exc)
                self.close(closed.code, str(closed))
                return

    def _decode(self, raw: Any) -> tuple[str, dict[str, Any]] | None:
        if raw.type == WSMsgType.TEXT:
            channel, msg = wire.from_text(raw.data)
        elif raw.type == WSMsgType.BINARY:
            channel, msg = wire.from_v1(raw.data) if self.v1 else wire.from_legacy_binary(raw.data)
        else:
            return None
        if channel == "iopub":
            raise wire.WireError("clients cannot send on iopub; use shell, control or stdin")
        return channel, msg

    async def serve(self) -> None:
        """Read the client's messages until it goes; shell ones keep their order."""
        async for raw in self.ws:
            try:
                decoded = self._decode(raw)
            except wire.WireError as exc:
                log.warning("gateway.bad_message", sandbox_id=self.session.sbx.id, error=str(exc))
                self.close(1007, f"not a Jupyter message: {exc}")
                return
            if decoded is None:
                continue
            channel, msg = decoded
            fill_header(msg["header"])
            try:
                if channel == "shell":
                    await self.shell.put(msg)
                else:
                    await self.session.send(self, channel, msg)
            except (SandboxError, ChannelError, FrameError, Closed) as exc:
                closed = closed_for(exc)
                self.close(closed.code, str(closed))
                return

    async def stop(self) -> None:
        self.closing = True
        tasks = list(self.tasks)
        for task in tasks:
            if task.get_name() != "ws-close":  # a close in progress finishes its handshake
                task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, RuntimeError):
                await task
