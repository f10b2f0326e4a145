"""kernelhost guest agent.

Runs inside the VM (started by /sbin/kernelhost-init under tini). It opens the virtio-serial port
``org.kernelhost.0``, starts ipykernel with jupyter_client, and relays:

- host frames ``{"op": "jupyter", "channel": "shell"|"control"|"stdin", "msg": {...}}`` to the
  kernel's sockets, signed with the kernel's session key (the host never sees the key);
- every message of the kernel's iopub, shell, control and stdin sockets back to the host as
  ``{"op": "jupyter", "channel": ..., "msg": {...}}``.

It also answers requests ``{"op": NAME, "id": N, ...}`` with ``{"op": "reply", "id": N, "ok": ...}``:
``hello`` (answered once the kernel is ready), ``ping``, ``interrupt`` and ``restart``; and it reports
``{"op": "event", "event": "kernel_died" | "kernel_restarted"}``.

Only what the guest image has is used: Python 3, jupyter_client, pyzmq, msgpack (distribution
packages) and ``codec.py``, the host's own frame codec copied in by the image build.
"""

from __future__ import annotations

import asyncio
import datetime
import glob
import os
import queue
import select
import sys
import threading
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.manager import AsyncKernelManager

import codec

AGENT_VERSION = 1
PORT_NAME = "org.kernelhost.0"
KERNEL_NAME = "kernelhost"
KERNEL_CWD = "/home/user"
READY_TIMEOUT = 120.0
MONITOR_INTERVAL = 0.5


def log(*parts: Any) -> None:
    print("kernelhost-agent:", *parts, file=sys.stderr, flush=True)


def find_port(name: str, timeout: float = 30.0) -> str:
    """Return the device path of the virtio-serial port called ``name`` (there is no udev)."""
    deadline = time.monotonic() + timeout
    while True:
        link = f"/dev/virtio-ports/{name}"
        if os.path.exists(link):
            return link
        for name_file in glob.glob("/sys/class/virtio-ports/*/name"):
            with open(name_file) as f:
                if f.read().strip() == name:
                    return "/dev/" + os.path.basename(os.path.dirname(name_file))
        if time.monotonic() > deadline:
            raise RuntimeError(f"virtio-serial port {name!r} did not appear within {timeout}s")
        time.sleep(0.05)


class Port:
    """The virtio-serial port, driven by one reader and one writer thread.

    While no host is connected the port reports POLLHUP and writes block; the reader then sleeps
    and retries, and the writer simply waits, so output produced meanwhile reaches the next host.
    """

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop, on_frame: Any) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.loop = loop
        self.on_frame = on_frame
        self.outbox: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read_loop, name="port-reader", daemon=True).start()
        threading.Thread(target=self._write_loop, name="port-writer", daemon=True).start()

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.outbox.put(codec.encode_frame(message))
        except codec.FrameError as exc:
            log("dropping unsendable message:", exc)

    def _read_loop(self) -> None:
        decoder = codec.FrameDecoder()
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        connected = False
        while True:
            events = poller.poll(1000)
            if not events:
                continue
            revents = events[0][1]
            if revents & select.POLLHUP:
                if connected:
                    log("host disconnected")
                    connected = False
                decoder = codec.FrameDecoder()
                time.sleep(0.1)
                continue
            data = os.read(self.fd, 1 << 16)
            if not data:
                time.sleep(0.1)
                continue
            if not connected:
                log("host connected")
                connected = True
            try:
                frames = decoder.feed(data)
            except codec.FrameError as exc:
                log("bad frame from host, resetting decoder:", exc)
                decoder = codec.FrameDecoder()
                continue
            for frame in frames:
                self.loop.call_soon_threadsafe(self.on_frame, frame)

    def _write_loop(self) -> None:
        while True:
            view = memoryview(self.outbox.get())
            while view:
                try:
                    n = os.write(self.fd, view)
                except BlockingIOError:
                    time.sleep(0.01)
                    continue
                except OSError as exc:  # host gone mid-write: wait for the next one
                    log("write failed, retrying:", exc)
                    time.sleep(0.1)
                    continue
                view = view[n:]


