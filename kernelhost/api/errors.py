"""The one place where domain errors become HTTP statuses, and the JSON error shape.

Every error response is ``{"error": {"code": str, "message": str, ...details}}``.
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
    FileOperationFailed,
    FileTooLarge,
    InvalidRequest,
    NotSupportedByImage,
    PathNotFound,
    SandboxDiskFull,
    SandboxError,
    SandboxNotFound,
    SandboxNotRunning,
)

log = structlog.get_logger("kernelhost.api")

STATUS: list[tuple[type[SandboxError], int]] = [
    (InvalidRequest, 400),
    (SandboxNotFound, 404),
    (SandboxNotRunning, 409),
    (CapacityExceeded, 429),
    (BootFailed, 503),
    (BackendUnavailable, 503),
    (AgentUnresponsive, 503),
    (NotSupportedByImage, 501),
    (PathNotFound, 404),
    (FileTooLarge, 413),
    (SandboxDiskFull, 507),
    (FileOperationFailed, 400),
]


def error_response(status: int, code: str, message: str, **details: Any) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message, **details}},
                             status=status)


def status_for(exc: SandboxError) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except SandboxError as exc:
        return error_response(status_for(exc), exc.code, exc.message, **exc.details)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status, "http_error")
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no route {request.method} {request.path}; see the README's API section"
        return error_response(exc.status, code, message)
    except Exception:
        log.exception("request.failed", method=request.method, path=request.path)
        return error_response(500, "internal_error",
                              "internal error; the service log has the details")
