"""Values returned by the SDK: sandbox records and the outcome of running code.

Each class has a ``from_wire`` constructor that reads the server's JSON. Readers are lenient
about *extra* keys (newer servers may add some) and strict about keys that the contract
requires, which raise ``TransportError`` naming the key.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kernelhost.client._exceptions import TransportError

__all__ = [
    "Execution",
    "ExecutionError",
    "ExecutionStatus",
    "FileInfo",
    "Recovery",
    "Result",
    "SandboxInfo",
    "SandboxState",
]


class SandboxState(enum.StrEnum):
    """What a sandbox is; a member compares equal to its value (``"running"``...)."""

    STARTING = "starting"
    RUNNING = "running"
    HIBERNATED = "hibernated"  # saved to disk; its next call wakes it
    REPLACING = "replacing"  # getting a fresh VM
    DEAD = "dead"  # its VM stopped (``detail`` says why)


class ExecutionStatus(enum.StrEnum):
    """How a ``run_code`` call ended (see ``Execution``)."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"
    RESTARTED = "restarted"
    RESTORED = "restored"  # the sandbox was rewound to a checkpoint while the call ran
    KERNEL_DIED = "kernel_died"


class Recovery(enum.StrEnum):
    """What the server did to bring a sandbox back (see ``Execution.recovery``)."""

    INTERRUPTED = "interrupted"
    KILLED = "killed"
    KERNEL_RESTARTED = "kernel_restarted"
    VM_REPLACED = "vm_replaced"
    FAILED = "failed"


def _member(kind: type[enum.StrEnum], value: Any, fallback: Any) -> Any:
    """``kind(value)``, or ``fallback`` for a value a newer server may send."""
    try:
        return kind(str(value))
    except ValueError:
        return fallback


def _require(obj: dict[str, Any], key: str, kind: str) -> Any:
    if key not in obj:
        raise TransportError(f"the server sent a {kind} without its {key!r} key: {obj!r:.300}")
    return obj[key]


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _parse_time(value: Any, key: str) -> datetime | None:
    if value is None:
        return None
    text = str(value)
    try:
        # Python 3.10's fromisoformat does not accept a trailing "Z".
        return datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        raise TransportError(f"the server sent {key}={text!r}, which is not an ISO 8601 time") from None


@dataclass
class SandboxInfo:
    """A sandbox as the server describes it (``GET /v1/sandboxes/{id}``)."""

    id: str
    template: str
    state: SandboxState
    created_at: datetime | None = None
    last_active_at: datetime | None = None
    idle_timeout_seconds: int | None = None
    accel: str | None = None
    memory_mib: int | None = None
    vcpus: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=dict)  # {"mode": ..., "allow": [...]}
    #: seconds the create waited for room in the key's queue (the key was at a limit), or None
    queued_seconds: float | None = None

    @classmethod
    def from_wire(cls, obj: Any) -> SandboxInfo:
        """Read a sandbox object from the server's JSON."""
        if not isinstance(obj, dict):
            raise TransportError(f"expected a sandbox object, the server sent {obj!r:.300}")
        queued = obj.get("queued")
        return cls(
            id=str(_require(obj, "id", "sandbox object")),
            template=str(obj.get("template", "")),
            state=_member(SandboxState, obj.get("state"), SandboxState.DEAD),
            created_at=_parse_time(obj.get("created_at"), "created_at"),
            last_active_at=_parse_time(obj.get("last_active_at"), "last_active_at"),
            idle_timeout_seconds=_optional_int(obj.get("idle_timeout_seconds")),
            accel=obj.get("accel"),
            memory_mib=_optional_int(obj.get("memory_mib")),
            vcpus=_optional_int(obj.get("vcpus")),
            metadata={str(k): str(v) for k, v in (obj.get("metadata") or {}).items()},
            network=dict(obj["network"]) if isinstance(obj.get("network"), dict) else {},
            queued_seconds=_optional_float(queued.get("waited_seconds"))
            if isinstance(queued, dict)
            else None,
        )


@dataclass
class Result:
    """One rich output of an execution: a MIME bundle, as Jupyter sends it.

    ``is_main_result`` is true for the value of the cell's last expression (Jupyter's
    ``execute_result``) and false for anything shown with ``display()`` (``display_data``).
    Binary formats (``png``, ``jpeg``) are base64 text, as in a notebook file.

    ``display_id`` names a display that can change (``display(..., display_id=True)`` and its
    handle's ``update()``, progress bars): ``on_result`` is called again for each new version
    with ``is_update`` true, and ``Execution.results`` keeps only the latest version, where the
    first one was.
    """

    data: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    is_main_result: bool = False
    display_id: str | None = None
    is_update: bool = False

    @classmethod
    def from_wire(cls, event: dict[str, Any]) -> Result:
        """Read a ``result`` or ``update_display`` event."""
        data = event.get("data") or {}
        metadata = event.get("metadata") or {}
        if not isinstance(data, dict) or not isinstance(metadata, dict):
            raise TransportError(f"the server sent a malformed result event: {event!r:.300}")
        display_id = event.get("display_id")
        return cls(
            data=data,
            metadata=metadata,
            is_main_result=bool(event.get("is_main_result")),
            display_id=str(display_id) if display_id is not None else None,
            is_update=event.get("type") == "update_display",
        )

    def _get(self, mime: str) -> Any:
        return self.data.get(mime)

    @property
    def text(self) -> str | None:
        """The ``text/plain`` representation, or None."""
        return self._get("text/plain")  # type: ignore[no-any-return]

    @property
    def html(self) -> str | None:
        """The ``text/html`` representation, or None."""
        return self._get("text/html")  # type: ignore[no-any-return]

    @property
    def markdown(self) -> str | None:
        """The ``text/markdown`` representation, or None."""
        return self._get("text/markdown")  # type: ignore[no-any-return]

    @property
    def svg(self) -> str | None:
        """The ``image/svg+xml`` representation, or None."""
        return self._get("image/svg+xml")  # type: ignore[no-any-return]

    @property
    def png(self) -> str | None:
        """The ``image/png`` representation (base64 text), or None."""
        return self._get("image/png")  # type: ignore[no-any-return]

    @property
    def jpeg(self) -> str | None:
        """The ``image/jpeg`` representation (base64 text), or None."""
        return self._get("image/jpeg")  # type: ignore[no-any-return]

    @property
    def json(self) -> Any:
        """The ``application/json`` representation (already decoded), or None."""
        return self._get("application/json")

    def formats(self) -> list[str]:
        """The MIME types this result carries, in the order the kernel sent them."""
        return list(self.data)

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        # Lets a notebook display a Result from a sandbox as if it had been produced locally.
        return self.data, self.metadata


