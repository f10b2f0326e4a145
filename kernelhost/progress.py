"""Progress of a build through known stages: a live bar on a terminal, plain lines elsewhere.

    with Stages("snapshot python", ["boot", "kernel ready", "warm-up", "freeze"]) as bar:
        bar.stage("boot")
        ...

On a terminal one line is redrawn in place (``[snapshot python] ███████░░░░ 2/4 kernel ready
0:07``), its clock ticking between stages; anything printed through ``echo`` (or written through
``TerminalAware``) goes above it. Elsewhere (CI logs, the service under a supervisor) each stage
is one plain line, handed to ``on_line``, or to ``on_stage`` for structured logs.

Standard library only: ``guest-image/build.py`` loads this file by path before the project's
virtualenv exists (it is not part of the guest image key).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any

__all__ = ["Stages", "TerminalAware", "format_bytes"]

#: (n, total, stage, detail, elapsed seconds) for each stage entered, and once at the end with
#: stage "done" or "failed" (n == total on success); only when there is no terminal
OnStage = Callable[[int, int, str, str, float], None]

_lock = threading.RLock()  # one terminal: bars and the lines written above them
_active: list[Stages] = []
_drawn: dict[int, int] = {}  # id(stream) -> width of the bar line now on screen


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Stages:
    """A build's progress through ``stages`` (names, in order)."""

    def __init__(
        self,
        title: str,
        stages: list[str],
        *,
        stream: IO[str] | None = None,
        tty: bool | None = None,
        on_line: Callable[[str], None] | None = None,
        on_stage: OnStage | None = None,
        width: int = 24,
        tick: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not stages:
            raise ValueError("Stages needs at least one stage")
        self.title = title
        self.stages = list(stages)
        self.stream: IO[str] = stream if stream is not None else sys.stderr
        self.tty = _is_tty(self.stream) if tty is None else tty
        self.on_line = on_line
        self.on_stage = on_stage
        self.width = width
        self.tick = tick
        self.clock = clock
        self.n = 0  # stages entered so far; the current one is stages[n - 1]
        self.name = ""
        self.detail = ""
        self.outcome = ""  # "done" or "failed" once finished
        self.t0 = clock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # -- the steps -----------------------------------------------------------------------------

    def stage(self, name: str, detail: str = "") -> None:
        """Enter stage ``name`` (one of ``stages``; the count follows its position)."""
        self.n = self.stages.index(name) + 1 if name in self.stages else min(self.n + 1, len(self.stages))
        self.name, self.detail = name, detail
        self._report(name, detail)
        self._redraw()
        if self.tty and self._ticker is None and self.tick > 0:
            self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._ticker.start()

    def finish(self, detail: str = "", failed: bool = False) -> None:
        if self.outcome:
            return
        self.outcome = "failed" if failed else "done"
        if not failed:
            self.n = len(self.stages)
        self.name, self.detail = self.outcome, detail
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(2)
        with _lock:
            if self.tty:
                self._erase()
                if self in _active:
                    _active.remove(self)
                self.stream.write(self.render() + "\n")  # the final state stays on screen
                self.stream.flush()
                _redraw_all(self.stream)
        self._report(self.outcome, detail)

    def echo(self, text: str) -> None:
        """Print a line of text above the bar (or just print it when there is no bar)."""
        with _lock:
            if self.tty:
                self._erase()
            self.stream.write(text + "\n")
            self.stream.flush()
            if self.tty:
                _redraw_all(self.stream)

    def __enter__(self) -> Stages:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self.finish(f"{type(exc).__name__}: {exc}", failed=True)
        else:
            self.finish()

    # -- rendering -----------------------------------------------------------------------------

    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def render(self) -> str:
        total = len(self.stages)
        done = self.n if self.outcome == "done" else max(self.n - 1, 0)
        filled = round(self.width * done / total)
        bar = "█" * filled + "░" * (self.width - filled)
        what = self.name + (f" ({self.detail})" if self.detail else "")
        return f"[{self.title}] {bar} {self.n}/{total} {what} {_clock(self.elapsed)}"

    def line(self, name: str, detail: str = "") -> str:
        """The plain line for a stage (no terminal)."""
        total = len(self.stages)
        if name in ("done", "failed"):
            head = f"{self.title}: {name} in {self.elapsed:.1f} s"
        else:
            head = f"{self.title}: [{self.n}/{total}] {name}"
        return head + (f": {detail}" if detail else "")

    def _report(self, name: str, detail: str) -> None:
        if self.tty:  # the bar shows it
            return
        if self.on_stage is not None:
            self.on_stage(self.n, len(self.stages), name, detail, round(self.elapsed, 2))
        if self.on_line is not None:
            self.on_line(self.line(name, detail))
        elif self.on_stage is None:
            self.stream.write(self.line(name, detail) + "\n")
            self.stream.flush()

    def _redraw(self) -> None:
        if not self.tty or self.outcome:
            return
        with _lock:
            if self not in _active:
                _active.append(self)
            self._erase()
            _redraw_all(self.stream)

    def _erase(self) -> None:
        if _drawn.pop(id(self.stream), 0):
            self.stream.write("\r\033[K")

    def _tick(self) -> None:
        while not self._stop.wait(self.tick):
            self._redraw()


def _redraw_all(stream: IO[str]) -> None:
    bars = [b for b in _active if b.stream is stream]
    if not bars:
        return
    text = "  ".join(b.render() for b in bars)
    stream.write(text)
    stream.flush()
    _drawn[id(stream)] = len(text)


class TerminalAware:
    """A text stream for loggers that share a terminal with bars: each line written through it
    appears above the bars, which are redrawn below it."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._midline = False

    def write(self, text: str) -> int:
        with _lock:
            if not self._midline:
                if _drawn.pop(id(self._stream), 0):
                    self._stream.write("\r\033[K")
            n = self._stream.write(text)
            self._midline = not text.endswith("\n")
            if not self._midline:
                _redraw_all(self._stream)
            return n

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return _is_tty(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
