"""HTTP views of the native API (``/v1``) and ``/healthz``."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from aiohttp import web

from ..sandboxes import InvalidRequest, Sandbox
from .state import KEY_ID, RUNTIME, Runtime

routes = web.RouteTableDef()


def _runtime(request: web.Request) -> Runtime:
    return request.app[RUNTIME]


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None,
           required: bool = False) -> Any:
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


def _sandbox(request: web.Request) -> Sandbox:
    return _runtime(request).manager.get(request[KEY_ID], request.match_info["sandbox_id"])


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    rt = _runtime(request)
    return web.json_response({
        "status": "ok", "accel": rt.accel, "accel_reason": rt.accel_reason,
        "templates": rt.manager.templates(), "sandboxes": len(rt.manager.sandboxes),
        "pool": {t: rt.manager.vms.pool.ready(t) for t in rt.manager.templates()},
    })


@routes.post("/v1/sandboxes")
async def create_sandbox(request: web.Request) -> web.Response:
    body = await _json_body(request)
    template = _field(body, "template", str, "python")
    idle = _field(body, "idle_timeout_seconds", int)
    metadata = _field(body, "metadata", dict, {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InvalidRequest("field 'metadata' must map strings to strings", field="metadata")
    sbx = await _runtime(request).manager.create(request[KEY_ID], template, idle, metadata)
    return web.json_response(sbx.to_dict(), status=201)


@routes.get("/v1/sandboxes")
async def list_sandboxes(request: web.Request) -> web.Response:
    sandboxes = _runtime(request).manager.owned(request[KEY_ID])
    return web.json_response({"sandboxes": [s.to_dict() for s in sandboxes]})


@routes.get("/v1/sandboxes/{sandbox_id}")
async def get_sandbox(request: web.Request) -> web.Response:
    return web.json_response(_sandbox(request).to_dict())


@routes.delete("/v1/sandboxes/{sandbox_id}")
async def delete_sandbox(request: web.Request) -> web.Response:
    await _runtime(request).manager.delete(request[KEY_ID], request.match_info["sandbox_id"])
    return web.Response(status=204)


@routes.post("/v1/sandboxes/{sandbox_id}/execute")
async def execute(request: web.Request) -> web.StreamResponse:
    """Stream the execution's events as newline-delimited JSON while they happen.

    Calls to one sandbox are served one at a time in arrival order: a second call's stream opens
    at once but its events start when the first call has ended.
    """
    sbx = _sandbox(request)
    body = await _json_body(request)
    code = _field(body, "code", str, required=True)
    language = _field(body, "language", str, "python")
    timeout = _field(body, "timeout", (int, float))
    events = await _runtime(request).manager.execute(sbx, code, language, timeout)
    resp = web.StreamResponse(headers={
        "Content-Type": "application/x-ndjson", "Cache-Control": "no-store",
        "X-Accel-Buffering": "no",
    })
    await resp.prepare(request)
    async with contextlib.aclosing(events):
        async for event in events:
            await resp.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")
    await resp.write_eof()
    return resp


@routes.post("/v1/sandboxes/{sandbox_id}/fork")
async def fork_sandbox(request: web.Request) -> web.Response:
    """Copy a live sandbox into ``n`` children (body ``{"n": 1}``); 201 with the children."""
    body = await _json_body(request)
    n = _field(body, "n", int, 1)
    kids = await _runtime(request).manager.fork(request[KEY_ID], request.match_info["sandbox_id"], n)
    return web.json_response({"sandboxes": [k.to_dict() for k in kids]}, status=201)


@routes.post("/v1/sandboxes/{sandbox_id}/hibernate")
async def hibernate_sandbox(request: web.Request) -> web.Response:
    """Save the sandbox to disk and stop its VM now; its next call wakes it, state intact."""
    manager = _runtime(request).manager
    await manager.hibernate(_sandbox(request))
    return web.json_response(_sandbox(request).to_dict())