@dataclass
class ExecutionError:
    """An exception raised by the code that ran in the sandbox (not an SDK exception)."""

    name: str
    value: str
    traceback: list[str] = field(default_factory=list)

    @classmethod
    def from_wire(cls, event: dict[str, Any]) -> ExecutionError:
        """Read an ``error`` event."""
        return cls(
            name=str(event.get("name", "")),
            value=str(event.get("value", "")),
            traceback=[str(line) for line in event.get("traceback") or []],
        )

    def __str__(self) -> str:
        return f"{self.name}: {self.value}"


@dataclass
class Execution:
    """Everything one ``run_code`` call produced.

    ``status`` is the server's verdict: ``"ok"``, ``"error"`` (the code raised, or a bash
    command exited non-zero; see ``error``), ``"timeout"`` (the server stopped it after
    ``timeout`` seconds), ``"interrupted"`` (``interrupt()``), ``"restarted"`` (``restart()``
    while it ran) or ``"kernel_died"`` (the kernel or the VM died under it).

    ``recovery`` says what the server did to get the sandbox usable again: ``"interrupted"``
    (KeyboardInterrupt / SIGINT, state kept), ``"killed"`` (a bash command's processes),
    ``"kernel_restarted"`` (variables and imports lost) or ``"vm_replaced"`` (a fresh VM:
    files lost too); None when nothing was needed.

    Figures: ``duration_ms`` is the wall time on the server; ``cpu_time_ms`` the CPU time of
    the kernel (or of the bash command) and the processes it waited for; ``peak_memory_bytes``
    the kernel's peak resident memory during the call (bash: the command's processes). Either
    is None when the sandbox did not report it. ``exit_code`` is set for ``language="bash"``.
    ``output_truncated`` is True when stdout/stderr went over the server's limit (a marker in
    the text says where).
    """

    stdout: str = ""
    stderr: str = ""
    results: list[Result] = field(default_factory=list)
    error: ExecutionError | None = None
    execution_count: int | None = None
    duration_ms: float | None = None
    status: ExecutionStatus = ExecutionStatus.OK
    exit_code: int | None = None
    cpu_time_ms: float | None = None
    peak_memory_bytes: int | None = None
    recovery: Recovery | None = None
    output_truncated: bool = False

    def _keep(self, result: Result) -> None:
        """Add a result, or put a display's new version where its first one is."""
        if result.is_update:
            for i, old in enumerate(self.results):
                if old.display_id == result.display_id:
                    self.results[i] = result
            return  # an update of a display this call did not show: nothing of it is kept
        self.results.append(result)

    def _finish(self, end: dict[str, Any]) -> None:
        """Fill the verdict and figures from the stream's ``end`` event."""
        self.status = _member(ExecutionStatus, end.get("status", "ok"), ExecutionStatus.ERROR)
        self.execution_count = _optional_int(end.get("execution_count"))
        self.duration_ms = _optional_float(end.get("duration_ms"))
        self.exit_code = _optional_int(end.get("exit_code"))
        self.cpu_time_ms = _optional_float(end.get("cpu_ms"))
        self.peak_memory_bytes = _optional_int(end.get("peak_memory_bytes"))
        recovery = end.get("recovery")
        self.recovery = None if recovery is None else _member(Recovery, recovery, Recovery.FAILED)
        self.output_truncated = bool(end.get("output_truncated", False))

    @property
    def wall_time_ms(self) -> float | None:
        """Same as ``duration_ms``: wall-clock time of the call on the server."""
        return self.duration_ms

    @property
    def text(self) -> str | None:
        """The ``text/plain`` of the main result (the cell's value), or None."""
        for result in self.results:
            if result.is_main_result:
                return result.text
        return None


@dataclass
class FileInfo:
    """A file or directory in a sandbox, as ``files.list`` and ``files.write`` describe it.

    ``type`` is ``"file"``, ``"dir"``, ``"symlink"`` or ``"other"``; ``path`` is absolute.
    """

    name: str
    path: str
    type: str = "file"
    size: int = 0
    modified_at: datetime | None = None

    @classmethod
    def from_wire(cls, obj: Any) -> FileInfo:
        if not isinstance(obj, dict):
            raise TransportError(f"expected a file entry, the server sent {obj!r:.300}")
        path = str(_require(obj, "path", "file entry"))
        return cls(
            name=str(obj.get("name") or path.rstrip("/").rsplit("/", 1)[-1]),
            path=path,
            type=str(obj.get("type", "file")),
            size=int(obj.get("size") or 0),
            modified_at=_parse_time(obj.get("modified_at"), "modified_at"),
        )
