"""A scriptable fake of the guest agent, for unit tests of the host side without a VM.

``FakeAgent`` serves a UNIX socket (as QEMU does for the virtio-serial chardev), decodes the host's
frames with the real codec and records them. By default it answers every request
(``{"op": NAME, "id": N}``) with ``{"op": "reply", "id": N, "ok": True}``; ``replies[op]`` changes
that per op: ``"ok"``, ``"error"``, ``"ignore"`` or an ``async def handler(agent, frame)``.
``on_execute`` is called (as a task) with each ``execute_request`` the host sends on shell; the
helpers build and emit the Jupyter messages a kernel would send. Misbehaviour is sent with
``send`` / ``send_raw`` (anything, bypassing the encoder's checks), ``disconnect`` gives EOF.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import struct
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import msgpack

from kernelhost.channel import ChannelListener
from kernelhost.channel.codec import FrameDecoder, FrameError, encode_frame

WAIT = 5.0  # default deadline of every wait in the fake and the tests using it

Handler = Callable[["FakeAgent", dict[str, Any]], Awaitable[None]]


@contextlib.contextmanager
def short_socket_dir() -> Iterator[str]:
    """A fresh directory directly under /tmp: UNIX socket paths are limited to ~100 bytes."""
    path = tempfile.mkdtemp(prefix="kh-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def raw_frame(body: bytes) -> bytes:
    """A length-prefixed frame around any body, valid msgpack map or not."""
    return struct.pack(">I", len(body)) + body


def unchecked_frame(message: Any) -> bytes:
    """Frame any msgpack-able value, skipping ``encode_frame``'s checks (for protocol abuse)."""
    return raw_frame(msgpack.packb(message, use_bin_type=True))


def jupyter_msg(
    msg_type: str,
    content: dict[str, Any],
    parent: dict[str, Any] | str | None = None,
    *,
    metadata: dict[str, Any] | None = None,
    buffers: list[bytes] | None = None,
) -> dict[str, Any]:
    """A kernel-side Jupyter message; ``parent`` is the request's header or just its msg_id."""
    if isinstance(parent, str):
        parent = {"msg_id": parent, "msg_type": "execute_request"}
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "session": "kernel",
            "username": "kernel",
            "date": "2024-01-01T00:00:00+00:00",
            "version": "5.3",
        },
        "parent_header": dict(parent or {}),
        "metadata": metadata or {},
        "content": content,
        "buffers": buffers or [],
    }


def stream(text: str | list[str], name: str = "stdout") -> tuple[str, dict[str, Any]]:
    return "stream", {"name": name, "text": text}


