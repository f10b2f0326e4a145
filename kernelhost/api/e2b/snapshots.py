"""E2B's snapshots over kept checkpoints (docs/e2b.md, docs/checkpoints.md): a snapshot is a
checkpoint of the sandbox's whole state (variables, imports, files, the shell) that outlives
the sandbox until it is deleted, and counts against the key's checkpoint bytes until then.

- ``POST /sandboxes/{id}/snapshots`` (``{"name"?, "memory"?}``) answers 201 with
  ``{"snapshotID", "names"}``. A named snapshot's id is its name, and taking another of that
  name replaces it (E2B assigns a new build to the existing snapshot template); an unnamed
  one's id is the checkpoint's (``cp_...``) and its ``names`` are empty. ``memory: false``
  (the SDKs' ``mode="filesystem"``) is refused: a sandbox's files live in its VM's memory.
- ``GET /snapshots`` (``sandboxID``, ``name``, ``limit``, ``nextToken``): the key's snapshots,
  oldest first, the next page's token in ``x-next-token``.
- ``DELETE /templates/{id}`` (how the SDKs delete a snapshot): 204, or 404 for no such
  snapshot (the SDKs' ``False``).
- ``POST /sandboxes`` with a snapshot's id or name as ``templateID`` starts a sandbox from it
  (``find``; a branch, in the network mode the snapshot's sandbox had unless the request says).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

from aiohttp import web

from ...sandboxes import CheckpointNotFound, CheckpointRecord, Sandbox, SandboxManager
from ..state import KEY_ID
from .common import E2BError, lifecycle_view, paginate, read_body, runtime

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
CHECKPOINT_ID = re.compile(r"^cp_[0-9a-f]{16}$")
DEFAULT_PAGE = 100  # the SDKs' default limit


def wire(cp: CheckpointRecord) -> dict[str, Any]:
    """A snapshot as E2B's ``SnapshotInfo``."""
    return {"snapshotID": cp.label or cp.id, "names": [cp.label] if cp.label else []}


def _named(manager: SandboxManager, owner: str, ref: str) -> list[CheckpointRecord]:
    """The key's snapshots ``ref`` names (its id or its name), oldest first."""
    return [c for c in manager.owner_checkpoints(owner, kept_only=True) if ref in (c.id, c.label)]


def find(manager: SandboxManager, owner: str, template_id: str) -> str | None:
    """The checkpoint a create's ``templateID`` names: a snapshot's name, or the id of any of
    the key's checkpoints (an unknown ``cp_...`` is a 404); None for a template name."""
    if CHECKPOINT_ID.match(template_id):
        return manager.get_checkpoint(owner, template_id).id
    named = _named(manager, owner, template_id)
    return named[-1].id if named else None


def _templates(request: web.Request, owner: str) -> set[str]:
    rt = runtime(request)
    return {v.name for v in rt.manager.template_list(owner)} | set(rt.settings.e2b_template_map)


def _name(request: web.Request, owner: str, body: dict[str, Any]) -> str | None:
    name = body.get("name")
    if name is None or name == "":
        return None
    if not isinstance(name, str) or not NAME.match(name) or CHECKPOINT_ID.match(name):
        raise E2BError(
            400,
            f"name={str(name)[:60]!r}: a snapshot's name is 1 to 100 letters, digits, '.', '_' and "
            "'-', starting with a letter or digit (kernelhost has no namespaces or tags)",
        )
    if name in _templates(request, owner):
        raise E2BError(409, f"{name!r} is the name of a template; give the snapshot another name")
    return name


def _check_memory(body: dict[str, Any]) -> None:
    memory = body.get("memory", True)
    if memory is False:
        raise E2BError(
            400,
            'filesystem-only snapshots (mode="filesystem") are not supported by kernelhost: a '
            "sandbox's files live in its VM's memory, so a snapshot keeps both; take a full "
            'snapshot (mode="full", the default)',
        )
    if not isinstance(memory, bool):
        raise E2BError(400, f"memory={memory!r} must be true or false")


async def _take(manager: SandboxManager, sbx: Sandbox, name: str | None) -> CheckpointRecord:
    owner = sbx.record.owner
    cp = await manager.checkpoint_kept(sbx, name)
    if name is not None:  # the name now means this state: the earlier snapshots of it go
        for old in _named(manager, owner, name):
            if old.id != cp.id:
                with contextlib.suppress(CheckpointNotFound):  # deleted meanwhile
                    manager.discard_checkpoint(owner, old.id)
    return cp


@lifecycle_view
async def create_snapshot(request: web.Request) -> web.Response:
    body = await read_body(request)
    manager, owner = runtime(request).manager, request[KEY_ID]
    _check_memory(body)
    name = _name(request, owner, body)
    sbx = manager.get(owner, request.match_info["sandbox_id"])
    # shielded: once the VM is frozen, the snapshot is written whether or not the client waits
    cp = await asyncio.shield(_take(manager, sbx, name))
    return web.json_response(wire(cp), status=201)


@lifecycle_view
async def list_snapshots(request: web.Request) -> web.Response:
    query = request.query
    found = runtime(request).manager.owner_checkpoints(request[KEY_ID], kept_only=True)
    if query.get("sandboxID"):
        found = [c for c in found if c.sandbox_id == query["sandboxID"]]
    if query.get("name"):
        found = [c for c in found if query["name"] in (c.id, c.label)]
    page, headers = paginate(request, found, DEFAULT_PAGE)
    return web.json_response([wire(c) for c in page], headers=headers)


@lifecycle_view
async def delete_snapshot(request: web.Request) -> web.Response:
    """``DELETE /templates/{id}``: E2B's SDKs delete a snapshot as the template it is there."""
    manager, owner = runtime(request).manager, request[KEY_ID]
    ref = request.match_info["template_id"]
    gone = _named(manager, owner, ref)
    if not gone:
        if ref in _templates(request, owner):
            raise E2BError(
                501,
                f"deleting template {ref!r} through E2B's API is not supported by kernelhost's E2B "
                f"surface (use DELETE /v1/templates/{ref})",
            )
        raise E2BError(404, f"no snapshot {ref!r} for this API key")
    for cp in gone:
        with contextlib.suppress(CheckpointNotFound):
            manager.discard_checkpoint(owner, cp.id)
    return web.Response(status=204)


def add_routes(app: web.Application, prefix: str) -> None:
    """Before the lifecycle's catch-all routes for the E2B features kernelhost refuses."""
    r = app.router
    r.add_post(f"{prefix}/sandboxes/{{sandbox_id}}/snapshots", create_snapshot)
    r.add_get(f"{prefix}/snapshots", list_snapshots)
    r.add_delete(f"{prefix}/templates/{{template_id}}", delete_snapshot)
