"""The virtio-serial port to the host, driven by one reader and one writer thread.

Threads, not the event loop: the port is a character device whose readiness the loop's selector
cannot be trusted with (it reports POLLHUP while no host is connected, and writes block), and a
blocking writer is the simplest way to keep output produced meanwhile for the next host.

Every write to the port holds the port's write lock, so frames stay whole: the writer's batches
of queued frames, and spliced frames (``write_spliced``), which the thread relaying a command's
output writes itself: a frame whose last value is ``size`` bytes of a pipe, written as its head
(length, the map up to the bin's header) and then moved from the pipe to the port by splice(2),
which the guest kernel's virtio console does without copying the pages. The agent never reads,
decodes or encodes those bytes, and no thread hands them to another.
"""

from __future__ import annotations

import asyncio
import errno
import glob
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from . import outpipe
from .shared import codec, log, log_exception

__all__ = ["Port", "find_port"]

FrameHandler = Callable[[dict[str, Any]], None]
_READ_SIZE = 1 << 16
_IDLE_RETRY = 0.1  # seconds between looks at a port with no host behind it
_JOIN_TIMEOUT = 2.0
_WRITE_BATCH = 4 << 20  # bytes of queued frames written in one go
_WRITE_BUFFERS = 256  # and at most this many of them (writev takes up to IOV_MAX, 1024)
_FULL_WAIT = 0.01  # the longest a writer waits on a full port before it looks for a stop again
_COPY_CHUNK = 1 << 20  # bytes read at a time where the port cannot splice
#: what the writer's own pipe holds (a spliced frame larger than that goes through it in parts)
_RELAY_BYTES = 2 << 20
#: splice(2) errors that mean "not for this pair of files": the writer copies instead
_NO_SPLICE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF})


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
            raise RuntimeError(
                f"virtio-serial port {name!r} did not appear within {timeout}s; check that the "
                "domain has a virtserialport channel of that name"
            )
        time.sleep(0.05)


