"""Host side of one VM's channel: an asyncio client of the guest agent.

The guest may be fully compromised, so nothing it sends is trusted: frames are size-checked by
the codec before buffering, every field is type-checked here, and any violation closes the
channel with ``ProtocolViolation`` (the owner then destroys the VM). Output is delivered to
bounded per-request queues; when a consumer falls behind, the reader stops reading, so the guest
blocks on its own writes instead of growing host memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .codec import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, FrameError, encode_frame

__all__ = [
    "AgentClient",
    "AgentError",
    "ChannelClosed",
    "ChannelError",
    "JupyterMessage",
    "ProtocolViolation",
    "Subscription",
]

JUPYTER_CHANNELS = frozenset({"iopub", "shell", "control", "stdin"})
READ_CHUNK = 1 << 16


class ChannelError(Exception):
    """Base of the channel's errors."""


class ChannelClosed(ChannelError):
    """The channel is closed (VM gone, agent exited, or closed by us)."""


class ProtocolViolation(ChannelError):
    """The guest broke the protocol; the channel is closed and the VM must not be trusted."""


class AgentError(ChannelError):
    """The agent answered a request with ``ok: false``."""


@dataclass(frozen=True)
class JupyterMessage:
    channel: str
    msg: dict[str, Any]
    size: int = 0  # wire bytes (estimated from the frames' share of the stream)

    @property
    def msg_type(self) -> str:
        return str(self.msg["header"]["msg_type"])

    @property
    def content(self) -> dict[str, Any]:
        return self.msg["content"]  # type: ignore[no-any-return]

    @property
    def parent_id(self) -> str | None:
        msg_id = self.msg["parent_header"].get("msg_id")
        return msg_id if isinstance(msg_id, str) else None


