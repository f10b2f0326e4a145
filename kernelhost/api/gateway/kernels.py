"""``/api/kernels``: kernels are sandboxes; their REST views and the channels WebSocket.

A kernel's id is a UUID derived from its sandbox id (jupyter_server's routes want UUIDs); the
sandbox id is accepted too, and every kernel model names it (``sandbox_id``).
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import structlog
from aiohttp import web

from ...jupyter import wire
from ...sandboxes import InvalidRequest, Sandbox, SandboxManager, SandboxState, TemplateView, parse_network
from ..state import KEY_ID, RUNTIME, json_object
from .connection import CLOSE_DETACHED, Connection
from .kernelspecs import ALIAS, default_spec, ready_templates, template_of

log = structlog.get_logger("kernelhost.gateway")

#: sandbox metadata that marks a sandbox started through ``POST /api/kernels``
MARK_KEY, MARK_VALUE = "jupyter_gateway", "kernel"
#: sandbox metadata: the kernelspec name a kernel was started under, when not its template's
SPEC_KEY = "jupyter_kernelspec"
KERNEL_ID_NAMESPACE = uuid.UUID("6f1c5e0a-7b3d-4c8e-9a51-2d4b8f0e6c17")
routes = web.RouteTableDef()


def kernel_id(sandbox_id: str) -> str:
    """The sandbox's kernel id: a UUID, as jupyter_server's URL patterns require."""
    return str(uuid.uuid5(KERNEL_ID_NAMESPACE, sandbox_id))


def iso(ts: float) -> str:
    """``last_activity`` exactly as jupyter_server parses it (``%Y-%m-%dT%H:%M:%S.%fZ``)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def kernel_model(sbx: Sandbox) -> dict[str, Any]:
    rec = sbx.record
    session = sbx.kernel
    if rec.state == SandboxState.RUNNING:
        state = session.execution_state if session else ("busy" if sbx.busy else "idle")
    else:  # a hibernated kernel is idle: its next message wakes it
        state = {
            SandboxState.HIBERNATED: "idle",
            SandboxState.STARTING: "starting",
            SandboxState.REPLACING: "restarting",
        }.get(rec.state, "dead")
    last = max(rec.last_active_at, session.last_activity if session else 0.0)
    model: dict[str, Any] = {
        "id": kernel_id(sbx.id),
        "name": rec.metadata.get(SPEC_KEY) or rec.template,
        "last_activity": iso(last),
        "execution_state": state,
        "connections": len(session.clients) if session else 0,
        "sandbox_id": sbx.id,
    }
    if rec.state == SandboxState.DEAD:
        model["reason"] = rec.detail or "the sandbox's VM stopped"
    return model


def _manager(request: web.Request) -> SandboxManager:
    return request.app[RUNTIME].manager


def resolve(request: web.Request) -> Sandbox:
    """The caller's sandbox named by ``{kernel_id}`` (a kernel id or a sandbox id), or 404."""
    manager = _manager(request)
    owner, wanted = request[KEY_ID], request.match_info["kernel_id"]
    sandbox_id = wanted
    if not wanted.startswith("sbx_"):
        sandbox_id = next((s.id for s in manager.owned(owner) if kernel_id(s.id) == wanted), wanted)
    sbx = manager.get(owner, sandbox_id)
    structlog.contextvars.bind_contextvars(sandbox_id=sbx.id)
    return sbx


@routes.get("/api/kernels")
async def list_kernels(request: web.Request) -> web.Response:
    return web.json_response([kernel_model(s) for s in _manager(request).owned(request[KEY_ID])])


def _start_options(body: dict[str, Any], ready: dict[str, TemplateView]) -> dict[str, Any]:
    """The create arguments of a ``POST /api/kernels`` body (Kernel Gateway's, plus ours)."""
    name = body.get("name") or default_spec(list(ready))
    env = body.get("env") or {}
    if not isinstance(name, str) or not isinstance(env, dict):
        raise InvalidRequest(
            "'name' must be a kernelspec name (a template) and 'env' an object of strings",
            field="name" if not isinstance(name, str) else "env",
        )
    template = template_of(name, ready)  # python3: jupyter_server's and notebooks' usual name
    idle = body.get("idle_timeout_seconds", env.get("KERNEL_IDLE_TIMEOUT_SECONDS"))
    if idle is not None:
        try:
            idle = int(idle)
        except (TypeError, ValueError):
            raise InvalidRequest(
                f"idle_timeout_seconds={idle!r:.40} must be a whole number of seconds",
                field="idle_timeout_seconds",
            ) from None
    metadata = {MARK_KEY: MARK_VALUE} | ({SPEC_KEY: ALIAS} if template != name else {})
    user = env.get("KERNEL_USERNAME")
    if isinstance(user, str) and user:
        metadata["jupyter_user"] = user[:200]
    network = body.get("network")
    if network is None and env.get("KERNEL_NETWORK") is not None:
        allow = str(env.get("KERNEL_NETWORK_ALLOW") or "")
        network = {"mode": env["KERNEL_NETWORK"], "allow": [a.strip() for a in allow.split(",") if a.strip()]}
    net = None if network is None else parse_network(network)
    return {"template": template, "idle_timeout": idle, "metadata": metadata, "network": net}


