"""Checkpoints in the SDK: ``Checkpoint`` and the methods ``AsyncSandbox`` gets for them
(``checkpoint``, ``checkpoints``, ``restore``, ``undo``, ``delete_checkpoint``)."""

from __future__ import annotations

import builtins
import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernelhost.client._exceptions import TransportError
from kernelhost.client._models import SandboxInfo, _parse_time, _require

if TYPE_CHECKING:
    from kernelhost.client._http import HTTPClient

#: a restore loads a whole VM: under software emulation that can take seconds
RESTORE_TIMEOUT = 300.0


@dataclass(frozen=True)
class Checkpoint:
    """A sandbox's whole state (variables, imports, files, the shell) kept on the server.

    Rewind the sandbox to it with ``sbx.restore(cp)``, or start a new sandbox holding it with
    ``AsyncSandbox.create(checkpoint=cp)``. ``bytes`` is what it takes on the server's disk
    (compressed, only what differs from the template). ``auto`` checkpoints are the ones
    ``auto_checkpoint`` takes before each call (``before_call`` numbers that call).
    """

    id: str
    sandbox_id: str
    label: str
    created_at: dt.datetime | None
    bytes: int
    auto: bool = False
    before_call: int | None = None

    @classmethod
    def from_wire(cls, obj: Any) -> Checkpoint:
        if not isinstance(obj, dict):
            raise TransportError(f"expected a checkpoint object, the server sent {obj!r:.300}")
        before = obj.get("before_call")
        return cls(
            id=str(_require(obj, "id", "checkpoint object")),
            sandbox_id=str(obj.get("sandbox_id", "")),
            label=str(obj.get("label") or ""),
            created_at=_parse_time(obj.get("created_at"), "created_at"),
            bytes=int(obj.get("bytes") or 0),
            auto=bool(obj.get("auto")),
            before_call=before if isinstance(before, int) else None,
        )


def checkpoint_id(cp: Checkpoint | str) -> str:
    if isinstance(cp, Checkpoint):
        return cp.id
    if isinstance(cp, str) and cp:
        return cp
    raise ValueError(f"expected a Checkpoint or a checkpoint id such as 'cp_...', got {cp!r}")


class CheckpointMethods:
    """Mixed into ``AsyncSandbox``."""

    _http: HTTPClient
    _info: SandboxInfo | None

    @property
    def id(self) -> str:
        raise NotImplementedError

    def _ensure_open(self) -> None:
        raise NotImplementedError

    def _path(self, action: str) -> str:
        return f"/v1/sandboxes/{self.id}/{action}"

    async def checkpoint(self, label: str | None = None) -> Checkpoint:
        """Keep the sandbox's whole state now, to ``restore`` it or branch from it later.

        The sandbox is paused only while its state is saved (well under a second) and goes on
        unchanged. ``label`` is yours to name it by.
        """
        self._ensure_open()
        body = {"label": label} if label is not None else {}
        reply = await self._http.request(
            "POST", self._path("checkpoints"), json_body=body, timeout=RESTORE_TIMEOUT
        )
        return Checkpoint.from_wire(reply)

    async def checkpoints(self) -> builtins.list[Checkpoint]:
        """The sandbox's checkpoints, oldest first."""
        self._ensure_open()
        reply = await self._http.request("GET", self._path("checkpoints"))
        items = reply.get("checkpoints") if isinstance(reply, dict) else None
        if not isinstance(items, builtins.list):
            raise TransportError(f"the checkpoint list came without a 'checkpoints' list: {reply!r:.300}")
        return [Checkpoint.from_wire(item) for item in items]

    async def delete_checkpoint(self, cp: Checkpoint | str) -> None:
        """Delete one of the sandbox's checkpoints (its disk space is freed)."""
        self._ensure_open()
        await self._http.request("DELETE", self._path(f"checkpoints/{checkpoint_id(cp)}"))

    async def restore(self, cp: Checkpoint | str) -> Checkpoint:
        """Rewind this sandbox to one of its checkpoints: every variable, import and file as it
        was then (the sandbox keeps its id). A call running meanwhile ends with status
        ``"restored"``; the clock is current and random seeds are fresh."""
        self._ensure_open()
        return await self._rewind("restore", {"checkpoint": checkpoint_id(cp)})

    async def undo(self, n: int = 1) -> Checkpoint:
        """Rewind to before the ``n``-th last ``run_code`` call (the sandbox must have been
        created with ``auto_checkpoint``). Returns the checkpoint it went back to."""
        self._ensure_open()
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int (how many calls to undo), got {n!r}")
        return await self._rewind("undo", {"n": n})

    async def _rewind(self, action: str, body: dict[str, Any]) -> Checkpoint:
        reply = await self._http.request("POST", self._path(action), json_body=body, timeout=RESTORE_TIMEOUT)
        if not isinstance(reply, dict):
            raise TransportError(f"{action} answered {reply!r:.300}")
        if isinstance(reply.get("sandbox"), dict):
            self._info = SandboxInfo.from_wire(reply["sandbox"])
        return Checkpoint.from_wire(reply.get("checkpoint"))