class Subscription:
    """Messages whose parent is one request, in arrival order, with backpressure."""

    def __init__(self, client: AgentClient, msg_id: str, maxsize: int,
                 max_bytes: int = 16 * 1024 * 1024) -> None:
        self._client = client
        self.msg_id = msg_id
        self.queue: asyncio.Queue[JupyterMessage | None] = asyncio.Queue(maxsize)
        # Bounded in bytes as well as in messages: a few huge frames must not pile up either.
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self._room = asyncio.Event()
        self._room.set()
        self.closed = False

    async def put(self, message: JupyterMessage) -> None:
        """Queue a message, waiting (backpressure on the channel) while the queue is full."""
        while (not self.closed and self.queued_bytes > 0
               and self.queued_bytes + message.size > self.max_bytes):
            self._room.clear()
            await self._room.wait()
        if self.closed:
            return
        await self.queue.put(message)
        self.queued_bytes += message.size

    async def get(self, timeout: float | None = None) -> JupyterMessage:
        """Next message; raises ChannelClosed if the channel closes, TimeoutError at the deadline."""
        item = await asyncio.wait_for(self.queue.get(), timeout)
        if item is None:
            raise ChannelClosed(self._client.closed_reason or "channel closed")
        self.queued_bytes = max(0, self.queued_bytes - item.size)
        self._room.set()
        return item

    def close(self) -> None:
        self.closed = True
        self._client._subs.pop(self.msg_id, None)
        # free space so a reader blocked on put() for this subscription moves on
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queued_bytes = 0
        self._room.set()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AgentClient:
    """Connects to the channel socket, sends requests and Jupyter messages, routes replies."""

    def __init__(
        self,
        socket_path: Path | str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        queue_size: int = 1024,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        on_message: Callable[[JupyterMessage], None] | None = None,
        on_close: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.max_frame_bytes = max_frame_bytes
        self.queue_size = queue_size
        self.on_event = on_event
        self.on_message = on_message
        self.on_close = on_close
        # ``{"op": "net"}`` frames of the guest's network tunnels (kernelhost/sandboxes/
        # network.py); dropped while nobody handles them. Runs on the reader: must not block.
        self.on_net: Callable[[dict[str, Any]], None] | None = None
        self.closed_reason: str | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._subs: dict[str, Subscription] = {}
        self._send_lock = asyncio.Lock()

    @property
    def connected(self) -> bool:
        return self._writer is not None and self.closed_reason is None

    async def connect(self, timeout: float) -> None:
        """Connect to the socket, retrying until it exists (QEMU creates it as it starts)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    str(self.socket_path), limit=READ_CHUNK
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if loop.time() >= deadline:
                    raise ChannelClosed(
                        f"channel socket {self.socket_path} did not accept a connection "
                        f"within {timeout:.0f}s"
                    ) from None
                await asyncio.sleep(0.02)
        self._task = asyncio.create_task(self._read_loop(), name=f"channel-reader:{self.socket_path}")

    async def request(self, op: str, timeout: float, **fields: Any) -> dict[str, Any]:
        """Send ``{"op": op, "id": N, **fields}`` and wait for the matching reply."""
        if not self.connected:
            raise ChannelClosed(self.closed_reason or "channel not connected")
        req_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            await self._send({"op": op, "id": req_id, **fields})
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(req_id, None)
        if not reply.get("ok"):
            raise AgentError(f"agent refused {op!r}: {reply.get('error')}")
        return reply

    def subscribe(self, msg_id: str) -> Subscription:
        sub = Subscription(self, msg_id, self.queue_size)
        self._subs[msg_id] = sub
        return sub

    async def send_jupyter(self, channel: str, msg: dict[str, Any]) -> None:
        if channel not in ("shell", "control", "stdin"):
            raise ValueError(f"cannot send on Jupyter channel {channel!r}")
        await self._send({"op": "jupyter", "channel": channel, "msg": msg})

    async def send_net(self, frame: dict[str, Any]) -> None:
        """Send one ``{"op": "net", ...}`` frame of a network tunnel."""
        if frame.get("op") != "net":
            raise ValueError(f"not a net frame: {frame!r:.100}")
        await self._send(frame)

    async def _send(self, message: dict[str, Any]) -> None:
        if not self.connected or self._writer is None:
            raise ChannelClosed(self.closed_reason or "channel not connected")
        data = encode_frame(message, self.max_frame_bytes)
        async with self._send_lock:
            self._writer.write(data)
            try:
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                await self._shutdown(f"write failed: {exc}", violation=False)
                raise ChannelClosed(self.closed_reason or str(exc)) from exc

    async def _read_loop(self) -> None:
        assert self._reader is not None
        decoder = FrameDecoder(self.max_frame_bytes)
        reason, violation = "agent closed the channel", False
        unattributed = 0  # stream bytes not yet accounted to a decoded frame
        try:
            while True:
                data = await self._reader.read(READ_CHUNK)
                if not data:
                    break
                unattributed += len(data)
                frames = decoder.feed(data)
                if frames:
                    share = max(1, (unattributed - decoder.buffered) // len(frames))
                    unattributed = decoder.buffered
                    for frame in frames:
                        await self._dispatch(frame, share)
        except FrameError as exc:
            reason, violation = f"guest sent a bad frame: {exc}", True
        except ProtocolViolation as exc:
            reason, violation = str(exc), True
        except (ConnectionError, OSError) as exc:
            reason = f"channel read failed: {exc}"
        except Exception as exc:  # never leave the channel half-open with waiters asleep
            reason, violation = f"channel reader failed: {exc!r}", True
        await self._shutdown(reason, violation, from_reader=True)

    async def _dispatch(self, frame: dict[str, Any], size: int = 0) -> None:
        op = frame["op"]
        if op == "reply":
            req_id = frame.get("id")
            fut = None
            if isinstance(req_id, int) and not isinstance(req_id, bool):
                fut = self._pending.get(req_id)
            if fut is not None and not fut.done():
                fut.set_result(frame)
            return
        if op == "jupyter":
            message = _check_jupyter(frame, size)
            if self.on_message is not None:
                self.on_message(message)
            sub = self._subs.get(message.parent_id or "")
            if sub is not None:
                await sub.put(message)
            return
        if op == "net":
            if self.on_net is not None:
                self.on_net(frame)
            return
        if op == "event":
            if not isinstance(frame.get("event"), str):
                raise ProtocolViolation(f"event frame without a string 'event': {frame!r:.200}")
            if self.on_event is not None:
                self.on_event(frame)
            return
        raise ProtocolViolation(f"guest sent unknown op {op!r}")

    async def _shutdown(self, reason: str, violation: bool, from_reader: bool = False) -> None:
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ChannelClosed(reason))
        for sub in list(self._subs.values()):
            with contextlib.suppress(asyncio.QueueFull):
                while sub.queue.full():
                    sub.queue.get_nowait()
                sub.queue.put_nowait(None)
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()
        if self._task is not None and not from_reader:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.on_close is not None:
            self.on_close(reason, violation)

    async def close(self) -> None:
        """Close the channel (idempotent); the agent keeps the kernel and waits for a new host."""
        await self._shutdown("closed by the host", violation=False)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _check_jupyter(frame: dict[str, Any], size: int = 0) -> JupyterMessage:
    channel = frame.get("channel")
    msg = frame.get("msg")
    if not isinstance(channel, str) or channel not in JUPYTER_CHANNELS or not isinstance(msg, dict):
        raise ProtocolViolation(f"malformed jupyter frame on channel {channel!r}")
    header, parent = msg.get("header"), msg.get("parent_header")
    if not isinstance(header, dict) or not isinstance(header.get("msg_type"), str):
        raise ProtocolViolation("jupyter message without a header or msg_type")
    if not isinstance(parent, dict) or not isinstance(msg.get("content"), dict):
        raise ProtocolViolation("jupyter message without a parent_header or content map")
    if not isinstance(msg.get("metadata", {}), dict):
        raise ProtocolViolation("jupyter message metadata is not a map")
    buffers = msg.get("buffers", [])
    if not isinstance(buffers, list) or not all(isinstance(b, bytes) for b in buffers):
        raise ProtocolViolation("jupyter message buffers are not a list of bytes")
    if parent.get("msg_id") is not None and not isinstance(parent.get("msg_id"), str):
        raise ProtocolViolation("jupyter parent msg_id is not a string")
    return JupyterMessage(str(channel), msg, size)
