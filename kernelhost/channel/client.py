"""Host side of one VM's channel: an asyncio client of the guest agent.

The guest may be fully compromised, so nothing it sends is trusted: frames are size-checked by
the codec before buffering, every field is type-checked here, and any violation closes the
channel with ``violation=True`` (the owner then destroys the VM). A fault of the host's own code
while it handles a frame is not the guest's: it is logged with its traceback and the frame is
dropped, and the channel goes on.

Output is delivered to bounded per-request queues (``Subscription``); when a consumer falls
behind, the reader stops reading, so the guest blocks on its own writes instead of growing host
memory. A bash command started with ``start_bash`` on an agent that announced ``raw_output``
sends its output as raw ``bash_out`` frames, which are decoded here (``bash_output.py``) into
the same Jupyter ``stream`` messages an older agent sends, so nothing past the channel differs.
Everything else a channel carries goes to its listeners (``ChannelListener``), in the order they
were added, on the reader task: a listener must not block.

A guest restored from a saved state (a clone, a fork's child, a woken or rewound sandbox) or
re-attached after a service restart may still be handling requests of the channel it had
before, and answers them on this one. So a request id is a counter (each channel's from a
random start) with a tag, a keyed MAC of the counter, in its low bits: a reply to an id this
channel did not make but another channel of the service did (under the same ``id_key``) is
dropped quietly, as is a second answer to a request of this channel (seen once, right after a
service restart re-attached a VM: a frame its port sent twice across the reconnect): up to
``EXPIRED_KEPT`` of either, counted in ``stats``. A reply to an id no channel made is a
violation, and so is a flood of the others.

Every wait has a deadline: a request's ``timeout`` covers sending it (a guest that stopped
reading cannot hold the sender) as well as the reply, and closing never waits for a guest.

Errors::

    ChannelError
    ├── ChannelClosed           the channel is closed (VM gone, agent exited, closed by us)
    ├── ChannelTimeout          a deadline passed (also a TimeoutError)
    ├── AgentError              the agent answered ``ok: false``
    └── NotSupportedByAgent     the agent did not announce the capability an op needs
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from .bash_output import BashOutput
from .codec import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, FrameError, encode_frame
from .errors import (
    AgentError,
    ChannelClosed,
    ChannelError,
    ChannelTimeout,
    NotSupportedByAgent,
    ProtocolViolation,
)
from .messages import AgentInfo, JupyterMessage, Subscription, check_jupyter
from .protocol import CAPABILITY_OF, BashFrame, Capability, Frame, Op

__all__ = [
    "AgentClient",
    "AgentError",
    "AgentInfo",
    "ChannelClosed",
    "ChannelError",
    "ChannelListener",
    "ChannelTimeout",
    "JupyterMessage",
    "NotSupportedByAgent",
    "ProtocolViolation",
    "Subscription",
]

log = structlog.get_logger("kernelhost.channel")

#: bytes read at a time (and the reader's limit: it stops reading past twice that); bash output
#: comes in frames of up to 2 MiB, and every read costs the reader the same fixed work
READ_CHUNK = 1 << 18
#: how long closing may wait for the transport to finish (a guest that reads nothing gets none)
CLOSE_TIMEOUT = 1.0
#: ids of requests that ended without their reply, remembered so that a late reply is dropped
#: quietly while a reply to a request never made (or answered twice) is a protocol violation
EXPIRED_KEPT = 4096
#: frames dispatched before the reader yields to the event loop: a guest flooding tiny frames
#: gets its turn like every other channel, and never holds the loop for a whole 64 KiB read
FRAMES_PER_TURN = 32
#: request ids: ``counter << ID_TAG_BITS | tag``, each channel's counter from a random point of a
#: range wide enough that two channels of one guest do not meet (and every id JSON-safe)
ID_TAG_BITS = 20
ID_COUNTERS_FROM = 1 << 20
ID_COUNTERS_SPREAD = 1 << 31
#: the tags' key when the owner gives none: this process's channels know each other's ids
PROCESS_ID_KEY = secrets.token_bytes(32)


def request_id(key: bytes, counter: int) -> int:
    """The id of request ``counter`` of a channel keyed ``key``."""
    return counter << ID_TAG_BITS | _tag(key, counter)


def _tag(key: bytes, counter: int) -> int:
    digest = hmac.new(key, counter.to_bytes(8, "big"), hashlib.sha256).digest()
    return int.from_bytes(digest[:4], "big") & ((1 << ID_TAG_BITS) - 1)


CLOSED_BY_HOST = "closed by the host"


class ChannelListener:
    """Receives what a channel carries besides request replies; override what you need.

    Every hook runs on the channel's reader task, so it must not block. One that raises is
    logged with its traceback and never breaks the channel (the guest did nothing wrong).
    """

    def on_message(self, message: JupyterMessage) -> None:
        """Every Jupyter message from the guest, before it reaches a ``Subscription``."""

    def on_event(self, event: dict[str, Any]) -> None:
        """An ``{"op": "event"}`` frame (kernel died, kernel restarted)."""

    def on_net(self, frame: dict[str, Any]) -> None:
        """An ``{"op": "net"}`` frame of the guest's network tunnels."""

    def on_close(self, reason: str, violation: bool) -> None:
        """The channel closed: why, and whether the guest broke the protocol."""


