"""What the ``/v1`` views share to read a request: the runtime, a body's typed fields, the
caller's sandbox named in the path."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ...sandboxes import InvalidRequest, Sandbox
from ..state import KEY_ID, RUNTIME, Runtime


def runtime(request: web.Request) -> Runtime:
    """What the running service holds (its manager, settings, ...)."""
    return request.app[RUNTIME]


def field(
    body: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    default: Any = None,
    required: bool = False,
) -> Any:
    """``body[name]`` checked to be of ``kind`` (a bool is not an int); absent or null is
    ``default``, or refused where ``required``."""
    if name not in body or body[name] is None:
        if required:
            raise InvalidRequest(f"field {name!r} is required", field=name)
        return default
    value = body[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        names = " or ".join(k.__name__ for k in _as_tuple(kind))
        raise InvalidRequest(f"field {name!r} must be {names}, got {value!r:.80}", field=name)
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def sandbox(request: web.Request) -> Sandbox:
    """The caller's sandbox named by ``{sandbox_id}`` (``SandboxNotFound``: 404)."""
    return runtime(request).manager.get(request[KEY_ID], request.match_info["sandbox_id"])
