"""Per-execution output cap inside the kernel process (``launch_kernel.py`` installs it).

The host is the authority on limits (nothing in the guest is trusted) and cuts every execution's
stdout/stderr at ``max_output_bytes``. This is the cooperative part, in the kernel itself, so that
one huge ``print('x' * 10**9)`` is never copied into ipykernel's buffer, a Jupyter message, the
agent and the channel: past the cap, writes to ``sys.stdout``/``sys.stderr`` (and the fd-level
output ipykernel captures) are dropped where they happen.

The cap comes with each execute_request, in ``metadata["kernelhost"]["max_output_bytes"]``; a
request without it (another Jupyter client) is not capped here. One character more than the cap
is let through, so the host always sees that the cap was crossed and adds its visible marker.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from ipykernel import iostream, kernelbase

_lock = threading.Lock()
_cap: int | None = None  # characters the current execution may still write (plus one)
_installed = False
_forked = False


def _note_fork() -> None:
    global _forked
    _forked = True  # a child process writes through ipykernel's own path (it handles forks)


def _requested_cap(parent: Any) -> int | None:
    meta = parent.get("metadata") if isinstance(parent, dict) else None
    limits = meta.get("kernelhost") if isinstance(meta, dict) else None
    cap = limits.get("max_output_bytes") if isinstance(limits, dict) else None
    if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:
        return cap + 1
    return None


def install() -> None:
    """Patch ipykernel before the kernel object exists (its handlers are bound at creation)."""
    global _installed
    if _installed:
        return
    _installed = True
    original_execute: Callable[..., Any] = kernelbase.Kernel.execute_request  # unannotated upstream
    original_write = iostream.OutStream.write
    # the lean path knows ipykernel 6's OutStream (one buffer, a flush scheduled once); any
    # other keeps ipykernel's write
    lean = all(hasattr(iostream.OutStream, a) for a in ("_schedule_flush", "_rotate_buffer"))
    os.register_at_fork(after_in_child=_note_fork)

    async def execute_request(self: Any, stream: Any, ident: Any, parent: Any) -> Any:
        global _cap
        with _lock:
            _cap = _requested_cap(parent)
        result = original_execute(self, stream, ident, parent)
        if inspect.isawaitable(result):
            result = await result
        return result

    def capped(string: str) -> int:
        """How much of ``string`` the execution may still write, taken from its cap."""
        global _cap
        with _lock:
            if _cap is None:
                return len(string)
            allowed = min(len(string), _cap)
            _cap -= allowed
            return allowed

    def write(self: Any, string: Any) -> Any:
        if not isinstance(string, str):
            return original_write(self, string)  # raises ipykernel's own TypeError
        allowed = len(string) if _cap is None else capped(string)
        if allowed < len(string):
            if allowed:
                original_write(self, string[:allowed])
            return len(string)  # the caller's text counts as written: dropping it is the point
        return original_write(self, string)

    def lean_write(self: Any, string: Any) -> Any:
        global _cap
        # ipykernel's own write, less what a cell printing line by line pays for on every line
        # under emulation (a getpid, a second lock, calls, each check it need not make twice):
        # the buffer, then one flush. Anything unusual takes ``write``.
        if string.__class__ is not str or _forked or self.echo is not None:
            return write(self, string)
        size = len(string)
        if _cap is not None:  # ``capped``, inline: a call costs microseconds under emulation
            with _lock:
                allowed = size if _cap is None else min(size, _cap)
                if _cap is not None:
                    _cap -= allowed
            if allowed < size:
                if allowed:
                    original_write(self, string[:allowed])
                return size
        with self._buffer_lock:
            self._buffer.write(string)
        if not self._flush_pending:
            self._schedule_flush()
        return size

    kernelbase.Kernel.execute_request = execute_request  # type: ignore[method-assign]
    iostream.OutStream.write = lean_write if lean else write  # type: ignore[method-assign]
