"""The raw relay of one pipe (``rawout.relay``) on its own: every byte in order, spans bounded,
the cap shared, a closed pipe ends a gathering span at once, and the first output goes at once
whatever the clock reads."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
from kernelhost_agent.rawout import Budget, relay

pytestmark = pytest.mark.unit

JOIN = 20.0  # seconds; far under the hour-long gather the tests below would otherwise wait out


def _reader(spans: list[bytes]) -> Callable[[int, int], bool]:
    def write(fd: int, size: int) -> bool:
        data = b""
        while len(data) < size:
            data += os.read(fd, size - len(data))
        spans.append(data)
        return True

    return write


def _run(
    chunks: list[bytes], budget: Budget, chunk: int, settle: bool = False, **timing: float
) -> tuple[list[bytes], bool]:
    """Write ``chunks`` into a pipe and close it while ``relay`` moves it: the spans written, and
    whether the relay ended within ``JOIN`` seconds. With ``settle``, each chunk but the last is
    sent before the next is written, and the last is left a moment before the pipe closes."""
    r, w = os.pipe()
    stop_r, stop_w = os.pipe()
    spans: list[bytes] = []
    thread = threading.Thread(target=relay, args=(r, _reader(spans), budget, stop_r, chunk), kwargs=timing)
    thread.start()
    ended = False
    try:
        for n, data in enumerate(chunks, 1):
            os.write(w, data)
            if settle and n < len(chunks):
                sent = sum(map(len, chunks[:n]))
                _until(lambda: sum(map(len, spans)) == sent)  # noqa: B023 (called at once)
        if settle:
            time.sleep(0.3)  # the relay is gathering the last chunk now
        os.close(w)
        w = -1
        thread.join(JOIN)
        ended = not thread.is_alive()
    finally:  # a failed test stops its relay too: a thread left waiting would hold pytest's exit
        if thread.is_alive():
            os.write(stop_w, b"x")
            thread.join(JOIN)
        for fd in (r, w, stop_r, stop_w):
            if fd >= 0:
                os.close(fd)
    return spans, ended


def _until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + JOIN
    while not done():
        assert time.monotonic() < deadline, "the relay sent nothing"
        time.sleep(0.01)


def test_every_byte_arrives_in_order_in_bounded_spans() -> None:
    chunks = [bytes([65 + i % 26]) * 3000 for i in range(40)]
    spans, ended = _run(chunks, Budget(None), chunk=4096)
    assert ended
    assert b"".join(spans) == b"".join(chunks)
    assert max(len(s) for s in spans) <= 4096


def test_the_budget_caps_what_is_sent_and_the_pipe_is_still_drained() -> None:
    spans, ended = _run([b"y" * 50_000], Budget(10_000), chunk=8192)
    assert ended
    assert b"".join(spans) == b"y" * 10_000


def test_a_closed_pipe_ends_a_gathering_span_at_once() -> None:
    # Output keeps flowing (coalesce) and a span may gather for an hour: only the writer closing
    # the pipe can end the relay within JOIN seconds, with every byte sent.
    chunks = [b"a" * 100, b"b" * 100]
    spans, ended = _run(chunks, Budget(None), chunk=1 << 20, settle=True, coalesce=3600, gather=3600)
    assert ended, "the relay kept gathering after every writer had closed the pipe"
    assert b"".join(spans) == b"a" * 100 + b"b" * 100


def test_the_first_output_goes_at_once_whatever_the_clock_reads() -> None:
    # A coalesce window longer than the monotonic clock has run (a machine up for less than
    # it): no span has left yet, so nothing is flowing and the first bytes must not gather.
    r, w = os.pipe()
    stop_r, stop_w = os.pipe()
    spans: list[bytes] = []
    window = time.monotonic() + 3600
    timing = {"coalesce": window, "gather": 3600.0}
    args = (r, _reader(spans), Budget(None), stop_r, 1 << 20)
    thread = threading.Thread(target=relay, args=args, kwargs=timing)
    thread.start()
    try:
        os.write(w, b"first")
        _until(lambda: b"".join(spans) == b"first")
    finally:
        os.write(stop_w, b"x")
        thread.join(JOIN)
        for fd in (r, w, stop_r, stop_w):
            os.close(fd)
    assert not thread.is_alive()
