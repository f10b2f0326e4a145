"""A command's output pipe read in large chunks: the first bytes at once, a flood coalesced.

A pipe holds 64 KiB by default, so a reader that takes what is there gets 64 KiB at a time and a
fast command costs one frame (and its fixed costs, under emulation milliseconds) per 64 KiB.
Here the pipe is widened to ``PIPE_BYTES`` and read without the event loop's stream machinery;
once output flows (the last chunk went out less than ``COALESCE_SECONDS`` ago) the reader waits
that long for more before it hands a chunk on, so a flood leaves in chunks of up to ``CHUNK``
bytes, while the first bytes after a quiet spell (a prompt, a progress line) go at once.

``pending`` (FIONREAD), ``widen`` and ``discard`` (bytes nobody will keep) serve ``rawout`` too,
which moves a command's output to the port without reading it.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import termios
import time
from collections.abc import AsyncIterator

__all__ = [
    "CHUNK",
    "COALESCE_SECONDS",
    "PIPE_BYTES",
    "chunks",
    "discard",
    "pending",
    "readable",
    "widen",
]

CHUNK = 1 << 20  # at most this much output per message
PIPE_BYTES = 1 << 20  # the kernel's default pipe-max-size: what an unprivileged process may ask
COALESCE_SECONDS = 0.005
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
_DEFAULT_PIPE_BYTES = 1 << 16


def widen(fd: int, size: int = PIPE_BYTES) -> int:
    """Make the pipe ``fd`` hold ``size`` bytes, or else ``PIPE_BYTES`` (past that the kernel
    asks for CAP_SYS_RESOURCE), if the kernel lets it: best effort. What it holds now."""
    for want in (size, PIPE_BYTES) if size > PIPE_BYTES else (size,):
        try:
            return int(fcntl.fcntl(fd, _F_SETPIPE_SZ, want))
        except OSError:
            continue
    try:
        return int(fcntl.fcntl(fd, _F_GETPIPE_SZ))
    except OSError:
        return _DEFAULT_PIPE_BYTES


async def readable(fd: int, timeout: float | None) -> bool:
    """Wait until ``fd`` can be read (or is at EOF); False if ``timeout`` passed first."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        async with asyncio.timeout(timeout):
            await ready
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


def _read_into(fd: int, view: memoryview, filled: int) -> tuple[int, bool]:
    """Read what ``fd`` holds into ``view`` from ``filled`` on: (bytes now filled, open)."""
    while filled < len(view):
        try:
            n = os.readv(fd, [view[filled:]])
        except BlockingIOError:
            return filled, True
        except InterruptedError:
            continue
        if not n:
            return filled, False
        filled += n
    return filled, True


async def chunks(
    fd: int, chunk: int = CHUNK, coalesce: float = COALESCE_SECONDS
) -> AsyncIterator[memoryview]:
    """The bytes of the pipe ``fd`` (made non-blocking and wide here) until its EOF.

    Each chunk is a view of one buffer that the next chunk reuses: the consumer is done with it
    before it asks for the next. One buffer, read into by the kernel, because under emulation
    every fresh megabyte costs its page faults and every copy a few milliseconds."""
    os.set_blocking(fd, False)
    widen(fd)
    buf = memoryview(bytearray(chunk))
    last_sent = 0.0
    open_ = True
    while open_:
        await readable(fd, None)
        filled, open_ = _read_into(fd, buf, 0)
        if open_ and time.monotonic() - last_sent < coalesce:
            # output is flowing: gather more for a moment, so a flood makes few large frames
            deadline = time.monotonic() + coalesce
            while open_ and filled < chunk and (left := deadline - time.monotonic()) > 0:
                if await readable(fd, left):
                    filled, open_ = _read_into(fd, buf, filled)
        if filled:
            last_sent = time.monotonic()
            yield buf[:filled]


def pending(fd: int) -> int:
    """How many bytes the pipe ``fd`` holds (FIONREAD)."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


def discard(fd: int, size: int) -> None:
    """Drop the next ``size`` bytes of the pipe ``fd`` (which holds them): spliced to /dev/null,
    or read where that cannot be done."""
    if size <= 0:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        while size > 0:
            try:
                moved = os.splice(fd, null, size)
            except OSError:
                moved = len(os.read(fd, min(size, CHUNK)))
            if not moved:
                return
            size -= moved
    except BlockingIOError:
        return  # nothing more in it after all
    finally:
        os.close(null)
