"""Frames from the host, dispatched to the areas that registered for them.

A frame is either a kind of its own (``jupyter``, ``net``: handed to the area that registered the
kind) or a request ``{"op": NAME, "id": N, ...}``, answered by one
``{"op": "reply", "id": N, "ok": ...}``. Each area (bash, files, network, snapshots, the kernel's
own ops) registers its ops and the capability they make up; ``hello`` announces the registered
capabilities, so what the agent claims is exactly what it can do.

Every request runs as its own task, so a slow one (a restart) never holds up a ping. A request
whose handler raises is answered ``ok=False`` with the exception's type and message: the host's
input is checked by the handlers, and nothing it sends may stop the agent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from .shared import log, log_exception, protocol
from .tasks import TaskSet

__all__ = ["Area", "Dispatcher", "Handler"]

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
FrameHandler = Callable[[dict[str, Any]], None]
Send = Callable[[dict[str, Any]], bool]


class Area(Protocol):
    """What an area of the agent registers."""

    @property
    def capability(self) -> protocol.Capability | None:
        """The capability its ops make up (None: ops every agent has)."""

    def ops(self) -> Mapping[str, Handler]:
        """The ops of the area and their handlers."""
        ...


class Dispatcher:
    """The op table, and the frame kinds that are not requests."""

    def __init__(self, send: Send, tasks: TaskSet) -> None:
        self._send = send
        self._tasks = tasks
        self._ops: dict[str, Handler] = {}
        self._kinds: dict[str, FrameHandler] = {}
        self._capabilities: set[protocol.Capability] = set()

    def register(self, area: Area) -> None:
        """Add an area's ops (each op belongs to exactly one area) and capability."""
        for op, handler in area.ops().items():
            if op in self._ops or op in self._kinds:
                raise ValueError(f"op {op!r} is registered twice; each op belongs to one area")
            self._ops[op] = handler
        if area.capability is not None:
            self._capabilities.add(area.capability)

    def register_kinds(self, handlers: Mapping[str, FrameHandler]) -> None:
        """Add handlers of frame kinds that are not requests (jupyter, net)."""
        for kind, handler in handlers.items():
            if kind in self._ops or kind in self._kinds:
                raise ValueError(f"frame kind {kind!r} is registered twice")
            self._kinds[kind] = handler

    def capabilities(self) -> list[str]:
        """What ``hello`` announces: the capabilities of the registered areas, sorted."""
        return sorted(str(c.value) for c in self._capabilities)

    def on_frame(self, frame: dict[str, Any]) -> None:
        """Take one frame from the port (on the loop's thread); never raises."""
        try:
            self._dispatch(frame)
        except Exception:  # the port's callback must outlive any frame
            log_exception(f"cannot dispatch a frame with op {frame.get('op')!r:.40}:")

    def _dispatch(self, frame: dict[str, Any]) -> None:
        """A frame kind's handler, a request's task, or an unknown-op answer."""
        op = frame.get("op")
        kind = self._kinds.get(op) if isinstance(op, str) else None
        if kind is not None:
            kind(frame)
            return
        handler = self._ops.get(op) if isinstance(op, str) else None
        request_id = frame.get("id")
        if handler is not None and isinstance(request_id, int):
            self._tasks.spawn(self._answer(str(op), request_id, handler, frame), name=f"op-{op}")
            return
        # A known op without an integer id is answered like an unknown one (the host's own
        # check reads "unknown op"), echoing whatever id it sent.
        self._send(
            {
                "op": protocol.Frame.REPLY,
                "id": request_id,
                "ok": False,
                "error": f"unknown op {op!r}",
            }
        )

    async def _answer(self, op: str, request_id: int, handler: Handler, frame: dict[str, Any]) -> None:
        """Run one request's handler and send its reply, ok or not."""
        try:
            result = await handler(frame)
            reply = {"op": protocol.Frame.REPLY, "id": request_id, "ok": True, **result}
        except ValueError as exc:  # the handlers' checks of the host's fields
            log(f"{op} refused: {exc}")
            reply = _error_reply(request_id, exc)
        except Exception as exc:
            log_exception(f"{op} failed:")
            reply = _error_reply(request_id, exc)
        if not self._send(reply):  # the host must hear back, or it waits for its timeout
            self._send(
                {
                    "op": protocol.Frame.REPLY,
                    "id": request_id,
                    "ok": False,
                    "error": f"the agent could not encode its reply to {op} (see the guest's "
                    "log); it held a value msgpack cannot carry",
                }
            )


def _error_reply(request_id: int, exc: Exception) -> dict[str, Any]:
    return {
        "op": protocol.Frame.REPLY,
        "id": request_id,
        "ok": False,
        "error": f"{type(exc).__name__}: {exc}",
    }
