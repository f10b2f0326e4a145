"""The relay between the host and the kernel's sockets, both ways.

- Host frames ``{"op": "jupyter", "channel": "shell"|"control"|"stdin", "msg": {...}}`` go to the
  kernel's sockets, signed with the kernel's session key (the host never sees the key).
- Every message of the kernel's iopub, shell, control and stdin sockets goes back to the host as
  ``{"op": "jupyter", "channel": ..., "msg": {header, parent_header, metadata, content,
  buffers}}``, except the answers to the agent's own requests (``Kernel.claim``).

Both directions pass through the ``ExecutionMeter`` (output caps, usage figures).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from .kernel import CHANNELS, HOST_CHANNELS, Kernel
from .limits import ExecutionMeter
from .shared import log, log_exception, protocol
from .tasks import TaskSet

__all__ = ["Relay", "plain"]

Send = Callable[[dict[str, Any]], bool]


class Relay:
    """Moves Jupyter messages between the host and the kernel."""

    def __init__(self, kernel: Kernel, meter: ExecutionMeter, send: Send, tasks: TaskSet) -> None:
        self.kernel = kernel
        self.meter = meter
        self._send = send
        self._tasks = tasks

    def start(self) -> None:
        """Relay every kernel socket to the host (the kernel must be launched)."""
        for channel in CHANNELS:
            sock = self.kernel.sockets[channel]
            self._tasks.spawn(self._from_kernel(channel, sock), name=f"relay-{channel}")

    def frame_handlers(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """The frame kinds this area takes from the host."""
        return {protocol.Frame.JUPYTER: self.on_jupyter_frame}

    # -- kernel -> host --------------------------------------------------------------------------

    async def _from_kernel(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        """Relay one kernel socket for as long as the agent runs."""
        while True:
            parts = await sock.recv_multipart(copy=True)
            try:
                self._pass_on(channel, parts)
            except Exception:  # user code shapes these messages: one odd one must not stop the relay
                log_exception(f"dropping a {channel} message the relay could not handle:")

    def _pass_on(self, channel: str, parts: list[bytes]) -> None:
        """One multipart kernel message: parse, claim or cap, and send to the host."""
        session = self.kernel.session
        try:
            _, msg_list = session.feed_identities(parts, copy=True)
            msg = session.deserialize(msg_list, content=True, copy=True)
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # dropped, not fatal
            log(f"dropping unparsable {channel} message: {type(exc).__name__}: {exc}")
            return
        if self.kernel.claim(channel, msg):
            return
        wire = {
            "header": _plain_map(msg.get("header")),
            "parent_header": _plain_map(msg.get("parent_header")),
            "metadata": _plain_map(msg.get("metadata")),
            "content": _plain_map(msg.get("content")),
            "buffers": [plain(b) for b in msg.get("buffers") or []],
        }
        if self.meter.cap_and_measure(channel, wire):
            self._send({"op": protocol.Frame.JUPYTER, "channel": channel, "msg": wire})

    # -- host -> kernel --------------------------------------------------------------------------

    def on_jupyter_frame(self, frame: dict[str, Any]) -> None:
        """A jupyter frame from the host, sent on to the kernel in a task of its own."""
        self._tasks.spawn(self.to_kernel(frame), name="to-kernel")

    async def to_kernel(self, frame: dict[str, Any]) -> None:
        """Check a host message, then sign it and send it on the kernel's socket."""
        channel = frame.get("channel")
        msg = frame.get("msg")
        if channel not in HOST_CHANNELS or not isinstance(msg, dict):
            log(
                f"ignoring jupyter frame for channel {channel!r:.40} "
                f"(a {type(msg).__name__} msg); the host may write shell, control or stdin maps"
            )
            return
        buffers = msg.get("buffers") or []
        if not isinstance(buffers, list) or not all(isinstance(b, bytes) for b in buffers):
            log(f"ignoring a {channel} message whose buffers are not a list of bytes")
            return
        if channel == "shell":
            await self.kernel.until_ready()
        self.meter.note_execute_request(channel, msg)
        # A message the session cannot serialize is the host's fault: say what is wrong and drop
        # it. Warning: jupyter_client warns before it cleans a message JSON cannot carry (NaN),
        # and a warnings filter set to "error" (the test suite's) raises that warning.
        try:
            parts = self.kernel.session.serialize(msg)
        except (KeyError, TypeError, ValueError, Warning) as exc:
            log(f"ignoring a {channel} message that cannot be serialized: {type(exc).__name__}: {exc}")
            return
        await self.kernel.sockets[channel].send_multipart(parts + list(buffers))


def _plain_map(value: Any) -> dict[str, Any]:
    converted = plain(value)
    return converted if isinstance(converted, dict) else {}


def plain(value: Any) -> Any:
    """Make a deserialized Jupyter message msgpack-safe (dates become ISO strings)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, (memoryview, bytearray)):
        return bytes(value)
    if hasattr(value, "bytes") and not isinstance(value, (bytes, str)):  # zmq.Frame
        return bytes(value.bytes)
    return value
