"""Per-execution output caps and usage figures, applied as messages pass through the relay.

Host -> kernel: ``note_execute_request`` notes each execute_request's output cap (its
``metadata["kernelhost"]["max_output_bytes"]``) and the kernel's CPU time at its start.
Kernel -> host: ``cap_and_measure`` cuts the request's stream output at the cap and puts the usage
figures (``cpu_ms``, ``peak_memory_bytes``) in the execute_reply's ``metadata["kernelhost"]``.

The host re-checks everything: this side only keeps the guest from pushing output nobody will
keep through the channel. The kernel cooperates too (``kernel_limits.py`` drops writes past the
cap where they happen).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import Any

from .shared import log_exception

__all__ = ["ExecutionMeter", "cpu_ticks", "peak_rss", "reset_peak_rss"]

#: Requests remembered at once per table: replies that never came must not pile up.
TABLE_MAX = 64
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class _Bounded(collections.OrderedDict[str, Any]):
    """A table that forgets its oldest entry past ``TABLE_MAX``."""

    def remember(self, key: str, value: Any) -> None:
        """Set ``key``, forgetting the oldest entries past TABLE_MAX."""
        self[key] = value
        while len(self) > TABLE_MAX:
            self.popitem(last=False)


class ExecutionMeter:
    """Output budgets and CPU/memory starting points of the executions in flight."""

    def __init__(self, kernel_pid: Callable[[], int | None]) -> None:
        self._kernel_pid = kernel_pid
        self.stream_left = _Bounded()  # execute msg_id -> stream bytes it may still send
        self.usage_start = _Bounded()  # execute msg_id -> (kernel pid, cpu ticks)

    def note_execute_request(self, channel: str, msg: dict[str, Any]) -> None:
        """Note the limits and starting figures of a message on its way to the kernel."""
        try:
            self._note(channel, msg)
        except Exception:  # bookkeeping only: the message goes to the kernel anyway
            log_exception("execution limits: cannot note a request:")

    def _note(self, channel: str, msg: dict[str, Any]) -> None:
        """Note the cap and the CPU/memory starting point of an execute_request."""
        header = _map(msg.get("header"))
        if channel != "shell" or header.get("msg_type") != "execute_request":
            return
        msg_id = header.get("msg_id")
        if not isinstance(msg_id, str):
            return
        limits = _map(_map(msg.get("metadata")).get("kernelhost"))
        cap = limits.get("max_output_bytes")
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:
            self.stream_left.remember(msg_id, cap + 1)  # one more: the host sees the cut
        pid = self._kernel_pid()
        if pid is not None:
            ticks = cpu_ticks(pid)
            reset_peak_rss(pid)
            if ticks is not None:
                self.usage_start.remember(msg_id, (pid, ticks))

    def cap_and_measure(self, channel: str, wire: dict[str, Any]) -> bool:
        """Adjust a kernel message on its way to the host; False drops it. Never raises: user
        code can make the kernel send odd messages, and the relay must outlive them."""
        try:
            return self._adjust(channel, wire)
        except Exception:
            log_exception("execution limits: passing on a message it could not inspect:")
            return True

    def _adjust(self, channel: str, wire: dict[str, Any]) -> bool:
        """Cut a stream, forget a finished execution, or add usage to its reply."""
        parent = wire["parent_header"].get("msg_id")
        if not isinstance(parent, str):
            return True
        msg_type = wire["header"].get("msg_type")
        if channel == "iopub" and msg_type == "stream" and parent in self.stream_left:
            return self._cut_stream(parent, wire["content"])
        if channel == "iopub" and msg_type == "status" and parent in self.stream_left:
            if wire["content"].get("execution_state") == "idle":
                self.stream_left.pop(parent, None)
        elif channel == "shell" and msg_type == "execute_reply" and parent in self.usage_start:
            pid, ticks = self.usage_start.pop(parent)
            usage: dict[str, Any] = {}
            now = cpu_ticks(pid)
            if now is not None:
                usage["cpu_ms"] = round((now - ticks) * 1000 / CLOCK_TICKS, 1)
            peak = peak_rss(pid)
            if peak is not None:
                usage["peak_memory_bytes"] = peak
            wire["metadata"]["kernelhost"] = usage
        return True

    def stream_fits(self, parent_header: dict[str, Any], size: int) -> bool:
        """Whether a stream of ``size`` bytes answering ``parent_header`` passes whole, its size
        then taken from the budget; False (nothing taken): ``cap_and_measure`` must cut it."""
        parent = parent_header.get("msg_id")
        if not isinstance(parent, str) or parent not in self.stream_left:
            return True
        left = self.stream_left[parent]
        if size > left:
            return False
        self.stream_left[parent] = left - size
        return True

    def _cut_stream(self, parent: str, content: dict[str, Any]) -> bool:
        """Let through what is left of the execution's budget; False: nothing is."""
        text = content.get("text")
        if not isinstance(text, str):
            return True
        left = self.stream_left[parent]
        if left <= 0:
            return False
        if text.isascii() and len(text) <= left:  # its length is its size: no copy to count it
            self.stream_left[parent] = left - len(text)
            return True
        data = text.encode("utf-8", "surrogatepass")
        if len(data) > left:
            content["text"] = data[:left].decode("utf-8", "ignore")
            left = 0
        else:
            left -= len(data)
        self.stream_left[parent] = left
        return True


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def cpu_ticks(pid: int) -> int | None:
    """utime + stime + cutime + cstime of ``pid``, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15])
    except (OSError, IndexError, ValueError):
        return None


def reset_peak_rss(pid: int) -> None:
    """Reset ``pid``'s VmHWM, so the next ``peak_rss`` is the peak of one execution."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set size
    except OSError:
        pass


def peak_rss(pid: int) -> int | None:
    """``pid``'s peak resident set size in bytes (VmHWM) since the last reset."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None