def _plain(value: Any) -> Any:
    """Make a deserialized Jupyter message msgpack-safe (dates become ISO strings)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, (memoryview, bytearray)):
        return bytes(value)
    if hasattr(value, "bytes") and not isinstance(value, (bytes, str)):  # zmq.Frame
        return bytes(value.bytes)
    return value


class Agent:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        # jupyter_client 7 defaults to a blocking zmq.Context; the relay needs asyncio sockets.
        self.km = AsyncKernelManager(kernel_name=KERNEL_NAME, context=zmq.asyncio.Context())
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.internal: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.ready = asyncio.Event()
        self.restarting = False
        self.kernel_info: dict[str, Any] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.port: Port | None = None

    # -- kernel --------------------------------------------------------------------------------

    async def start(self) -> None:
        os.makedirs(KERNEL_CWD, exist_ok=True)
        self.port = Port(find_port(PORT_NAME), self.loop, self.on_frame)
        t0 = time.monotonic()
        await self.km.start_kernel(cwd=KERNEL_CWD)
        for channel in ("iopub", "shell", "control", "stdin"):
            sock = getattr(self.km, f"connect_{channel}")()
            self.sockets[channel] = sock
            self.spawn(self.relay_kernel(channel, sock))
        await self.wait_kernel_ready()
        log(f"kernel ready in {time.monotonic() - t0:.2f}s")
        self.spawn(self.monitor_kernel())

    async def wait_kernel_ready(self) -> None:
        self.ready.clear()
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            try:
                reply = await self.request_kernel("shell", "kernel_info_request", {}, timeout=5.0)
            except asyncio.TimeoutError:
                continue
            self.kernel_info = reply["content"]
            self.ready.set()
            return
        raise RuntimeError(f"kernel did not answer kernel_info within {READY_TIMEOUT}s")

    async def request_kernel(
        self, channel: str, msg_type: str, content: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        """Send a message of the agent's own; its reply is not relayed to the host."""
        msg = self.km.session.msg(msg_type, content)
        fut: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        msg_id = msg["header"]["msg_id"]
        self.internal[msg_id] = fut
        try:
            await self.sockets[channel].send_multipart(self.km.session.serialize(msg))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.internal.pop(msg_id, None)

    async def relay_kernel(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        session = self.km.session
        while True:
            parts = await sock.recv_multipart(copy=True)
            try:
                _, msg_list = session.feed_identities(parts, copy=True)
                msg = session.deserialize(msg_list, content=True, copy=True)
            except Exception as exc:  # a kernel message we cannot parse is dropped, not fatal
                log(f"dropping unparsable {channel} message:", exc)
                continue
            parent_id = (msg.get("parent_header") or {}).get("msg_id")
            if parent_id in self.internal:
                if channel != "iopub" and not self.internal[parent_id].done():
                    self.internal[parent_id].set_result(msg)
                continue
            wire = {
                "header": _plain(msg["header"]),
                "parent_header": _plain(msg.get("parent_header") or {}),
                "metadata": _plain(msg.get("metadata") or {}),
                "content": _plain(msg.get("content") or {}),
                "buffers": [_plain(b) for b in msg.get("buffers") or []],
            }
            self.send({"op": "jupyter", "channel": channel, "msg": wire})

    async def monitor_kernel(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_INTERVAL)
            if self.restarting or await self.km.is_alive():
                continue
            code = None
            if self.km.has_kernel and self.km.provisioner is not None:
                code = await self.km.provisioner.poll()
            log("kernel died, exit code", code)
            self.send({"op": "event", "event": "kernel_died", "exit_code": code})
            await self.restart_kernel(reason="died")

    async def restart_kernel(self, reason: str) -> None:
        self.restarting = True
        try:
            await self.km.restart_kernel(now=True)
            await self.wait_kernel_ready()
        finally:
            self.restarting = False
        self.send({"op": "event", "event": "kernel_restarted", "reason": reason})

    # -- host ----------------------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        assert self.port is not None
        self.port.send(message)

    def spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log("task failed:", repr(task.exception()))

    def on_frame(self, frame: dict[str, Any]) -> None:
        op = frame["op"]
        if op == "jupyter":
            self.spawn(self.to_kernel(frame))
        elif isinstance(frame.get("id"), int) and hasattr(self, f"op_{op}"):
            self.spawn(self.answer(frame))
        else:
            self.send({"op": "reply", "id": frame.get("id"), "ok": False,
                       "error": f"unknown op {op!r}"})

    async def to_kernel(self, frame: dict[str, Any]) -> None:
        channel = frame.get("channel")
        msg = frame.get("msg")
        if channel not in ("shell", "control", "stdin") or not isinstance(msg, dict):
            log("ignoring jupyter frame for channel", channel)
            return
        if channel == "shell":
            await self.ready.wait()
        buffers = msg.get("buffers") or []
        parts = self.km.session.serialize(msg)
        await self.sockets[channel].send_multipart(parts + list(buffers))

    async def answer(self, frame: dict[str, Any]) -> None:
        handler = getattr(self, f"op_{frame['op']}")
        try:
            result = await handler(frame)
            reply = {"op": "reply", "id": frame["id"], "ok": True, **(result or {})}
        except Exception as exc:
            reply = {"op": "reply", "id": frame["id"], "ok": False,
                     "error": f"{type(exc).__name__}: {exc}"}
        self.send(reply)

    async def op_hello(self, frame: dict[str, Any]) -> dict[str, Any]:
        await self.ready.wait()
        return {"agent_version": AGENT_VERSION, "kernel_info": self.kernel_info,
                "boot_id": BOOT_ID}

    async def op_ping(self, frame: dict[str, Any]) -> dict[str, Any]:
        return {"ready": self.ready.is_set(), "kernel_alive": await self.km.is_alive()}

    async def op_interrupt(self, frame: dict[str, Any]) -> dict[str, Any]:
        await self.km.interrupt_kernel()
        return {}

    async def op_restart(self, frame: dict[str, Any]) -> dict[str, Any]:
        await self.restart_kernel(reason="requested")
        return {"kernel_info": self.kernel_info}

    # -- snapshots, clones and resumes -----------------------------------------------------------

    async def run_silent(self, code: str, timeout: float = 120.0) -> None:
        """Run code in the kernel without output, history or execution count (agent's own)."""
        reply = await self.request_kernel("shell", "execute_request", {
            "code": code, "silent": True, "store_history": False, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": False,
        }, timeout=timeout)
        content = reply.get("content", {})
        if content.get("status") != "ok":
            raise RuntimeError(f"{content.get('ename')}: {content.get('evalue')}")

    async def op_prepare_snapshot(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Warm the kernel before its VM is frozen into a template: import the template's heavy
        modules, collect garbage, and drop the guest's page cache so the RAM file holds less."""
        await self.ready.wait()
        t0 = time.monotonic()
        modules = [m for m in frame.get("preload", []) if isinstance(m, str) and m]
        for module in modules:
            if not all(part.isidentifier() for part in module.split(".")):
                raise ValueError(f"not a module name: {module!r}")
            await self.run_silent(f"import {module}")
        await self.run_silent("import gc as _kh_gc; _kh_gc.collect(); del _kh_gc")
        import gc

        gc.collect()
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return {"preloaded": modules, "seconds": round(time.monotonic() - t0, 3)}

    async def op_resumed(self, frame: dict[str, Any]) -> dict[str, Any]:
        """After a restore, clone or resume: set the clock from the host, mix fresh entropy into
        the kernel RNG and reseed it, and reseed Python's ``random`` (and numpy's global RNG) in
        the kernel, so no two sandboxes share a random stream or a stale clock."""
        t0 = time.monotonic()
        time_ns = frame.get("time_ns")
        if isinstance(time_ns, int):
            time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)
        entropy = frame.get("entropy")
        if isinstance(entropy, bytes) and entropy:
            _add_entropy(entropy)
        await self.ready.wait()
        await self.run_silent(
            "import random as _kh_r, sys as _kh_s\n"
            "_kh_r.seed()\n"
            "if 'numpy' in _kh_s.modules:\n"
            "    _kh_s.modules['numpy'].random.seed()\n"
            "del _kh_r, _kh_s", timeout=30.0)
        return {"seconds": round(time.monotonic() - t0, 4)}


RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


def _add_entropy(data: bytes) -> None:
    import fcntl
    import struct

    data = data[:512]
    pad = (-len(data)) % 4
    info = struct.pack("ii", len(data) * 8, len(data)) + data + b"\0" * pad
    fd = os.open("/dev/random", os.O_WRONLY)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, info)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


BOOT_ID = uuid.uuid4().hex


async def main() -> None:
    agent = Agent()
    await agent.start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
