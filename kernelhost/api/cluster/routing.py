"""A node of a cluster, as HTTP (docs/cluster.md): any node serves the whole API.

- A call for a sandbox on another live node is forwarded to it (``forward.py``), streamed both
  ways; the client's key was checked here, once, and the call to the peer is signed as acting
  for that key (``peers.py``, ``signing.py``), without the client's credentials. A sandbox
  whose node died answers 410; a hibernated one of a dead or draining node is taken over by the
  live node with its build and the most room (this one, or the peer the call is forwarded to)
  and wakes there. A node whose row in the store is refused (``Node.refused``) gets nothing.
- ``POST /v1/sandboxes`` is placed: the node with the template and the most room, reserved in one
  transaction with the key's limits; the reservation goes along to the node that makes it.
- ``GET /v1/cluster/nodes`` and ``POST /v1/cluster/nodes/{node_id}/drain``: operator keys, or
  a call signed for the cluster itself (``kernelhost node drain``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from ...sandboxes import (
    FORWARDED_RESERVATION,
    HOST_FAILED,
    HostFailed,
    InvalidRequest,
    Node,
    NodeRefused,
    NodeUnreachable,
    Remedy,
    SandboxManager,
    sandbox_view,
)
from ..e2b import common as e2b_common
from ..e2b import snapshots as e2b_snapshots
from ..e2b.common import our_template
from ..errors import Handler
from ..gateway.kernels import kernel_id
from ..state import KEY_ID, KEYS, RUNTIME
from .forward import PeerUnreachable, forward, new_session
from .peers import OPERATOR, PEER, setup_peers, signer
from .signing import RESERVATION

log = structlog.get_logger("kernelhost.cluster")

PEERS = web.AppKey("cluster_peers", aiohttp.ClientSession)
CREATES = frozenset({"/v1/sandboxes", "/e2b/sandboxes", "/e2b/v2/sandboxes"})  # placed on the node with room


def is_operator(request: web.Request) -> bool:
    return bool(request.get(OPERATOR)) or request.get(KEY_ID) in request.app[KEYS].operators


async def _sessions(app: web.Application) -> AsyncIterator[None]:
    app[PEERS] = new_session()
    yield
    await app[PEERS].close()


def _manager(request: web.Request) -> SandboxManager | None:
    rt = request.app.get(RUNTIME)
    return rt.manager if rt is not None and rt.manager.cluster is not None else None


def _target(request: web.Request, manager: SandboxManager) -> str | None:
    """The sandbox a call is about, from its route: a sandbox id or a kernel id."""
    info = request.match_info
    if "sandbox_id" in info:
        return info["sandbox_id"]
    wanted = info.get("kernel_id")
    if wanted is None or wanted.startswith("sbx_"):
        return wanted
    cluster = manager.cluster
    assert cluster is not None
    for rec in cluster.records_of(request[KEY_ID]):
        if kernel_id(rec.id) == wanted:
            return rec.id
    return wanted


@web.middleware
async def cluster_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    manager = _manager(request)
    if manager is None or request.get(KEY_ID) is None:
        return await handler(request)
    if request.get(PEER):  # forwarded here by the node the client called: served here, always
        if RESERVATION in request.headers:  # signed along with the call
            FORWARDED_RESERVATION.set(request.headers[RESERVATION])
        await _take_over_for_peer(request, manager)
        return await handler(request)
    if request.method == "POST" and request.path in CREATES:
        return await _create(request, handler, manager)
    try:
        return await _route(request, handler, manager)
    except (HostFailed, NodeUnreachable) as exc:
        if not request.path.startswith("/e2b/"):
            raise
        status = 410 if isinstance(exc, HostFailed) else 503  # in E2B's shape, which its SDKs parse
        return web.json_response({"code": status, "message": exc.message}, status=status)


async def _route(request: web.Request, handler: Handler, manager: SandboxManager) -> web.StreamResponse:
    """A call about one sandbox: served here, taken over, refused (410) or forwarded."""
    sandbox_id = _target(request, manager)
    if sandbox_id is None or manager.find(sandbox_id) is not None:
        return await handler(request)
    assert manager.cluster is not None
    known = manager.cluster.peer_of(sandbox_id, request[KEY_ID])
    if known is not None:  # located before, on a node alive at the last heartbeat
        return await _forward(request, manager, known)
    loc = await asyncio.to_thread(manager.locate, sandbox_id)
    here = manager.cluster.id if manager.cluster is not None else ""
    if loc is None or loc.record.owner != request[KEY_ID] or loc.node is None or loc.node.id == here:
        return await handler(request)  # unknown, another key's, or ours: answered as usual
    if loc.movable:  # hibernated on a dead or draining node: it wakes where there is room
        target = await asyncio.to_thread(manager.wake_node, loc)
        if target is not None and target.id != here:
            return await _forward(request, manager, target)
        if await asyncio.to_thread(manager.take_over, loc) is not None:
            return await handler(request)
    if loc.lost:
        raise HostFailed(HOST_FAILED, sandbox_id=sandbox_id, node=loc.node.id, remedy=Remedy.RECREATE)
    return await _forward(request, manager, loc.node)


async def _take_over_for_peer(request: web.Request, manager: SandboxManager) -> None:
    """A peer sent a call for a movable sandbox here, to wake it here: this node takes it over."""
    sandbox_id = _target(request, manager)
    if sandbox_id is None or manager.find(sandbox_id) is not None:
        return
    loc = await asyncio.to_thread(manager.locate, sandbox_id)
    if loc is not None and loc.movable and loc.record.owner == request[KEY_ID]:
        await asyncio.to_thread(manager.take_over, loc)


async def _forward(
    request: web.Request,
    manager: SandboxManager,
    to: Node,
    reservation: str = "",
    body: bytes | None = None,
    owner: str | None = None,
) -> web.StreamResponse:
    """Forward ``request`` to the node ``to``, signed as acting for ``owner`` (the caller's key)."""
    assert manager.cluster is not None
    url, node = to.url, to.id
    if to.refused:  # a row this node must not believe (logged when read: cluster.node_refused)
        raise NodeRefused(
            f"node {node} holds this sandbox, but its row in the store is refused ({to.refused}); "
            "see GET /v1/cluster/nodes and the service log",
            node=node,
        )
    who = request[KEY_ID] if owner is None else owner
    sign = signer(request, who, manager.cluster.id, node, reservation)
    try:
        return await forward(request.app[PEERS], request, url, sign, body)
    except PeerUnreachable as exc:
        log.warning("cluster.forward_failed", node=node, error=str(exc))
        raise NodeUnreachable(
            f"node {node} holds this sandbox and did not answer ({exc}); retry, or see "
            "GET /v1/cluster/nodes: a node that stays silent past its lease is declared dead",
            node=node,
        ) from None


def _template_of(request: web.Request, fields: dict[str, Any]) -> str | None:
    """The template a create asks for (None: a create that is not placed, such as a branch from
    a checkpoint, which starts where the checkpoint's file is)."""
    if request.path == "/v1/sandboxes":
        template = fields.get("template", "python") if fields.get("checkpoint") is None else None
    else:  # E2B's: an alias of ours, or a snapshot's name (a branch)
        template = fields.get("templateID") or "base"
        if isinstance(template, str):
            owner = request[KEY_ID]
            if e2b_snapshots.find(request.app[RUNTIME].manager, owner, template) is not None:
                return None
            template = our_template(request, template)
    return template if isinstance(template, str) else None


async def _create(request: web.Request, handler: Handler, manager: SandboxManager) -> web.StreamResponse:
    body = await request.read()
    try:
        fields = json.loads(body or b"{}")
    except ValueError:
        return await handler(request)  # the handler words the error
    template = _template_of(request, fields) if isinstance(fields, dict) else None
    if template is None:
        return await handler(request)
    try:
        placement = await asyncio.to_thread(manager.place, request[KEY_ID], template)
    except InvalidRequest:
        return await handler(request)  # an unknown template: the handler's error names the valid ones
    assert placement is not None and manager.cluster is not None
    rid = placement.reservation
    log.info("cluster.placed", node=placement.node.id, template=template, path=request.path)
    try:
        if placement.node.id == manager.cluster.id:
            FORWARDED_RESERVATION.set(rid)
            return await handler(request)
        return await _forward(request, manager, placement.node, rid, body)
    finally:
        await asyncio.to_thread(manager.release_placement, placement)  # idempotent: the maker released it


async def forward_e2b_sandbox(request: web.Request) -> web.StreamResponse | None:
    """An E2B in-sandbox call (envd, the code interpreter) for a sandbox on another node: its
    access token checked here against the shared record (a call without one is refused as an
    unknown sandbox is, and never reaches a peer), then passed on without it, signed as acting
    for the sandbox's owner. None when the sandbox is this node's (or unknown): it is answered
    here."""
    manager = _manager(request)
    sandbox_id = request.headers.get("E2b-Sandbox-Id", "")
    if manager is None or manager.cluster is None or not sandbox_id or manager.find(sandbox_id):
        return None
    loc = await asyncio.to_thread(manager.locate, sandbox_id)
    if loc is None or loc.node is None or loc.node.id == manager.cluster.id:
        return None
    if not e2b_common.may_use(request, loc.record):
        if request.path == e2b_common.HEALTH_PATH:
            return e2b_common.not_running(request)
        return e2b_common.not_found(request)
    if loc.movable and await asyncio.to_thread(manager.take_over, loc) is not None:
        return None
    if loc.lost:
        return web.json_response({"code": 410, "message": HOST_FAILED}, status=410)
    try:
        return await _forward(request, manager, loc.node, owner=loc.record.owner)
    except NodeUnreachable as exc:
        return web.json_response({"code": 503, "message": exc.message}, status=503)


def remote_views(request: web.Request) -> list[dict[str, Any]]:
    """The caller's sandboxes on other nodes (a dead node's as lost), for the list route."""
    manager = _manager(request)
    if manager is None or manager.cluster is None:
        return []
    cluster = manager.cluster
    nodes = {n.id: n for n in manager.cluster_nodes()}
    views = []
    for rec in cluster.records_of(request[KEY_ID]):
        if manager.find(rec.id) is not None:
            continue
        view = sandbox_view(rec)
        node = nodes.get(rec.node)
        if (node is None or not node.alive) and rec.state != "hibernated":
            view.update(state="dead", detail=HOST_FAILED)
        views.append(view)
    return views


routes = web.RouteTableDef()


def _operator(request: web.Request) -> SandboxManager:
    if not is_operator(request):
        raise web.HTTPForbidden(
            text="cluster routes need an operator key (operator_keys, KERNELHOST_OPERATOR_KEYS)"
        )
    rt = request.app[RUNTIME]
    return rt.manager


@routes.get("/v1/cluster/nodes")
async def list_nodes(request: web.Request) -> web.Response:
    manager = _operator(request)
    if manager.cluster is None:
        return web.json_response({"cluster": False, "nodes": []})
    nodes = await asyncio.to_thread(manager.cluster_nodes)
    views = [n.to_dict() for n in nodes]
    return web.json_response({"cluster": True, "node": manager.cluster.id, "nodes": views})


@routes.post("/v1/cluster/nodes/{node_id}/drain")
async def drain_node(request: web.Request) -> web.StreamResponse:
    manager = _operator(request)
    cluster = manager.cluster
    node_id = request.match_info["node_id"]
    if cluster is None:
        raise InvalidRequest("this service is not a cluster node (store_url is not postgresql://)")
    if node_id != cluster.id:
        node = await asyncio.to_thread(cluster.node, node_id)
        if node is None:
            raise InvalidRequest(f"no node {node_id!r} in the cluster; list them with GET /v1/cluster/nodes")
        return await _forward(request, manager, node)
    hibernated = await manager.drain()
    return web.json_response({"node": node_id, "draining": True, "hibernated": hibernated})


def setup_cluster(app: web.Application) -> None:
    setup_peers(app)
    app.cleanup_ctx.append(_sessions)
    app.add_routes(routes)
