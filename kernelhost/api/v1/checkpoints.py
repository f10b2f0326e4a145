"""``/v1/sandboxes/{id}/checkpoints``, ``/restore`` and ``/undo`` (docs/checkpoints.md); a new
sandbox from a checkpoint is ``POST /v1/sandboxes`` with ``checkpoint`` (``routes.py``)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ...sandboxes import CheckpointNotFound
from ..state import KEY_ID, json_object
from .requests import field, runtime, sandbox

checkpoint_routes = web.RouteTableDef()


@checkpoint_routes.post("/v1/sandboxes/{sandbox_id}/checkpoints")
async def take_checkpoint(request: web.Request) -> web.Response:
    """Freeze the sandbox's whole state (body ``{"label": "..."}``, optional); 201 with it."""
    body = await json_object(request)
    label = field(body, "label", str)
    sbx = sandbox(request)
    # shielded: once the VM is frozen, the file is written whether or not the client waits
    cp = await asyncio.shield(runtime(request).manager.checkpoint(sbx, label))
    return web.json_response(cp.to_dict(), status=201)


@checkpoint_routes.get("/v1/sandboxes/{sandbox_id}/checkpoints")
async def list_checkpoints(request: web.Request) -> web.Response:
    cps = runtime(request).manager.checkpoints(sandbox(request))
    return web.json_response({"checkpoints": [c.to_dict() for c in cps]})


@checkpoint_routes.get("/v1/sandboxes/{sandbox_id}/checkpoints/{checkpoint_id}")
async def get_checkpoint(request: web.Request) -> web.Response:
    sbx = sandbox(request)
    cp = runtime(request).manager.get_checkpoint(request[KEY_ID], request.match_info["checkpoint_id"])
    if cp.sandbox_id != sbx.id:
        raise CheckpointNotFound(cp.id)
    return web.json_response(cp.to_dict())


@checkpoint_routes.delete("/v1/sandboxes/{sandbox_id}/checkpoints/{checkpoint_id}")
async def delete_checkpoint(request: web.Request) -> web.Response:
    manager = runtime(request).manager
    await manager.delete_checkpoint(sandbox(request), request.match_info["checkpoint_id"])
    return web.Response(status=204)


@checkpoint_routes.post("/v1/sandboxes/{sandbox_id}/restore")
async def restore(request: web.Request) -> web.Response:
    """Rewind the sandbox to one of its checkpoints (body ``{"checkpoint": "cp_..."}``): every
    variable, import and file as it was then; a running call ends with status ``restored``."""
    body = await json_object(request)
    cid = field(body, "checkpoint", str, required=True)
    sbx = sandbox(request)
    cp = await asyncio.shield(runtime(request).manager.restore(sbx, cid))
    return web.json_response({"checkpoint": cp.to_dict(), "sandbox": sbx.to_dict()})


@checkpoint_routes.post("/v1/sandboxes/{sandbox_id}/undo")
async def undo(request: web.Request) -> web.Response:
    """Rewind to before the ``n``-th last call (body ``{"n": 1}``); needs ``auto_checkpoint``."""
    body = await json_object(request)
    n = field(body, "n", int, 1)
    sbx = sandbox(request)
    cp = await asyncio.shield(runtime(request).manager.undo(sbx, n))
    return web.json_response({"checkpoint": cp.to_dict(), "sandbox": sbx.to_dict()})