@dataclass
class ChannelStats:
    """What the guest has sent on this channel."""

    bytes_in: int = 0
    frames_in: int = 0
    late_replies: int = 0
    earlier_replies: int = 0  # answers to requests of an earlier channel of the guest (dropped)
    repeated_replies: int = 0  # second answers to a request of this channel (dropped)


class AgentClient:
    """Connects to the channel socket, sends requests and Jupyter messages, routes replies."""

    def __init__(
        self,
        socket_path: Path | str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        queue_size: int = 1024,
        id_key: bytes | None = None,
    ) -> None:
        """``id_key``: the key of the request ids' tags, the same for every channel of the
        service (kept across its restarts), so that a guest that answers an earlier channel's
        request is known from one that invents it (the module's docstring)."""
        self.socket_path = Path(socket_path)
        self.max_frame_bytes = max_frame_bytes
        self.queue_size = queue_size
        self.info = AgentInfo()
        self.closed_reason: str | None = None
        self._listeners: list[ChannelListener] = []
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._id_key = id_key or PROCESS_ID_KEY
        first = ID_COUNTERS_FROM + secrets.randbelow(ID_COUNTERS_SPREAD)
        self._first_counter = first
        self._counters = itertools.count(first)
        self._last_counter = first - 1
        self._spare_replies = EXPIRED_KEPT  # answers to earlier channels' or answered requests
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._expired: OrderedDict[int, None] = OrderedDict()
        self._subs: dict[str, Subscription] = {}
        self._send_lock = asyncio.Lock()
        self.stats = ChannelStats()
        self.bash_output = BashOutput()  # the decoders of the runs started with raw output

    @property
    def connected(self) -> bool:
        return self._writer is not None and self.closed_reason is None

    # -- listeners -------------------------------------------------------------------------------

    def add_listener(self, listener: ChannelListener) -> None:
        """Add a listener; listeners are called in the order they were added."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: ChannelListener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _tell(self, hook: Callable[[ChannelListener], None], what: str) -> None:
        for listener in list(self._listeners):
            try:
                hook(listener)
            except ProtocolViolation:  # a listener found the guest broke its rules
                raise
            except Exception:
                log.exception(
                    "channel.listener_failed",
                    listener=type(listener).__name__,
                    hook=what,
                    socket=str(self.socket_path),
                )

    # -- connecting ------------------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:
        """Connect to the socket, retrying until it exists (QEMU creates it as it starts)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                async with asyncio.timeout(max(0.01, deadline - loop.time())):
                    self._reader, self._writer = await asyncio.open_unix_connection(
                        str(self.socket_path), limit=READ_CHUNK
                    )
                break
            except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
                if loop.time() >= deadline:
                    raise ChannelTimeout(
                        f"channel socket {self.socket_path} did not accept a connection within {timeout:.0f}s"
                    ) from None
                await asyncio.sleep(0.02)
        self._task = asyncio.create_task(self._read_loop(), name=f"channel-reader:{self.socket_path}")

    async def hello(self, timeout: float) -> AgentInfo:
        """Ask the agent who it is; answered once its kernel is ready."""
        reply = await self.request(Op.HELLO, timeout=timeout)
        self.info = AgentInfo.from_hello(reply)
        return self.info

    def supports(self, capability: Capability | str) -> bool:
        return str(capability) in self.info.capabilities

    # -- sending ---------------------------------------------------------------------------------

    async def request(self, op: Op | str, timeout: float, **fields: Any) -> dict[str, Any]:
        """Send ``{"op": op, "id": N, **fields}`` and wait for the matching reply; ``timeout``
        covers the send and the reply. Raises ``NotSupportedByAgent`` without sending anything
        when the agent did not announce what ``op`` needs."""
        needs = CAPABILITY_OF.get(op)  # type: ignore[arg-type]  # a str equals its Op
        if needs is not None and not self.supports(needs):
            raise NotSupportedByAgent(str(op), str(needs))
        if not self.connected:
            raise ChannelClosed(self.closed_reason or "channel not connected")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        counter = next(self._counters)
        self._last_counter = counter
        req_id = request_id(self._id_key, counter)
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending[req_id] = fut
        try:
            await self._send({"op": str(op), "id": req_id, **fields}, deadline)
            try:  # not wait_for: before 3.12 it can return a reply that came as it was cancelled
                async with asyncio.timeout_at(deadline):
                    reply = await fut
            except TimeoutError:
                raise ChannelTimeout(f"the agent did not answer {str(op)!r} within {timeout:g}s") from None
        finally:
            if self._pending.pop(req_id, None) is not None and (not fut.done() or fut.cancelled()):
                self._expire(req_id)  # given up on (a timeout cancels the future)
        if not reply.get("ok"):
            raise AgentError(f"agent refused {str(op)!r}: {reply.get('error')}")
        return reply

    def _expire(self, req_id: int) -> None:
        self._expired[req_id] = None
        while len(self._expired) > EXPIRED_KEPT:
            self._expired.popitem(last=False)

    async def start_bash(self, run_id: str, timeout: float, **fields: Any) -> dict[str, Any]:
        """Start a bash command (``Op.BASH``); its output comes back as Jupyter ``stream``
        messages whose parent is ``run_id``, whether the agent sends them so or (capability
        ``raw_output``) as raw bytes that are decoded here."""
        raw = self.supports(Capability.RAW_OUTPUT)
        if raw:
            fields["raw_output"] = True
            self.bash_output.expect(run_id)  # before the request: output may beat its reply
        try:
            return await self.request(Op.BASH, timeout=timeout, run_id=run_id, **fields)
        except ChannelTimeout:
            raise  # it may run all the same: its output stays welcome until its reply
        except ChannelError:
            self.bash_output.forget(run_id)
            raise

    def subscribe(self, msg_id: str) -> Subscription:
        sub = Subscription(self, msg_id, self.queue_size)
        self._subs[msg_id] = sub
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        if self._subs.get(sub.msg_id) is sub:
            del self._subs[sub.msg_id]

    async def send_jupyter(
        self, channel: str, msg: dict[str, Any], timeout: float | None = None, context: str | None = None
    ) -> None:
        """One Jupyter message to the main kernel, or to the kernel of code context ``context``
        (an agent with ``Capability.CONTEXTS``)."""
        if channel not in ("shell", "control", "stdin"):
            raise ValueError(f"cannot send on Jupyter channel {channel!r}")
        frame: dict[str, Any] = {"op": Frame.JUPYTER.value, "channel": channel, "msg": msg}
        if context is not None:
            if not self.supports(Capability.CONTEXTS):
                raise NotSupportedByAgent(f"jupyter to context {context!r}", str(Capability.CONTEXTS))
            frame["context"] = context
        await self._send(frame, self._deadline(timeout))

    async def send_net(self, frame: dict[str, Any], timeout: float | None = None) -> None:
        """Send one ``{"op": "net", ...}`` frame of a network tunnel."""
        if frame.get("op") != Frame.NET:
            raise ValueError(f"not a net frame: {frame!r:.100}")
        await self._send(frame, self._deadline(timeout))

    def _deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else asyncio.get_running_loop().time() + timeout

    async def _send(self, message: dict[str, Any], deadline: float | None) -> None:
        """Write one frame; waiting for the lock and for the guest to take the bytes is bounded
        by ``deadline``. A frame that could not drain in time stays queued in full (the stream
        stays intact), and later sends wait behind it under their own deadlines."""
        if not self.connected or self._writer is None:
            raise ChannelClosed(self.closed_reason or "channel not connected")
        data = encode_frame(message, self.max_frame_bytes)
        loop = asyncio.get_running_loop()
        left = None if deadline is None else max(0.0, deadline - loop.time())
        try:
            async with asyncio.timeout(left):
                await self._send_lock.acquire()
        except TimeoutError:
            raise ChannelTimeout(
                "the guest is not reading its channel: an earlier frame is still being sent"
            ) from None
        try:
            writer = self._writer
            if writer is None or not self.connected:
                raise ChannelClosed(self.closed_reason or "channel not connected")
            writer.write(data)
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                async with asyncio.timeout(left):
                    await writer.drain()
            except TimeoutError:
                raise ChannelTimeout(
                    f"the guest did not take a {len(data)}-byte frame in time; it is not reading its channel"
                ) from None
            except (ConnectionError, OSError) as exc:
                await self._shutdown(f"write failed: {exc}", violation=False)
                raise ChannelClosed(self.closed_reason or str(exc)) from exc
        finally:
            self._send_lock.release()

    # -- reading ---------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        assert self._reader is not None
        decoder = FrameDecoder(self.max_frame_bytes)
        reason, violation = "agent closed the channel", False
        try:
            while True:
                data = await self._reader.read(READ_CHUNK)
                if not data:
                    break
                self.stats.bytes_in += len(data)
                for n, (frame, cost) in enumerate(decoder.feed_costed(data), 1):
                    self.stats.frames_in += 1
                    await self._dispatch_checked(frame, cost)
                    if n % FRAMES_PER_TURN == 0:
                        await asyncio.sleep(0)
        except FrameError as exc:
            reason, violation = f"guest sent a bad frame: {exc}", True
        except ProtocolViolation as exc:
            reason, violation = str(exc), True
        except (ConnectionError, OSError) as exc:
            reason = f"channel read failed: {exc}"
        await self._shutdown(reason, violation, from_reader=True)

    async def _dispatch_checked(self, frame: dict[str, Any], size: int) -> None:
        """Dispatch one frame; the host's own faults are logged, not blamed on the guest."""
        try:
            await self._dispatch(frame, size)
        except ProtocolViolation:
            raise
        except Exception:
            log.exception(
                "channel.dispatch_failed", socket=str(self.socket_path), op=str(frame.get("op"))[:40]
            )

    async def _dispatch(self, frame: dict[str, Any], size: int = 0) -> None:
        op = frame["op"]
        if op == Frame.REPLY:
            self._on_reply(frame)
        elif op == Frame.BASH_OUT:
            stream = self.bash_output.decode(frame)
            if stream is not None:
                await self._deliver(stream)
        elif op == Frame.JUPYTER:
            message = check_jupyter(frame, size)
            if message.channel == "shell" and message.msg_type == BashFrame.REPLY and message.parent_id:
                for tail in self.bash_output.finish(message.parent_id):  # output before the end
                    await self._deliver(tail)
            await self._deliver(message)
        elif op == Frame.NET:
            self._tell(lambda listener: listener.on_net(frame), "on_net")
        elif op == Frame.EVENT:
            if not isinstance(frame.get("event"), str):
                raise ProtocolViolation(f"event frame without a string 'event': {frame!r:.200}")
            self._tell(lambda listener: listener.on_event(frame), "on_event")
        else:
            raise ProtocolViolation(f"guest sent unknown op {str(op)[:40]!r}")

    async def _deliver(self, message: JupyterMessage) -> None:
        """To the listeners, then to the subscription of its parent (waiting while it is full)."""
        self._tell(lambda listener: listener.on_message(message), "on_message")
        sub = self._subs.get(message.parent_id or "")
        if sub is not None:
            await sub.put(message)

    def _on_reply(self, frame: dict[str, Any]) -> None:
        req_id = frame.get("id")
        if not isinstance(req_id, int) or isinstance(req_id, bool) or not 0 < req_id < 1 << 63:
            raise ProtocolViolation(f"guest replied to request {req_id!r:.40}, never made")
        counter = req_id >> ID_TAG_BITS
        if request_id(self._id_key, counter) != req_id:
            raise ProtocolViolation(f"guest replied to request {req_id}, never made")
        earlier = not self._first_counter <= counter <= self._last_counter
        fut = None if earlier else self._pending.get(req_id)
        if fut is not None and not fut.done():
            fut.set_result(frame)
        elif not earlier and req_id in self._expired:
            del self._expired[req_id]  # the request gave up waiting; one late reply is fine
            self.stats.late_replies += 1
        elif self._spare_replies > 0:
            # made by the channel the guest had before this one (a saved state's requests in
            # flight), or answered again (a frame the guest's port sent twice across a host's
            # reconnect): dropped, as long as there are few
            self._spare_replies -= 1
            if earlier:
                self.stats.earlier_replies += 1
            else:
                self.stats.repeated_replies += 1
        else:
            raise ProtocolViolation(f"guest replied to {EXPIRED_KEPT} requests again or of earlier channels")

    # -- closing ---------------------------------------------------------------------------------

    async def _shutdown(self, reason: str, violation: bool, from_reader: bool = False) -> None:
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        self.bash_output.clear()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ChannelClosed(reason))
        for sub in list(self._subs.values()):
            with contextlib.suppress(asyncio.QueueFull):
                while sub.queue.full():
                    sub.queue.get_nowait()
                sub.queue.put_nowait(None)
        writer = self._writer
        if writer is not None:
            if writer.transport.get_write_buffer_size():
                # a guest that stopped reading would hold a graceful close forever: drop the rest
                writer.transport.abort()
            else:
                writer.close()
            with contextlib.suppress(ConnectionError, OSError, TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await writer.wait_closed()
        if self._task is not None and not from_reader:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._tell(lambda listener: listener.on_close(reason, violation), "on_close")

    async def close(self) -> None:
        """Close the channel (idempotent); the agent keeps the kernel and waits for a new host."""
        await self._shutdown(CLOSED_BY_HOST, violation=False)
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
