"""What one execution produces, in the order it happens: typed events, each with its ``wire()``
form (the JSON object the native API streams, one per NDJSON line).

- ``Stream``: ``{"type": "stdout"|"stderr", "text": str}``
- ``Result``: ``{"type": "result", "data": {mime: value}, "metadata": {...},
  "is_main_result": bool}``, plus ``"truncated": true`` when formats over
  ``max_result_bytes`` were dropped, and ``"display_id"`` for a display shown with an id
  (``display(..., display_id=True)``); a new version of such a display (Jupyter's
  ``update_display_data``) is ``{"type": "update_display", "display_id", "data", "metadata"}``
- ``Error``: ``{"type": "error", "name": str, "value": str, "traceback": [str]}``
- ``ClearOutput``: ``{"type": "clear_output", "wait": bool}``
- ``End``: ``{"type": "end", ...}``, always last: ``status`` (``ExecutionStatus``),
  ``execution_count`` (Python), ``exit_code`` (bash), ``duration_ms`` (wall time), ``cpu_ms``
  and ``peak_memory_bytes`` (measured in the guest, when it reported them),
  ``output_truncated``, and ``recovery`` (``Recovery``) when the sandbox had to be brought back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..states import ExecutionStatus, Recovery


@dataclass(frozen=True, slots=True)
class Stream:
    name: str  # "stdout" or "stderr"
    text: str

    def wire(self) -> dict[str, Any]:
        return {"type": self.name, "text": self.text}


@dataclass(frozen=True, slots=True)
class Result:
    data: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    is_main_result: bool = False
    truncated: bool = False
    display_id: str | None = None
    update: bool = False  # a new version of the display ``display_id`` shows

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any]
        if self.update:
            out = {"type": "update_display", "display_id": self.display_id}
        else:
            out = {"type": "result", "is_main_result": self.is_main_result}
            if self.display_id is not None:
                out["display_id"] = self.display_id
        out.update(data=self.data, metadata=self.metadata)
        if self.truncated:
            out["truncated"] = True
        return out


@dataclass(frozen=True, slots=True)
class Error:
    name: str
    value: str
    traceback: list[str] = field(default_factory=list)

    def wire(self) -> dict[str, Any]:
        return {"type": "error", "name": self.name, "value": self.value, "traceback": self.traceback}


@dataclass(frozen=True, slots=True)
class ClearOutput:
    wait: bool = False

    def wire(self) -> dict[str, Any]:
        return {"type": "clear_output", "wait": self.wait}


@dataclass(frozen=True, slots=True)
class End:
    status: ExecutionStatus
    duration_ms: float
    execution_count: int | None = None
    language: str = "python"
    exit_code: int | None = None  # bash only
    cpu_ms: float | None = None
    peak_memory_bytes: int | None = None
    output_truncated: bool = False
    recovery: Recovery | None = None

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "end",
            "status": self.status.value,
            "execution_count": self.execution_count,
            "duration_ms": self.duration_ms,
        }
        if self.language == "bash":
            out["exit_code"] = self.exit_code
        if self.cpu_ms is not None:
            out["cpu_ms"] = self.cpu_ms
        if self.peak_memory_bytes is not None:
            out["peak_memory_bytes"] = self.peak_memory_bytes
        out["output_truncated"] = self.output_truncated
        if self.recovery is not None:
            out["recovery"] = self.recovery.value
        return out


Event = Stream | Result | Error | ClearOutput | End
