"""The host's end of a real guest agent, for the agent's unit tests.

``HostEnd`` holds the test's side of a socketpair whose other side is the agent's "virtio port".
It speaks the real codec: ``request`` sends ``{"op", "id", ...}`` and awaits the reply,
``execute`` sends an execute_request on shell and collects what comes back for it, and the
``send_raw``/``send_unchecked`` helpers send what a broken host would. Every wait has a deadline
(``WAIT`` seconds unless told otherwise).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import socket
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kernelhost.channel import protocol
from kernelhost.channel.codec import FrameDecoder, encode_frame

WAIT = 10.0  # seconds: the deadline of every wait of the tests on the agent
SESSION = uuid.uuid4().hex  # the "client" session of the host's Jupyter messages


def raw_frame(body: bytes) -> bytes:
    """A length-prefixed frame around any body, valid msgpack map or not."""
    return struct.pack(">I", len(body)) + body


@dataclass
class Execution:
    """What came back for one execute_request."""

    msg_id: str
    iopub: list[dict[str, Any]] = field(default_factory=list)
    reply: dict[str, Any] = field(default_factory=dict)

    def stream(self, name: str = "stdout") -> str:
        return "".join(
            m["content"]["text"]
            for m in self.iopub
            if m["header"]["msg_type"] == "stream" and m["content"].get("name") == name
        )

    def of_type(self, msg_type: str) -> list[dict[str, Any]]:
        return [m for m in self.iopub if m["header"]["msg_type"] == msg_type]


class HostEnd:
    """The test's side of the channel."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.odd_replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()  # ids we did not send
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.net: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._jupyter: dict[str, asyncio.Queue[tuple[str, dict[str, Any]]]] = collections.defaultdict(
            asyncio.Queue
        )
        self.sent_parents: set[str] = set()  # msg_ids (and bash run_ids) the host sent
        self.jupyter_log: list[tuple[str, dict[str, Any]]] = []
        #: the ``context`` of the frame each Jupyter message (by its msg_id) came in (None: the
        #: main kernel's, whose frames carry none)
        self.context_of: dict[str, Any] = {}
        self.bash_out_log: list[dict[str, Any]] = []
        self._reader_task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        reader, self._writer = await asyncio.open_connection(sock=self._sock)
        self._reader_task = asyncio.create_task(self._read(reader))

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(self._writer.wait_closed(), WAIT)
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decoder = FrameDecoder()
        while data := await reader.read(1 << 16):
            for frame in decoder.feed(data):
                self._route(frame)

    def _route(self, frame: dict[str, Any]) -> None:
        op = frame["op"]
        if op == protocol.Frame.REPLY:
            request_id = frame.get("id")
            fut = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
            if fut is not None and not fut.done():
                fut.set_result(frame)
            else:
                self.odd_replies.put_nowait(frame)
        elif op == protocol.Frame.EVENT:
            self.events.put_nowait(frame)
        elif op == protocol.Frame.NET:
            self.net.put_nowait(frame)
        elif op == protocol.Frame.BASH_OUT:  # raw output of a run, in order with its messages
            self.bash_out_log.append(frame)
            self._jupyter[frame["run_id"]].put_nowait(("bash_out", frame))
        elif op == protocol.Frame.JUPYTER:
            msg = frame["msg"]
            self.jupyter_log.append((frame["channel"], msg))
            self.context_of[msg["header"].get("msg_id", "")] = frame.get("context")
            parent = msg["parent_header"].get("msg_id", "")
            self._jupyter[parent].put_nowait((frame["channel"], msg))
        else:
            raise AssertionError(f"the agent sent a frame of unknown op {op!r}")

    # -- sending -----------------------------------------------------------------------------

    async def send_raw(self, data: bytes) -> None:
        assert self._writer is not None
        self._writer.write(data)
        await asyncio.wait_for(self._writer.drain(), WAIT)

    async def send(self, message: dict[str, Any]) -> None:
        await self.send_raw(encode_frame(message))

    async def send_unchecked(self, value: Any) -> None:
        """Frame any msgpack-able value, skipping the encoder's checks."""
        await self.send_raw(raw_frame(msgpack.packb(value, use_bin_type=True)))

    async def request(self, op: str, timeout: float = WAIT, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply (ok or not)."""
        request_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        try:
            await self.send({"op": op, "id": request_id, **fields})
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(request_id, None)

    async def ok(self, op: str, timeout: float = WAIT, **fields: Any) -> dict[str, Any]:
        """A request that must succeed."""
        reply = await self.request(op, timeout, **fields)
        assert reply["ok"] is True, reply
        return reply

    async def refused(self, op: str, **fields: Any) -> str:
        """A request that must be answered ok=False; its error."""
        reply = await self.request(op, **fields)
        assert reply["ok"] is False, reply
        error = reply["error"]
        assert isinstance(error, str)
        return error

    async def odd_reply(self, timeout: float = WAIT) -> dict[str, Any]:
        """The next reply whose id was none of this host's requests."""
        return await asyncio.wait_for(self.odd_replies.get(), timeout)

    async def ping_until_answered(self, timeout: float = WAIT) -> dict[str, Any]:
        """Ping until a reply comes: after garbage, the first pings may be eaten by the decoder
        the agent resets."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                return await self.ok(protocol.Op.PING, timeout=0.5)
            except TimeoutError:
                if loop.time() > deadline:
                    raise

    # -- Jupyter -------------------------------------------------------------------------------

    def jupyter_msg(
        self, msg_type: str, content: dict[str, Any], metadata: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        msg = protocol.jupyter_message(msg_type, content, SESSION, metadata=metadata)
        self.sent_parents.add(msg["header"]["msg_id"])
        return msg

    async def send_jupyter(self, channel: str, msg: dict[str, Any], context: str | None = None) -> None:
        """One Jupyter message to the main kernel, or (``context``) to that code context's."""
        tag = {} if context is None else {"context": context}
        await self.send({"op": protocol.Frame.JUPYTER, "channel": channel, **tag, "msg": msg})

    async def next_message(self, parent_id: str, timeout: float = WAIT) -> tuple[str, dict[str, Any]]:
        """The next Jupyter message (channel, msg) whose parent is ``parent_id``; a bash_out
        frame of the run ``parent_id`` comes as ("bash_out", frame)."""
        return await asyncio.wait_for(self._jupyter[parent_id].get(), timeout)

    async def execute(
        self,
        code: str,
        *,
        metadata: dict[str, Any] | None = None,
        allow_stdin: bool = False,
        timeout: float = WAIT,
        context: str | None = None,
    ) -> Execution:
        """Run one cell (in the main kernel, or a code context's) and collect its iopub
        messages up to idle and its execute_reply."""
        msg_id = await self.start(code, metadata=metadata, allow_stdin=allow_stdin, context=context)
        return await self.collect(msg_id, timeout)

    async def start(
        self,
        code: str,
        *,
        metadata: dict[str, Any] | None = None,
        allow_stdin: bool = False,
        context: str | None = None,
    ) -> str:
        """Send one cell as a notebook does; its msg_id (``collect`` gathers what it gives)."""
        msg = self.jupyter_msg(
            "execute_request",
            {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": allow_stdin,
                "stop_on_error": True,
            },
            metadata,
        )
        await self.send_jupyter("shell", msg, context)
        return str(msg["header"]["msg_id"])

    async def collect(self, msg_id: str, timeout: float = WAIT) -> Execution:
        """Messages for ``msg_id`` until both the iopub idle and the shell reply are in."""
        result = Execution(msg_id)
        idle = False
        try:
            async with asyncio.timeout(timeout):
                while not (idle and result.reply):
                    channel, msg = await self._jupyter[msg_id].get()
                    if channel == "shell":
                        result.reply = msg
                    elif channel == "iopub":
                        result.iopub.append(msg)
                        state = msg["content"].get("execution_state")
                        idle = idle or (msg["header"]["msg_type"] == "status" and state == "idle")
        except TimeoutError:
            got = [m["header"]["msg_type"] for m in result.iopub]
            raise AssertionError(
                f"no idle and execute_reply for {msg_id} within {timeout}s; iopub so far: {got}, "
                f"reply: {bool(result.reply)}"
            ) from None
        return result

    def strays(self) -> list[tuple[str, dict[str, Any]]]:
        """Jupyter messages whose parent the host never sent (the agent's own requests')."""
        return [
            (channel, msg)
            for channel, msg in self.jupyter_log
            if msg["parent_header"].get("msg_id") not in self.sent_parents and msg["parent_header"]
        ]
