"""The relay between the host and the kernel's sockets, both ways.

- Host frames ``{"op": "jupyter", "channel": "shell"|"control"|"stdin", "msg": {...}}`` go to the
  kernel's sockets, signed with the kernel's session key (the host never sees the key).
- Every message of the kernel's iopub, shell, control and stdin sockets goes back to the host as
  ``{"op": "jupyter", "channel": ..., "msg": {header, parent_header, metadata, content,
  buffers}}``, except the answers to the agent's own requests (``Kernel.claim``).

Both directions pass through the ``ExecutionMeter`` (output caps, usage figures). A stream
message of ASCII text that fits its cap goes on with its text as the kernel packed it
(``streamwire``): only its header, parent and metadata are decoded here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from .kernel import CHANNELS, HOST_CHANNELS, Kernel
from .limits import ExecutionMeter
from .shared import codec, log, log_exception, protocol
from .streamwire import frame_parts, raw_stream
from .tasks import TaskSet

__all__ = ["Relay", "parse", "split_stream"]

Send = Callable[[dict[str, Any]], bool]
SendFrames = Callable[[list[tuple[bytes, memoryview]]], bool]
#: characters of one stream message to the host (at most 4 bytes each in UTF-8: one frame)
STREAM_PIECE = 1 << 20


class Relay:
    """Moves Jupyter messages between the host and the kernel; the frames to the host of a code
    context's kernel carry its id (the kernel's ``context_id``)."""

    def __init__(
        self,
        kernel: Kernel,
        meter: ExecutionMeter,
        send: Send,
        tasks: TaskSet,
        send_frames: SendFrames | None = None,
    ) -> None:
        self.kernel = kernel
        self.meter = meter
        self._send = send
        self._send_frames = send_frames
        self._tasks = tasks
        self._readers: list[asyncio.Task[None]] = []
        kernel.on_new_sockets = self.start

    def start(self) -> None:
        """Relay every kernel socket to the host (the kernel must be launched); again after a
        restart swapped in new sockets (the old ones' readers are cancelled first)."""
        for task in self._readers:
            task.cancel()
        sockets = self.kernel.sockets
        self._readers = [
            self._tasks.spawn(self._from_kernel(channel, sockets[channel]), name=f"relay-{channel}")
            for channel in CHANNELS
        ]

    def stop(self) -> None:
        """Cancel the socket readers (a code context stopped; the agent's stop cancels them with
        every task)."""
        for task in self._readers:
            task.cancel()
        self._readers = []

    def frame_handlers(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """The frame kinds this area takes from the host."""
        return {protocol.Frame.JUPYTER: self.on_jupyter_frame}

    # -- kernel -> host --------------------------------------------------------------------------

    async def _from_kernel(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        """Relay one kernel socket for as long as the agent runs."""
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                if not (channel == "iopub" and self._pass_stream(frames)):
                    self._pass_on(channel, [frame.bytes for frame in frames])
            except Exception:  # user code shapes these messages: one odd one must not stop the relay
                log_exception(f"dropping a {channel} message the relay could not handle:")

    def _pass_on(self, channel: str, parts: list[bytes]) -> None:
        """One multipart kernel message: parse, claim or cap, and send to the host."""
        wire = parse(self.kernel.session, parts)
        if wire is None:
            log(f"dropping an unparsable {channel} message")
            return
        if self.kernel.claim(channel, wire):
            return
        if self.meter.cap_and_measure(channel, wire):
            tag = {} if self.kernel.context_id is None else {"context": self.kernel.context_id}
            for piece in split_stream(wire):
                self._send({"op": protocol.Frame.JUPYTER, "channel": channel, **tag, "msg": piece})

    def _pass_stream(self, frames: list[zmq.Frame]) -> bool:
        """An iopub stream message of ASCII text that fits its cap, sent on with its text as the
        kernel packed it (or claimed); False: not one, for ``_pass_on``."""
        session = self.kernel.session
        if self._send_frames is None:
            return False
        try:
            _, msg_list = session.feed_identities(frames, copy=False)
            if len(msg_list) != 5:  # a signature, the four parts, no buffers
                return False
            header = session.unpack(msg_list[1].bytes)
            if not isinstance(header, dict) or header.get("msg_type") != "stream":
                return False
            stream = raw_stream(msg_list[4].buffer)
            if stream is None:
                return False
            parent, metadata = (session.unpack(frame.bytes) for frame in msg_list[2:4])
        except (KeyError, IndexError, TypeError, ValueError, UnicodeDecodeError):
            return False
        if not isinstance(parent, dict) or not isinstance(metadata, dict):
            return False
        if self.kernel.claim("iopub", {"parent_header": parent}):
            return True
        if not self.meter.stream_fits(parent, len(stream.text)):
            return False  # to be cut at the cap: the slow path cuts it
        max_bytes = self.kernel.config.max_frame_bytes
        try:
            parts = frame_parts(
                "iopub", header, parent, metadata, stream, STREAM_PIECE, max_bytes, self.kernel.context_id
            )
        except (codec.FrameTooLarge, TypeError, ValueError, OverflowError):  # the slow path says why
            return False
        self._send_frames(parts)
        return True

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


def parse(session: Any, parts: list[bytes]) -> dict[str, Any] | None:
    """A kernel message as the host gets it, or None if it is not one.

    The parts are read as they are (JSON, the session's packer), not through
    ``Session.deserialize``: its signature check and date parsing cost a copy and a pass over
    every byte under emulation, and buy nothing here (the host trusts nothing from the guest,
    and a date would only be turned back into the string it was)."""
    try:
        _, msg_list = session.feed_identities(parts, copy=True)
        if len(msg_list) < 5:
            return None
        header, parent, metadata, content = (session.unpack(p) for p in msg_list[1:5])
    except (KeyError, IndexError, TypeError, ValueError, UnicodeDecodeError):
        return None
    if not all(isinstance(m, dict) for m in (header, parent, metadata, content)):
        return None
    return {
        "header": header,
        "parent_header": parent,
        "metadata": metadata,
        "content": content,
        "buffers": [bytes(b) for b in msg_list[5:]],
    }


def split_stream(wire: dict[str, Any], chars: int = STREAM_PIECE) -> list[dict[str, Any]]:
    """A stream message longer than ``chars`` characters as several in a row, each one frame of
    bounded size (ipykernel sends all a cell printed between two flushes as one message, which
    can pass any frame limit); the pieces after the first get msg_ids of their own."""
    content = wire["content"]
    text = content.get("text")
    if wire["header"].get("msg_type") != "stream" or not isinstance(text, str) or len(text) <= chars:
        return [wire]
    pieces = []
    msg_id = str(wire["header"].get("msg_id", ""))
    for i, start in enumerate(range(0, len(text), chars)):
        header = wire["header"] if i == 0 else {**wire["header"], "msg_id": f"{msg_id}-{i}"}
        pieces.append({**wire, "header": header, "content": {**content, "text": text[start : start + chars]}})
    return pieces
