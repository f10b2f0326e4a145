"""HTTP views of templates (``/v1/templates``): build from a spec, list, look at one, follow a
build's log, cancel a build, delete. A spec comes as a JSON body, or as ``multipart/form-data``
with a ``spec`` part (JSON) and a ``files`` part (a tar.gz archive, kept unopened by the service
and unpacked at the spec's ``files_dest`` inside the template's build VM)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import BodyPartReader, web

from ...sandboxes import InvalidRequest
from ..state import KEY_ID, RUNTIME, json_object

routes = web.RouteTableDef()

LOG_TYPE = "application/x-ndjson"


@routes.post("/v1/templates")
async def build_template(request: web.Request) -> web.Response:
    """Start a build (202); its progress is ``GET .../builds/{id}/logs``."""
    data, archive = await _spec_and_files(request)
    manager = request.app[RUNTIME].manager
    build = await manager.build_template(request[KEY_ID], manager.template_spec(data), archive)
    view = manager.template(request[KEY_ID], build.name)
    location = f"/v1/templates/{build.name}/builds/{build.id}"
    return web.json_response(
        {"template": view.wire(), "build": build.wire()}, status=202, headers={"Location": location}
    )


async def _spec_and_files(request: web.Request) -> tuple[dict[str, Any], bytes | None]:
    if not request.content_type.startswith("multipart/"):
        return await json_object(request), None
    settings = request.app[RUNTIME].settings
    spec: Any = None
    archive: bytes | None = None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise InvalidRequest("multipart: nested multipart bodies are not accepted", field="files")
        if part.name == "spec":
            text = (await part.read(decode=True)).decode(errors="replace")
            try:
                spec = json.loads(text)
            except ValueError as exc:
                raise InvalidRequest(f"the 'spec' part is not JSON: {exc}", field="spec") from None
        elif part.name == "files":
            archive = await _read_limited(part, settings.max_file_bytes)
        else:
            raise InvalidRequest(
                f"multipart: unknown part {part.name!r}; send 'spec' and 'files'", field="spec"
            )
    if not isinstance(spec, dict):
        raise InvalidRequest("multipart: a 'spec' part holding a JSON object is required", field="spec")
    return spec, archive


async def _read_limited(part: BodyPartReader, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(1 << 16):
        size += len(chunk)
        if size > limit:
            raise InvalidRequest(f"the files archive is over {limit} bytes (max_file_bytes)", field="files")
        chunks.append(chunk)
    return b"".join(chunks)


@routes.get("/v1/templates")
async def list_templates(request: web.Request) -> web.Response:
    views = request.app[RUNTIME].manager.template_list(request[KEY_ID])
    return web.json_response({"templates": [v.wire() for v in views]})


@routes.get("/v1/templates/{name}")
async def get_template(request: web.Request) -> web.Response:
    manager, owner, name = request.app[RUNTIME].manager, request[KEY_ID], request.match_info["name"]
    return web.json_response(
        {**manager.template(owner, name).wire(), "builds": manager.template_builds(owner, name)}
    )


@routes.delete("/v1/templates/{name}")
async def delete_template(request: web.Request) -> web.Response:
    await request.app[RUNTIME].manager.delete_template(request[KEY_ID], request.match_info["name"])
    return web.Response(status=204)


@routes.get("/v1/templates/{name}/builds/{build_id}")
async def get_build(request: web.Request) -> web.Response:
    manager = request.app[RUNTIME].manager
    build = manager.template_build(
        request[KEY_ID], request.match_info["name"], request.match_info["build_id"]
    )
    return web.json_response(build.wire())


@routes.post("/v1/templates/{name}/builds/{build_id}/cancel")
async def cancel_build(request: web.Request) -> web.Response:
    manager = request.app[RUNTIME].manager
    owner, name, build_id = request[KEY_ID], request.match_info["name"], request.match_info["build_id"]
    build = await manager.cancel_template_build(owner, name, build_id)
    return web.json_response(build.wire())


@routes.get("/v1/templates/{name}/builds/{build_id}/logs")
async def build_logs(request: web.Request) -> web.StreamResponse:
    """The build's events as NDJSON (``{"stage"}``, ``{"log"}``, ``{"state"}``...), followed
    live until the build ends; ``?follow=false`` gives what is there and ends."""
    manager = request.app[RUNTIME].manager
    build = manager.template_build(
        request[KEY_ID], request.match_info["name"], request.match_info["build_id"]
    )
    follow = request.query.get("follow", "true").lower() not in ("0", "false", "no")
    resp = web.StreamResponse(headers={"Content-Type": LOG_TYPE, "Cache-Control": "no-store"})
    await resp.prepare(request)
    events = manager.follow_build(build, follow)
    async for event in events:
        await resp.write(json.dumps(event).encode() + b"\n")
    await resp.write_eof()
    return resp
