"""HTTP views of the native API (``/v1``) and ``/healthz``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator

from aiohttp import web

from ... import tracing
from ...metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ...metrics import Metrics
from ...sandboxes import (
    ADMITTED,
    End,
    Event,
    InvalidRequest,
    SandboxError,
    parse_auto_checkpoint,
    parse_network,
)
from ..cluster import remote_views
from ..errors import error_body, status_for
from ..state import KEY_ID, json_object
from . import ndjson
from .requests import field, runtime, sandbox

routes = web.RouteTableDef()


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    rt = runtime(request)
    return web.json_response(
        {
            "status": "ok",
            "accel": rt.accel,
            "accel_reason": rt.accel_reason,
            "templates": rt.manager.templates(),
            "template_states": rt.manager.template_health(),
            "sandboxes": len(rt.manager.all()),
            "pool": {t: rt.manager.pool.ready(t) for t in rt.manager.templates()},
        }
    )


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format; no key needed, like /healthz (labels carry no ids or keys)."""
    body = runtime(request).manager.metrics.render()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


@routes.post("/v1/sandboxes")
async def create_sandbox(request: web.Request) -> web.Response:
    body = await json_object(request)
    template = field(body, "template", str, "python")
    idle = field(body, "idle_timeout_seconds", int)
    metadata = field(body, "metadata", dict, {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InvalidRequest("field 'metadata' must map strings to strings", field="metadata")
    network = body.get("network")  # "none" | "allowlist" | "outbound" | {"mode", "allow"}
    auto = parse_auto_checkpoint(body.get("auto_checkpoint"))  # true | false | how many calls undo reaches
    checkpoint = field(body, "checkpoint", str)  # a new sandbox holding a checkpoint's state
    sbx = await runtime(request).manager.create(
        request[KEY_ID],
        template,
        idle,
        metadata,
        None if network is None else parse_network(network),
        auto_checkpoint=auto,
        checkpoint=checkpoint,
    )
    tracing.set_attributes(sandbox_id=sbx.id)  # the call's span: the sandbox it made
    view = sbx.to_dict()
    admitted = ADMITTED.get()
    if admitted is not None:  # it waited for room in its key's queue (docs/limits.md)
        view["queued"] = {"waited_seconds": admitted.waited, "position": admitted.position}
    return web.json_response(view, status=201)


@routes.get("/v1/sandboxes")
async def list_sandboxes(request: web.Request) -> web.Response:
    sandboxes = runtime(request).manager.owned(request[KEY_ID])
    elsewhere = await asyncio.to_thread(remote_views, request)  # a cluster's other nodes
    return web.json_response({"sandboxes": [s.to_dict() for s in sandboxes] + elsewhere})


@routes.get("/v1/sandboxes/{sandbox_id}")
async def get_sandbox(request: web.Request) -> web.Response:
    return web.json_response(sandbox(request).to_dict())


@routes.delete("/v1/sandboxes/{sandbox_id}")
async def delete_sandbox(request: web.Request) -> web.Response:
    # shielded: a client hanging up mid-delete must not leave a half-removed sandbox behind
    await asyncio.shield(runtime(request).manager.delete(request[KEY_ID], request.match_info["sandbox_id"]))
    return web.Response(status=204)


@routes.post("/v1/sandboxes/{sandbox_id}/execute")
async def execute(request: web.Request) -> web.StreamResponse:
    """Stream the execution's events as newline-delimited JSON while they happen.

    Calls to one sandbox are served one at a time in arrival order: a second call's stream opens
    at once but its events start when the first call has ended.
    """
    sbx = sandbox(request)
    body = await json_object(request)
    code = field(body, "code", str, required=True)
    language = field(body, "language", str, "python")
    timeout = field(body, "timeout", (int, float))
    manager = runtime(request).manager
    events = await manager.execute(sbx, code, language, timeout)
    manager.metrics.count_relayed("execute", "in", len(code.encode()))
    resp = web.StreamResponse(
        headers={
            "Content-Type": "application/x-ndjson",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    # the stream out, beside the kernel's run (detached: the events' generator runs inside it);
    # write_seconds: how long the client's reading held the stream back
    with tracing.detached_span("execute.stream", sandbox_id=sbx.id) as streaming:
        last, sent, blocked = await _stream(resp, events, manager.metrics)
        # The end event and the end of the chunked body in one write: a client that stops
        # reading at "end" (the SDKs do) then finds the response complete and keeps its
        # connection for the next call, instead of connecting again (bench/results/profile.md).
        t0 = time.monotonic()
        await resp.write_eof(last)
        blocked += time.monotonic() - t0
        tracing.set_attributes(streaming, events=sent + 1, write_seconds=round(blocked, 6))
    return resp


async def _stream(
    resp: web.StreamResponse, events: AsyncGenerator[Event, None], metrics: Metrics
) -> tuple[bytes, int, float]:
    """Write each event but the last as an NDJSON line; the last line, how many were written,
    and the seconds spent waiting on the writes."""
    last, sent, blocked = b"", 0, 0.0
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                line = _ndjson(event)
                metrics.count_relayed("execute", "out", len(line))
                if isinstance(event, End):  # always the last event
                    last = line
                    continue
                t0 = time.monotonic()
                await resp.write(line)
                blocked += time.monotonic() - t0
                sent += 1
    except SandboxError as exc:  # after the stream began (a wake refused, say): said in-band
        failure = {"type": "failure", "status": status_for(exc), "error": error_body(exc)}
        last = json.dumps(failure, separators=(",", ":")).encode() + b"\n"
    return last, sent, blocked


def _ndjson(event: Event) -> bytes:
    """One event's line. What the guest sent is checked to be JSON data before it becomes an
    event; should anything still not serialize strictly (NaN, a cycle), the event is replaced by
    an error saying so, and the stream goes on."""
    try:
        return ndjson.line(event)
    except (TypeError, ValueError, RecursionError) as exc:
        note = {
            "type": "error",
            "name": "InvalidOutput",
            "traceback": [],
            "value": f"the sandbox sent a {event.wire().get('type')} that is not JSON data ({exc})",
        }
        return json.dumps(note).encode() + b"\n"


@routes.post("/v1/sandboxes/{sandbox_id}/fork")
async def fork_sandbox(request: web.Request) -> web.Response:
    """Copy a live sandbox into ``n`` children (body ``{"n": 1}``); 201 with the children."""
    body = await json_object(request)
    n = field(body, "n", int, 1)
    kids = await runtime(request).manager.fork(request[KEY_ID], request.match_info["sandbox_id"], n)
    return web.json_response({"sandboxes": [k.to_dict() for k in kids]}, status=201)


@routes.post("/v1/sandboxes/{sandbox_id}/hibernate")
async def hibernate_sandbox(request: web.Request) -> web.Response:
    """Save the sandbox to disk and stop its VM now; its next call wakes it, state intact."""
    manager = runtime(request).manager
    await manager.hibernate(sandbox(request))
    return web.json_response(sandbox(request).to_dict())


# -- recovery and files ----------------------------------------------------------------------------


@routes.post("/v1/sandboxes/{sandbox_id}/interrupt")
async def interrupt_sandbox(request: web.Request) -> web.Response:
    """Interrupt the running call (Python: KeyboardInterrupt; bash: SIGINT); state is kept.

    Does not wait behind the running call. ``{"interrupted": false}`` when nothing was running.
    """
    interrupted = await runtime(request).manager.interrupt(sandbox(request))
    return web.json_response({"interrupted": interrupted})


@routes.post("/v1/sandboxes/{sandbox_id}/restart")
async def restart_sandbox(request: web.Request) -> web.Response:
    """Restart the kernel and reset the shell; variables and imports are lost, files are kept.

    A running call ends with status ``restarted``. If the agent does not answer, or the sandbox's
    VM is dead, the sandbox gets a fresh VM from its template (files lost too):
    ``{"recovery": "kernel_restarted" | "vm_replaced", "sandbox": {...}}``.
    """
    sbx = sandbox(request)
    recovery = await runtime(request).manager.restart(sbx)
    return web.json_response({"recovery": recovery.value, "sandbox": sbx.to_dict()})


def _query_path(request: web.Request, default: str | None = None) -> str:
    path = request.query.get("path", default)
    if path is None:
        raise InvalidRequest(
            "query parameter 'path' is required, e.g. ?path=data/input.csv "
            "(relative paths are under /home/user)",
            field="path",
        )
    return path


def _query_bool(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise InvalidRequest(f"query parameter {name!r} is {raw!r}; use true or false", field=name)
    return raw in ("true", "1")


@routes.put("/v1/sandboxes/{sandbox_id}/files")
async def write_file(request: web.Request) -> web.Response:
    """Write the request body (raw bytes, streamed) to ``?path=``; parents are created, an
    existing file is replaced atomically. 413 over ``max_file_bytes``."""
    sbx = sandbox(request)
    path = _query_path(request)

    metrics = runtime(request).manager.metrics

    async def body() -> AsyncIterator[bytes]:
        async for chunk in request.content.iter_any():
            metrics.count_relayed("files", "in", len(chunk))
            yield chunk

    result = await runtime(request).manager.files.write_file(sbx, path, body(), request.content_length)
    return web.json_response(result, status=201)


@routes.get("/v1/sandboxes/{sandbox_id}/files")
async def read_file(request: web.Request) -> web.StreamResponse:
    """The bytes of the file at ``?path=``, streamed; 404 naming the path if there is none."""
    sbx = sandbox(request)
    path = _query_path(request)
    size, chunks = await runtime(request).manager.files.read_file(sbx, path)
    resp = web.StreamResponse(
        headers={
            "Content-Type": "application/octet-stream",
            "Content-Length": str(size),
            "Cache-Control": "no-store",
        }
    )
    await resp.prepare(request)
    # An error past this point cannot become a JSON error any more: the connection is cut, and
    # the client sees fewer bytes than Content-Length promised.
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            runtime(request).manager.metrics.count_relayed("files", "out", len(chunk))
            await resp.write(chunk)
    await resp.write_eof()
    return resp


@routes.get("/v1/sandboxes/{sandbox_id}/files/list")
async def list_files(request: web.Request) -> web.Response:
    """The entries of the directory ``?path=`` (default: /home/user, the kernel's cwd)."""
    sbx = sandbox(request)
    result = await runtime(request).manager.files.list_files(sbx, _query_path(request, "."))
    return web.json_response(result)


@routes.delete("/v1/sandboxes/{sandbox_id}/files")
async def remove_file(request: web.Request) -> web.Response:
    """Remove the file or empty directory ``?path=`` (``&recursive=true``: with contents)."""
    sbx = sandbox(request)
    await runtime(request).manager.files.remove_file(
        sbx, _query_path(request), _query_bool(request, "recursive")
    )
    return web.Response(status=204)
