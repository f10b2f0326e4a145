"""A command's output moved to the port raw: spliced, never read, decoded or encoded here.

One thread per pipe (``relay``) waits for output in poll(2), lets a flood gather into spans of
up to ``chunk`` bytes (the first bytes after a quiet spell go at once), and writes each span as
one frame itself (``Port.write_spliced``: the frame's head, then the bytes spliced from the pipe
to the port). Threads, not the event loop: under emulation each turn of the loop's machinery
costs milliseconds, and a span took several (a wait for the pipe, a hand-over to the port's
writer and back); a thread waits in one system call and hands nothing over.

The output cap (``Budget``) is shared by a run's stdout and stderr; past it the relay drains the
pipe into /dev/null, so the command never blocks on output nobody will keep.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import threading
import time
from collections.abc import Callable
from typing import IO

from .outpipe import COALESCE_SECONDS, PIPE_BYTES, discard, pending, widen
from .shared import log_exception

__all__ = ["GATHER_SECONDS", "Budget", "Write", "relay", "run"]

GATHER_SECONDS = 0.05  # the longest a flowing output is held to make a span of ``chunk`` bytes
_MIN_WAIT = 0.001

#: (the pipe, how many of its bytes) -> whether the frame was written
Write = Callable[[int, int], bool]


class Budget:
    """What a run may still send (None: no cap), shared by the relays of its two pipes."""

    def __init__(self, limit: int | None) -> None:
        self._left = limit
        self._lock = threading.Lock()

    def take(self, size: int) -> int:
        """Take up to ``size`` bytes of the budget: how many may be sent."""
        if self._left is None:
            return size
        with self._lock:
            size = min(size, self._left)
            self._left -= size
            return size


async def run(pipe: IO[bytes], write: Write, budget: Budget, chunk: int, name: str) -> None:
    """Relay ``pipe`` to its EOF in a thread of its own; cancelled, the thread is stopped, and
    the pipe is closed once the thread no longer uses it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    stop_r, stop_w = os.pipe2(os.O_CLOEXEC)

    def main() -> None:
        try:
            relay(pipe.fileno(), write, budget, stop_r, chunk)
        except Exception:
            log_exception(f"{name} failed:")
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the agent is stopping
                loop.call_soon_threadsafe(_resolve, done)

    def close(_: object = None) -> None:
        pipe.close()
        os.close(stop_r)
        os.close(stop_w)

    threading.Thread(target=main, name=name, daemon=True).start()
    try:
        await asyncio.shield(done)
    finally:
        if done.done():
            close()
        else:  # cancelled: stop the thread, and close what it uses once it has stopped
            os.write(stop_w, b"x")
            done.add_done_callback(close)


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def relay(
    fd: int,
    write: Write,
    budget: Budget,
    stop_fd: int,
    chunk: int,
    coalesce: float = COALESCE_SECONDS,
    gather: float = GATHER_SECONDS,
) -> None:
    """Move the output of the pipe ``fd`` with ``write``, in spans of up to ``chunk`` bytes,
    until its EOF or until ``stop_fd`` is readable.

    The pipe is widened to hold two spans, so the command writes on while one leaves. While
    output flows (the last span left less than ``coalesce`` seconds ago) it gathers for up to
    ``gather`` seconds, while the pipe keeps growing, towards ``chunk`` bytes or half what the
    pipe holds; each wait is sized by the rate the pipe fills at, so a span costs a few."""
    os.set_blocking(fd, False)
    target = max(1, min(chunk, widen(fd, max(PIPE_BYTES, 2 * chunk)) // 2))
    output, stop = select.poll(), select.poll()
    output.register(fd, select.POLLIN)
    output.register(stop_fd, select.POLLIN)
    stop.register(stop_fd, select.POLLIN)
    stop.register(fd, 0)  # POLLHUP only: every writer closed it, so nothing more will come
    last = -math.inf  # no span yet: the first output goes at once, whatever the clock reads
    while True:
        held = pending(fd)
        if not held:
            if any(ready == stop_fd for ready, _ in output.poll()):
                return
            held = pending(fd)
            if not held:  # readable and empty: every writer has closed it
                return
        if time.monotonic() - last < coalesce:
            held = _gather(fd, held, target, stop, coalesce, time.monotonic() + gather)
            if held < 0:
                return
        span = min(held, chunk)
        take = budget.take(span)
        sent = take > 0 and write(fd, take)
        discard(fd, span - take if sent else span)
        last = time.monotonic()


def _gather(fd: int, held: int, target: int, stop: select.poll, step: float, deadline: float) -> int:
    """Let the pipe fill towards ``target`` bytes until ``deadline``, while it grows and has a
    writer: what it holds then, or -1 if told to stop meanwhile."""
    rate = 0.0  # bytes a second, as last seen
    while held < target:
        now = time.monotonic()
        wait = min(deadline - now, (target - held) / rate if rate else step)
        if wait <= 0:
            break
        events = dict(stop.poll(max(wait, _MIN_WAIT) * 1000))
        if events.pop(fd, 0):  # the command closed its output: what is there is all
            return pending(fd) if not events else -1
        if events:
            return -1
        more = pending(fd)
        if more <= held:  # the command paused (or the pipe is full): send what is there
            break
        rate = (more - held) / max(time.monotonic() - now, _MIN_WAIT)
        held = more
    return held