def execute_result(
    data: dict[str, Any], count: int = 1, metadata: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    return "execute_result", {"data": data, "metadata": metadata or {}, "execution_count": count}


def display_data(data: dict[str, Any], metadata: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    return "display_data", {"data": data, "metadata": metadata or {}, "transient": {}}


def error(ename: str, evalue: str, traceback: list[str]) -> tuple[str, dict[str, Any]]:
    return "error", {"ename": ename, "evalue": evalue, "traceback": traceback}


class Closes(ChannelListener):
    """A listener of ``AgentClient`` that records how the channel closed (and its events)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.events: list[dict[str, Any]] = []
        self.event = asyncio.Event()

    def on_close(self, reason: str, violation: bool) -> None:
        self.calls.append((reason, violation))
        self.event.set()

    def on_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    async def wait(self, timeout: float = WAIT) -> tuple[str, bool]:
        """The first call's (reason, violation), once it has happened."""
        await asyncio.wait_for(self.event.wait(), timeout)
        return self.calls[0]


class FakeAgent:
    """One UNIX-socket server standing in for a VM's agent; accepts one host at a time."""

    def __init__(self, path: str, *, max_frame_bytes: int = 1 << 20) -> None:
        self.path = path
        self.max_frame_bytes = max_frame_bytes
        self.received: list[dict[str, Any]] = []
        self.replies: dict[str, str | Handler] = {}
        self.reply_fields: dict[str, dict[str, Any]] = {}
        self.on_execute: Handler | None = None
        self.executions: list[asyncio.Task[Any]] = []  # one on_execute task per execute_request
        self.connected = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.decode_error: FrameError | None = None
        self.frames_sent = 0  # frames whose write has drained (for backpressure tests)
        self._changed = asyncio.Condition()
        self._server: asyncio.AbstractServer | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._conn_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> FakeAgent:
        self._server = await asyncio.start_unix_server(self._on_connection, path=self.path)
        return self

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.disconnect()
        if self._conn_task is not None:
            self._conn_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._conn_task
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def disconnect(self) -> None:
        """Close the connection: the host reads EOF."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the host going away mid-write is not an error here

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._writer is not None:  # a virtio-serial port has one host end
            writer.close()
            return
        self._writer = writer
        self._conn_task = asyncio.current_task()
        self.connected.set()
        decoder = FrameDecoder(self.max_frame_bytes)
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                try:
                    frames = decoder.feed(data)
                except FrameError as exc:
                    self.decode_error = exc
                    break
                for frame in frames:
                    await self._handle(frame)
        except (ConnectionError, OSError):
            pass
        finally:
            self.disconnected.set()
            async with self._changed:
                self._changed.notify_all()

    async def _handle(self, frame: dict[str, Any]) -> None:
        self.received.append(frame)
        async with self._changed:
            self._changed.notify_all()
        op = frame["op"]
        if op == "jupyter":
            msg = frame.get("msg") or {}
            if (
                frame.get("channel") == "shell"
                and self.on_execute is not None
                and msg.get("header", {}).get("msg_type") == "execute_request"
            ):
                self.executions.append(self.spawn(self.on_execute(self, msg)))
            return
        if not isinstance(frame.get("id"), int):
            return
        # Like the real agent, answer from a task of its own: a host that stopped reading blocks
        # the fake's writes, not its reads.
        mode = self.replies.get(op, "ok")
        if mode == "ok":
            self.spawn(self.reply(frame, ok=True, **self.reply_fields.get(op, {})))
        elif mode == "error":
            self.spawn(self.reply(frame, ok=False, error=f"fake agent refuses {op!r}"))
        elif mode == "ignore":
            pass
        else:
            assert callable(mode), mode
            self.spawn(mode(self, frame))

    # -- observing the host ----------------------------------------------------------------------

    async def wait_for_frame(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = WAIT
    ) -> dict[str, Any]:
        """The first frame received (so far or later) that matches ``predicate``."""

        async def scan() -> dict[str, Any]:
            async with self._changed:
                while True:
                    for frame in self.received:
                        if predicate(frame):
                            return frame
                    await self._changed.wait()

        return await asyncio.wait_for(scan(), timeout)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = WAIT) -> None:
        """Wait until ``predicate()`` holds; it is re-checked whenever a frame arrives."""

        async def check() -> None:
            async with self._changed:
                await self._changed.wait_for(predicate)

        await asyncio.wait_for(check(), timeout)

    def requests(self, op: str) -> list[dict[str, Any]]:
        return [f for f in self.received if f["op"] == op]

    async def wait_for_request(self, op: str, timeout: float = WAIT) -> dict[str, Any]:
        return await self.wait_for_frame(lambda f: f["op"] == op, timeout)

    async def wait_for_execute(self, timeout: float = WAIT) -> dict[str, Any]:
        """The msg of the first execute_request received."""
        frame = await self.wait_for_frame(
            lambda f: (
                f["op"] == "jupyter"
                and f.get("msg", {}).get("header", {}).get("msg_type") == "execute_request"
            ),
            timeout,
        )
        return frame["msg"]  # type: ignore[no-any-return]

    def ops(self) -> list[str]:
        """The ops received, in order."""
        return [f["op"] for f in self.received]

    # -- sending ---------------------------------------------------------------------------------

    async def send_raw(self, data: bytes) -> None:
        if not self.connected.is_set():  # the host's connect() can return before we accept
            await asyncio.wait_for(self.connected.wait(), WAIT)
        if self._writer is None:
            raise ConnectionError("no host connected to the fake agent")
        self._writer.write(data)
        await self._writer.drain()

    async def send(self, message: dict[str, Any]) -> None:
        await self.send_raw(encode_frame(message, self.max_frame_bytes))
        self.frames_sent += 1

    async def reply(self, request: dict[str, Any], ok: bool = True, **fields: Any) -> None:
        await self.send({"op": "reply", "id": request["id"], "ok": ok, **fields})

    async def event(self, event: str, **fields: Any) -> None:
        await self.send({"op": "event", "event": event, **fields})

    async def emit(self, channel: str, msg: dict[str, Any]) -> None:
        await self.send({"op": "jupyter", "channel": channel, "msg": msg})

    async def iopub(self, request: dict[str, Any], msg_type: str, content: dict[str, Any]) -> None:
        await self.emit("iopub", jupyter_msg(msg_type, content, request["header"]))

    async def status(self, request: dict[str, Any], state: str) -> None:
        await self.iopub(request, "status", {"execution_state": state})

    async def execute_reply(
        self, request: dict[str, Any], status: str = "ok", execution_count: Any = 1, **content: Any
    ) -> None:
        await self.emit(
            "shell",
            jupyter_msg(
                "execute_reply",
                {"status": status, "execution_count": execution_count, **content},
                request["header"],
            ),
        )

    async def run_execute(
        self,
        request: dict[str, Any],
        outputs: Sequence[tuple[str, dict[str, Any]]] = (),
        *,
        status: str = "ok",
        execution_count: int = 1,
        reply_before_idle: bool = False,
    ) -> None:
        """What a kernel sends for one execute_request: busy, input, outputs, idle and reply."""
        await self.status(request, "busy")
        await self.iopub(
            request,
            "execute_input",
            {"code": request["content"].get("code", ""), "execution_count": execution_count},
        )
        for msg_type, content in outputs:
            await self.iopub(request, msg_type, content)
        if reply_before_idle:
            await self.execute_reply(request, status, execution_count)
            await self.status(request, "idle")
        else:
            await self.status(request, "idle")
            await self.execute_reply(request, status, execution_count)

    async def flood(self, parent_msg_id: str, count: int, size: int) -> None:
        """``count`` stream messages of ``size`` characters each, numbered in ``metadata``."""
        text = "x" * size
        parent = {"msg_id": parent_msg_id, "msg_type": "execute_request"}
        for i in range(count):
            msg = jupyter_msg("stream", {"name": "stdout", "text": text}, parent, metadata={"seq": i})
            await self.emit("iopub", msg)


def scripted(outputs: Sequence[tuple[str, dict[str, Any]]] = (), **kwargs: Any) -> Handler:
    """An ``on_execute`` handler that runs ``FakeAgent.run_execute`` with these outputs."""

    async def handler(agent: FakeAgent, request: dict[str, Any]) -> None:
        await agent.run_execute(request, list(outputs), **kwargs)

    return handler


async def wait_until_stalled(
    progress: Callable[[], int], task: asyncio.Task[Any], *, quiet: float = 0.3, timeout: float = 10.0
) -> int:
    """Wait until ``progress()`` stops changing for ``quiet`` seconds while ``task`` still runs.

    Observing that something does *not* happen needs a quiet period; the overall wait has a
    deadline. Fails if ``task`` finishes (nothing held it back).
    """

    async def watch() -> int:
        last = progress()
        while True:
            done, _ = await asyncio.wait({task}, timeout=quiet)
            if done:
                raise AssertionError(f"{task.get_name()} finished: it was never held back")
            now = progress()
            if now == last:
                return now
            last = now

    return await asyncio.wait_for(watch(), timeout)