class Port:
    """Frames to and from the host over one fd.

    While no host is connected the port reports POLLHUP and writes block; the reader then sleeps
    and retries, and the writer simply waits, so output produced meanwhile reaches the next host.
    Frames are handed to ``on_frame`` on the event loop's thread, in the order they arrived.
    """

    def __init__(
        self,
        fd: int,
        loop: asyncio.AbstractEventLoop,
        on_frame: FrameHandler,
        *,
        max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES,
        owns_fd: bool = True,
    ) -> None:
        self.fd = fd
        self.loop = loop
        self.on_frame = on_frame
        self.max_frame_bytes = max_frame_bytes
        self._owns_fd = owns_fd
        self._outbox: queue.Queue[bytes | tuple[bytes, memoryview] | None] = queue.Queue()
        self._write_lock = threading.Lock()  # held by whoever writes to the port
        self._can_splice = True  # until the port refuses it once
        self._relay: tuple[int, int] | None = None  # the writer's own pipe, for spliced frames
        self._failing = False  # log a failed write once per outage, not ten times a second
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # wakes the reader out of poll() at close
        self._threads = [
            threading.Thread(target=self._read_loop, name="port-reader", daemon=True),
            threading.Thread(target=self._write_loop, name="port-writer", daemon=True),
        ]

    @classmethod
    def open(
        cls, path: str, loop: asyncio.AbstractEventLoop, on_frame: FrameHandler, max_frame_bytes: int
    ) -> Port:
        """The port device at ``path``, opened (and later closed) by the agent."""
        return cls(os.open(path, os.O_RDWR), loop, on_frame, max_frame_bytes=max_frame_bytes)

    def start(self) -> None:
        """Start the reader and the writer thread."""
        for thread in self._threads:
            thread.start()

    def send(self, message: dict[str, Any]) -> bool:
        """Queue one frame for the host; False (and a log line) if it cannot be encoded."""
        try:
            frame = codec.encode_frame(message, self.max_frame_bytes)
        except (codec.FrameError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            # TypeError/ValueError/OverflowError are msgpack's: an odd type, a string with lone
            # surrogates (a file name that is not UTF-8), an integer over 64 bits.
            log(f"dropping an unsendable {message.get('op')!r} frame: {type(exc).__name__}: {exc}")
            return False
        self._outbox.put(frame)
        return True

    def send_frames(self, frames: list[tuple[bytes, memoryview]]) -> bool:
        """Queue frames already encoded as a head and a tail each (``streamwire.frame_parts``):
        written as they are, never joined into one buffer."""
        for frame in frames:
            self._outbox.put(frame)
        return True

    def write_spliced(self, head: codec.FrameHead, fd: int, size: int) -> bool:
        """Write a frame of ``head`` whose last entry is the next ``size`` bytes of the pipe
        ``fd`` (which must hold them), in turn with the writer's frames; blocks until it is
        written, so call it from a thread of its own, never the loop's. False if it could not
        be sent: too large (the bytes are still in the pipe), or the port closed."""
        try:
            data = head.head(size)
        except codec.FrameError as exc:
            log(f"dropping an unsendable spliced frame: {exc}")
            return False
        with self._write_lock:
            return self._write_all([memoryview(data)]) and self._splice_all(fd, size)

    def close(self) -> None:
        """Stop both threads; the fd is closed only if the agent opened it."""
        self._stopping.set()
        self._outbox.put(None)
        os.write(self._wake_w, b"x")
        alive = False
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(_JOIN_TIMEOUT)
                alive = alive or thread.is_alive()
        # a relay thread that writes holds the write lock; one that takes it later finds the
        # port stopping and writes nothing
        if not alive and self._write_lock.acquire(timeout=_JOIN_TIMEOUT):
            self._write_lock.release()
        else:
            alive = True
        if alive:  # a thread still uses the fds: leave them open rather than reuse them under it
            log(f"port threads did not stop within {_JOIN_TIMEOUT}s; leaving their fds open")
            return
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._close_relay()
        if self._owns_fd:
            os.close(self.fd)

    # -- reader ------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._read_frames()
                return
            except Exception:  # the agent is deaf without this thread: log, and read on
                log_exception("port reader failed; it reads on with a fresh decoder:")
                self._stopping.wait(_IDLE_RETRY)

    def _read_frames(self) -> None:
        """Decode frames from the host and hand them to the loop, until close."""
        decoder = codec.FrameDecoder(self.max_frame_bytes)
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        connected = False
        while not self._stopping.is_set():
            events = dict(poller.poll(None if connected else 1000))
            if self._wake_r in events or self._stopping.is_set():
                return
            revents = events.get(self.fd, 0)
            if not revents:
                continue
            if revents & select.POLLNVAL:
                log("port fd is no longer open; the reader stops")
                return
            hung_up = bool(revents & (select.POLLHUP | select.POLLERR))
            data = None if hung_up else self._read_once()
            if hung_up or data is None:
                if connected:
                    log("host disconnected")
                    connected = False
                decoder = codec.FrameDecoder(self.max_frame_bytes)
                self._stopping.wait(_IDLE_RETRY)
                continue
            if not data:  # nothing after all (a non-blocking fd, or a virtio port's EOF)
                self._stopping.wait(_IDLE_RETRY)
                continue
            if not connected:
                log("host connected")
                connected = True
            try:
                frames = decoder.feed(data)
            except codec.FrameError as exc:
                log("bad frame from host, resetting decoder:", exc)
                decoder = codec.FrameDecoder(self.max_frame_bytes)
                continue
            for frame in frames:
                if not self._deliver(frame):
                    return

    def _read_once(self) -> bytes | None:
        """Bytes from the host; b"" for nothing yet, None when the read failed like a hang-up."""
        try:
            return os.read(self.fd, _READ_SIZE)
        except BlockingIOError:
            return b""
        except OSError as exc:  # EIO and friends while the host goes away
            log("port read failed:", exc)
            return None

    def _deliver(self, frame: dict[str, Any]) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.on_frame, frame)
        except RuntimeError:  # the loop is closed: the agent is shutting down
            return False
        return True

    # -- writer ------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        """Write queued frames out whole, waiting out a host that is away. Frames queued while
        one was written leave together, in one system call of up to ``_WRITE_BATCH`` bytes."""
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            with self._write_lock:
                if not self._write_all(batch):
                    return

    def _write_all(self, batch: list[memoryview]) -> bool:
        """Write every byte of ``batch``; False if the port closed first."""
        while batch:
            if self._stopping.is_set():
                return False
            try:
                n = os.writev(self.fd, batch)
            except BlockingIOError:
                self._wait_writable()
                continue
            except OSError as exc:  # host gone mid-write: wait for the next one
                self._write_failed(exc)
                continue
            self._failing = False
            batch = _advance(batch, n)
        return True

    def _splice_all(self, fd: int, size: int) -> bool:
        """Move ``size`` bytes from the pipe ``fd`` to the port; False if the port closed first.

        They go through a pipe of the writer's own: the guest's virtio console (Linux 6.1)
        builds a scatterlist of as many entries as its source pipe has buffers but fills only
        those it takes, and the empty rest reaches the device (QEMU: "zero sized buffers are not
        allowed", and the port is dead) whenever the command wrote more after the size was
        taken. The writer's pipe holds exactly the frame's bytes, so the port takes all of it;
        a pipe-to-pipe splice moves the pages and copies nothing."""
        left = size
        while left:
            if self._stopping.is_set():
                return False
            try:
                moved = os.splice(fd, self._relay_pipe()[1], left)
            except BlockingIOError:
                moved = 0
            if not moved:  # the pipe ran dry: it never does (only this reads it), but keep the frame whole
                log(f"a pipe held {left} bytes fewer than announced; padding its frame")
                return self._write_all([memoryview(bytes(left))])
            if not self._to_port(moved):
                return False
            left -= moved
        return True

    def _relay_pipe(self) -> tuple[int, int]:
        """The writer's own pipe (read end, write end), made at first use."""
        if self._relay is None:
            self._relay = os.pipe2(os.O_CLOEXEC)
            outpipe.widen(self._relay[1], _RELAY_BYTES)
        return self._relay

    def _to_port(self, size: int) -> bool:
        """Move all ``size`` bytes the writer's pipe holds to the port; False if it closed first."""
        relay = self._relay_pipe()[0]
        while size:
            if self._stopping.is_set():
                self._close_relay()  # what it still holds belongs to no frame any more
                return False
            try:
                n = os.splice(relay, self.fd, size) if self._can_splice else self._copy(relay, size)
            except BlockingIOError:
                self._wait_writable()
                continue
            except OSError as exc:
                if self._can_splice and exc.errno in _NO_SPLICE:
                    log(f"the port cannot splice ({exc}); copying output instead")
                    self._can_splice = False
                else:
                    self._write_failed(exc)
                continue
            self._failing = False
            size -= n
        return True

    def _wait_writable(self) -> None:
        """Wait until the port takes bytes again (the host read some), at most ``_FULL_WAIT``
        seconds, so a stop is seen in time: a flood goes on as soon as there is room, not
        after a fixed sleep. A port whose host is away polls as hung up at once: then it is a
        plain wait, not a spin."""
        writable = select.poll()
        writable.register(self.fd, select.POLLOUT)
        events = writable.poll(_FULL_WAIT * 1000)
        if events and not any(ev & select.POLLOUT for _, ev in events):
            self._stopping.wait(_FULL_WAIT)

    def _copy(self, fd: int, left: int) -> int:
        """Read up to ``left`` bytes of the pipe and write them all to the port: what was moved."""
        data = os.read(fd, min(left, _COPY_CHUNK))
        if data and not self._write_all([memoryview(data)]):
            raise OSError(errno.EPIPE, "the port closed")
        return len(data)

    def _close_relay(self) -> None:
        if self._relay is not None:
            for fd in self._relay:
                os.close(fd)
            self._relay = None

    def _write_failed(self, exc: OSError) -> None:
        if not self._failing:
            log("write failed, retrying:", exc)
            self._failing = True
        self._stopping.wait(_IDLE_RETRY)

    def _next_batch(self) -> list[memoryview] | None:
        """The next frame and those queued behind it (up to _WRITE_BATCH bytes); None: stop."""
        data = self._outbox.get()
        batch: list[memoryview] = []
        size = 0
        while data is not None:
            for part in data if isinstance(data, tuple) else (data,):
                batch.append(memoryview(part))
                size += len(part)
            if size >= _WRITE_BATCH or len(batch) >= _WRITE_BUFFERS - 1:
                break
            try:
                data = self._outbox.get_nowait()
            except queue.Empty:
                break
        else:
            if not batch:
                return None
            self._outbox.put(None)  # stop after this batch
        return batch


def _advance(batch: list[memoryview], n: int) -> list[memoryview]:
    """What is left of ``batch`` once its first ``n`` bytes are written."""
    while batch and n >= len(batch[0]):
        n -= len(batch[0])
        batch = batch[1:]
    if batch and n:
        batch = [batch[0][n:], *batch[1:]]
    return batch
