"""The one place where domain errors become HTTP statuses, and the JSON error shape.

Every error response is ``{"error": {"code": str, "message": str, ...details}}``. A sandbox
error with a remedy also carries ``"remedy"`` (its name, for programs: the MCP server words it
for its own tools), ``"reason"`` (the message without advice) and ``"hint"`` (the advice in this
API's terms: its routes); ``message`` is the reason followed by the hint.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from ..sandboxes import (
    AgentUnresponsive,
    BackendUnavailable,
    BootFailed,
    CapacityExceeded,
    CheckpointNotFound,
    CheckpointUnusable,
    ContextNotFound,
    FileOperationFailed,
    FileTooLarge,
    HostFailed,
    InvalidRequest,
    NodeFull,
    NodeUnreachable,
    NotSupportedByImage,
    PathNotFound,
    PortNotOpen,
    ProcessNotFound,
    Remedy,
    SandboxBusy,
    SandboxDiskFull,
    SandboxError,
    SandboxNotFound,
    SandboxNotRunning,
    TemplateConflict,
    TemplateNotFound,
)

log = structlog.get_logger("kernelhost.api")

STATUS: list[tuple[type[SandboxError], int]] = [
    (InvalidRequest, 400),
    (SandboxNotFound, 404),
    (ProcessNotFound, 404),
    (ContextNotFound, 404),
    (TemplateNotFound, 404),
    (TemplateConflict, 409),
    (CheckpointNotFound, 404),
    (CheckpointUnusable, 410),
    (HostFailed, 410),
    (NodeUnreachable, 503),
    (NodeFull, 503),
    (SandboxBusy, 409),
    (SandboxNotRunning, 409),
    (CapacityExceeded, 429),
    (BootFailed, 503),
    (BackendUnavailable, 503),
    (AgentUnresponsive, 503),
    (NotSupportedByImage, 501),
    (PathNotFound, 404),
    (PortNotOpen, 502),
    (FileTooLarge, 413),
    (SandboxDiskFull, 507),
    (FileOperationFailed, 400),
]


def status_for(exc: SandboxError) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def rest_hint(exc: SandboxError) -> str | None:
    """The error's remedy as a user of this REST API acts on it."""
    sid = exc.sandbox_id or "{id}"
    path = exc.details.get("path")
    return (
        {
            Remedy.RESTART: f"POST /v1/sandboxes/{sid}/restart restarts the kernel, or gives the "
            "sandbox a fresh VM if its agent stays silent (state lost)",
            Remedy.RECREATE: f"DELETE /v1/sandboxes/{sid} and create a new sandbox",
            Remedy.LIST_SANDBOXES: "list yours with GET /v1/sandboxes",
            Remedy.LIST_TEMPLATES: "list them with GET /v1/templates",
            Remedy.LIST_CHECKPOINTS: f"list them with GET /v1/sandboxes/{sid}/checkpoints",
            Remedy.LIST_DIRECTORY: f"list it with GET /v1/sandboxes/{sid}/files/list"
            + (f"?path={path}" if isinstance(path, str) else ""),
        }.get(exc.remedy)
        if exc.remedy is not None
        else None
    )


def error_body(exc: SandboxError) -> dict[str, Any]:
    body: dict[str, Any] = {"code": exc.code, "message": exc.message, **exc.details}
    hint = rest_hint(exc)
    if exc.remedy is not None and hint is not None:
        body.update(message=f"{exc.message}; {hint}", reason=exc.message, hint=hint, remedy=exc.remedy.value)
    return body


def error_response(status: int, code: str, message: str, **details: Any) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message, **details}}, status=status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SandboxError as exc:
        response = web.json_response({"error": error_body(exc)}, status=status_for(exc))
        if isinstance(exc.details.get("retry_after"), int):  # a key's queue of creates: full
            response.headers["Retry-After"] = str(exc.details["retry_after"])
        return response
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status, "http_error"
        )
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no route {request.method} {request.path}; see the README's API section"
        return error_response(exc.status, code, message)
    except Exception:
        log.exception("request.failed", method=request.method, path=request.path)
        return error_response(500, "internal_error", "internal error; the service log has the details")