@routes.post("/api/kernels")
async def start_kernel(request: web.Request) -> web.Response:
    """Start a kernel: a new sandbox of the template named ``name`` (a kernelspec name).

    Body (Kernel Gateway's): ``{"name": "python", "env": {"KERNEL_...": "..."}}``; kernelhost
    also takes ``idle_timeout_seconds`` in the body or ``KERNEL_IDLE_TIMEOUT_SECONDS`` in env,
    and the network mode as ``network`` in the body or ``KERNEL_NETWORK`` (``none``,
    ``allowlist``, ``outbound``) with ``KERNEL_NETWORK_ALLOW`` (comma-separated entries) in env:
    jupyter_server forwards ``KERNEL_*`` variables of its own environment.
    """
    body = await json_object(request, null_is_empty=True)
    manager = _manager(request)
    options = _start_options(body, ready_templates(manager, request[KEY_ID]))
    sbx = await manager.create(request[KEY_ID], **options)
    model = kernel_model(sbx)
    log.info("gateway.kernel_started", sandbox_id=sbx.id, kernel_id=model["id"], template=options["template"])
    return web.json_response(model, status=201, headers={"Location": f"/api/kernels/{model['id']}"})


@routes.get("/api/kernels/{kernel_id}")
async def get_kernel(request: web.Request) -> web.Response:
    return web.json_response(kernel_model(resolve(request)))


@routes.delete("/api/kernels/{kernel_id}")
async def delete_kernel(request: web.Request) -> web.Response:
    """Delete a sandbox started as a kernel; detach (close the WebSockets of) any other, so
    shutting down JupyterLab never deletes an agent's sandbox."""
    sbx = resolve(request)
    if sbx.record.metadata.get(MARK_KEY) == MARK_VALUE:
        # Shielded: the deleted kernel's own bridge may hang up as soon as its WebSocket closes,
        # and a removal cut short would leave the sandbox's record behind.
        await asyncio.shield(_manager(request).delete(request[KEY_ID], sbx.id))
        log.info("gateway.kernel_deleted", sandbox_id=sbx.id)
    else:
        for client in list(sbx.kernel.clients if sbx.kernel else ()):
            if isinstance(client, Connection):
                client.close(
                    CLOSE_DETACHED,
                    "detached: this sandbox was not started as a kernel, so it was not deleted",
                )
        log.info("gateway.kernel_detached", sandbox_id=sbx.id)
    return web.Response(status=204)


@routes.post("/api/kernels/{kernel_id}/interrupt")
async def interrupt_kernel(request: web.Request) -> web.Response:
    """Interrupt what runs (a native call, or a Jupyter client's cell); 204 either way."""
    await _manager(request).interrupt(resolve(request))
    return web.Response(status=204)


@routes.post("/api/kernels/{kernel_id}/restart")
async def restart_kernel(request: web.Request) -> web.Response:
    """Restart the kernel (state lost; a dead VM is replaced); 200 with the kernel model.
    JupyterLab reconnects after a REST restart by itself, so no ``restarting`` is broadcast."""
    sbx = resolve(request)
    # a caller gone mid-way must not halve it
    await asyncio.shield(_manager(request).restart(sbx, announce=False))
    log.info("gateway.kernel_restarted", sandbox_id=sbx.id)
    return web.json_response(kernel_model(sbx))


@routes.get("/api/kernels/{kernel_id}/channels")
async def kernel_channels(request: web.Request) -> web.StreamResponse:
    """The kernel's Jupyter messages over a WebSocket, in the legacy JSON text framing, or
    ``v1.kernel.websocket.jupyter.org`` when the client offers it. Every WebSocket attached to
    a sandbox sees the iopub messages of every execution, the native API's included; replies
    go only to the WebSocket that sent the request."""
    manager = _manager(request)
    sbx = resolve(request)
    manager.check_usable(sbx)  # 409 before the upgrade for a dead sandbox
    settings = manager.settings
    ws = web.WebSocketResponse(
        protocols=(wire.V1_PROTOCOL,), heartbeat=30.0, max_msg_size=settings.max_ws_message_bytes
    )
    await ws.prepare(request)
    session = manager.sessions.open(sbx)
    conn = Connection(ws, session)
    session.attach(conn)
    conn.start()
    log.info(
        "gateway.attached",
        sandbox_id=sbx.id,
        connections=len(session.clients),
        protocol=ws.ws_protocol or "legacy",
        session_id=request.query.get("session_id", "")[:64],
    )
    try:
        await conn.serve()
    finally:
        session.detach(conn)
        await conn.stop()
        if not ws.closed:
            await ws.close()
        log.info(
            "gateway.detached", sandbox_id=sbx.id, connections=len(session.clients), close_code=ws.close_code
        )
    return ws
