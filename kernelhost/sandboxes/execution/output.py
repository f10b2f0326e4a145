"""The output limits of one execution, enforced on the host (docs/limits.md).

stdout and stderr together are cut at ``max_output_bytes`` per call, with one visible marker; a
result over ``max_result_bytes`` loses its largest formats, with a marker. The guest is told the
caps so it drops what nobody will keep, but nothing it sends is trusted to respect them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from .events import Result, Stream


@dataclass(frozen=True)
class OutputLimits:
    max_output_bytes: int | None = None
    max_result_bytes: int | None = None

    def for_guest(self) -> dict[str, int]:
        """The caps as the kernel and the agent are told them (unset ones left out)."""
        return {
            k: v
            for k, v in (
                ("max_output_bytes", self.max_output_bytes),
                ("max_result_bytes", self.max_result_bytes),
            )
            if v is not None
        }


class OutputBudget:
    """What one execution may still print, and the cut-off rules for rich results."""

    def __init__(self, limits: OutputLimits) -> None:
        self.limits = limits
        self.used = 0
        self.truncated = False

    def stream(self, name: str, text: str) -> list[Stream]:
        cap = self.limits.max_output_bytes
        if cap is None:
            return [Stream(name, text)]
        if self.truncated:
            return []
        # ASCII text (most output) is as many bytes as characters: no encoded copy to count it
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if self.used + size <= cap:
            self.used += size
            return [Stream(name, text)]
        data = text.encode("utf-8", "surrogatepass")
        keep = data[: cap - self.used].decode("utf-8", "ignore")
        self.used, self.truncated = cap, True
        events = [Stream(name, keep)] if keep else []
        events.append(
            Stream(
                name,
                (
                    f"\n[kernelhost: output truncated: this call wrote more than {cap} bytes to "
                    "stdout/stderr (the server's max_output_bytes); the rest was dropped. Write large "
                    "output to a file and read it with files.read]\n"
                ),
            )
        )
        return events

    def result(self, event: Result) -> Result:
        """Drop MIME entries that are not JSON-safe, then the largest until under the cap."""
        sizes: dict[str, int] = {}
        for mime, value in event.data.items():
            size = json_size(value)
            if isinstance(mime, str) and size is not None:
                sizes[mime] = size
        data = {mime: event.data[mime] for mime in sizes}
        dropped = [str(m) for m in event.data if m not in sizes]
        limit = self.limits.max_result_bytes
        total = sum(sizes.values())
        if limit is not None and total > limit:
            for mime in sorted(sizes, key=lambda m: sizes[m], reverse=True):
                if total <= limit:
                    break
                del data[mime]
                total -= sizes[mime]
                dropped.append(mime)
        if not dropped:
            return event
        note = (
            f"[kernelhost: {', '.join(dropped)} dropped from this result: over the "
            f"server's max_result_bytes of {limit} bytes, or not JSON data. Save large "
            "outputs to a file and read it with files.read]"
        )
        plain = data.get("text/plain")
        data["text/plain"] = f"{plain}\n{note}" if isinstance(plain, str) else note
        metadata = event.metadata if json_size(event.metadata) is not None else {}
        return dataclasses.replace(event, data=data, metadata=metadata, truncated=True)


def json_size(value: Any) -> int | None:
    """The size of ``value`` as JSON (a string: its length), or None if it is not JSON data."""
    if isinstance(value, str):
        return len(value)
    try:
        return len(json.dumps(value, allow_nan=False))  # NaN and infinities are not JSON
    except (TypeError, ValueError, RecursionError):
        return None
