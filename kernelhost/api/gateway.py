"""The Kernel Gateway API: JupyterLab and other Jupyter tools run their kernels in sandboxes.

``jupyter lab --gateway-url=http://127.0.0.1:8999 --GatewayClient.auth_token=$KERNELHOST_API_KEY``
sends its kernel and kernelspec calls here (contracts.md 5a):

- ``GET /api/kernelspecs[/{name}]``: one kernelspec per template; ``GET /kernelspecs/{name}/{file}``
  its logos;
- ``GET/POST /api/kernels``, ``GET/DELETE /api/kernels/{id}``, ``POST .../interrupt|restart``;
- the WebSocket ``/api/kernels/{id}/channels``, relaying the Jupyter messages of the VM's kernel in
  the legacy JSON text framing, or ``v1.kernel.websocket.jupyter.org`` when the client offers it.

A kernel *is* a sandbox: same owner (other keys get 404), limits and lifecycle (an idle kernel is
hibernated or deleted like any sandbox; its next message wakes a hibernated one). Its id is a UUID
derived from the sandbox id (jupyter_server's routes want UUIDs); the sandbox id is accepted too,
and every kernel model names it (``sandbox_id``). Any sandbox, including one made through the SDK,
can be opened here by its owner (co-attach): every WebSocket attached to a sandbox sees the iopub
messages of every execution, the native API's included. Replies (shell, control, stdin) go only
to the WebSocket that sent the request. ``DELETE`` deletes a sandbox that was started as a kernel
(``POST /api/kernels``); one made elsewhere is only detached, so shutting down JupyterLab never
deletes an agent's sandbox.

Ordering with the native API: while an execute_request of a gateway client is in the kernel, the
gateway holds the sandbox's execution lock, so a native ``execute`` waits for the gateway's cells
(and its timeout cannot interrupt them), and a gateway execute_request waits for a native call
that runs. The gateway's own execute_requests are forwarded at once while it holds the lock, so
the kernel queues them and ``stop_on_error`` works as in any notebook.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import OrderedDict
from datetime import datetime, timezone
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import structlog
from aiohttp import WSMsgType, web

from ..channel import AgentClient, AgentError, ChannelClosed, FrameError, JupyterMessage
from ..jupyter import wire
from ..sandboxes import (
    AgentUnresponsive,
    InvalidRequest,
    Sandbox,
    SandboxError,
    SandboxManager,
    SandboxNotFound,
    SandboxNotRunning,
)
from .state import KEY_ID, RUNTIME, json_object

log = structlog.get_logger("kernelhost.gateway")

#: sandbox metadata that marks a sandbox started through ``POST /api/kernels``
MARK_KEY, MARK_VALUE = "jupyter_gateway", "kernel"
KERNEL_ID_NAMESPACE = uuid.UUID("6f1c5e0a-7b3d-4c8e-9a51-2d4b8f0e6c17")
LOGOS = ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg")
#: messages and bytes a WebSocket may have waiting to be written before it is cut off as too slow
SEND_QUEUE_MESSAGES, SEND_QUEUE_BYTES = 4096, 64 * 1024 * 1024
SHELL_QUEUE = 256  # shell messages a client may queue behind an execute waiting for the lock
ORIGINS_KEPT = 8192  # request msg_ids remembered for routing replies
TOUCH_EVERY = 5.0  # seconds between activity writes to the store


def kernel_id(sandbox_id: str) -> str:
    """The sandbox's kernel id: a UUID, as jupyter_server's URL patterns require."""
    return str(uuid.uuid5(KERNEL_ID_NAMESPACE, sandbox_id))


def iso(ts: float) -> str:
    """``last_activity`` exactly as jupyter_server parses it (``%Y-%m-%dT%H:%M:%S.%fZ``)."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def status_message(state: str, session: str) -> dict[str, Any]:
    """An iopub ``status`` of the gateway's own (restarting, dead), with no parent."""
    return {"header": {"msg_id": uuid.uuid4().hex, "msg_type": "status", "session": session,
                       "username": "kernelhost", "date": datetime.now(timezone.utc).isoformat(),
                       "version": "5.3"},
            "parent_header": {}, "metadata": {}, "content": {"execution_state": state},
            "buffers": []}


class Closed(Exception):
    """End a WebSocket with ``code`` and a reason for the client."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def _closed(exc: Exception) -> Closed:
    if isinstance(exc, Closed):
        return exc
    if isinstance(exc, SandboxNotFound):
        return Closed(4004, "the sandbox was deleted")
    if isinstance(exc, SandboxError):
        return Closed(4009, exc.message)
    if isinstance(exc, FrameError):
        return Closed(1009, f"message too large for the sandbox channel: {exc}")
    return Closed(1011, f"the sandbox's channel closed: {exc}")


class Conn:
    """One attached WebSocket: its outbound queue and writer, and its ordered shell sender."""

    def __init__(self, ws: web.WebSocketResponse, hub: Hub) -> None:
        self.ws = ws
        self.hub = hub
        self.v1 = ws.ws_protocol == wire.V1_PROTOCOL
        self.out: asyncio.Queue[str | bytes] = asyncio.Queue(SEND_QUEUE_MESSAGES)
        self.out_bytes = 0
        self.shell: asyncio.Queue[dict[str, Any]] = asyncio.Queue(SHELL_QUEUE)
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False

    def start(self) -> None:
        self._spawn(self._write_loop())
        self._spawn(self._shell_loop())

    def _spawn(self, coro: Any, name: str = "ws-io") -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def push(self, channel: str, msg: dict[str, Any], cache: dict[bool, str | bytes]) -> None:
        """Queue one message for the client (called on the channel's reader: never blocks)."""
        if self.closing:
            return
        payload = cache.get(self.v1)
        if payload is None:
            msg = _presentable(msg)
            payload = cache[self.v1] = (wire.to_v1(channel, msg) if self.v1
                                        else wire.to_text(channel, msg))
        if self.out.full() or self.out_bytes + len(payload) > SEND_QUEUE_BYTES:
            self.close(1013, f"client too slow: over {SEND_QUEUE_MESSAGES} messages or "
                             f"{SEND_QUEUE_BYTES >> 20} MiB waiting; reconnect")
            return
        self.out_bytes += len(payload)
        self.out.put_nowait(payload)

    def close(self, code: int, reason: str) -> None:
        if not self.closing:
            self.closing = True
            self._spawn(self.ws.close(code=code, message=_reason(reason)), name="ws-close")

    async def _write_loop(self) -> None:
        while True:
            payload = await self.out.get()
            self.out_bytes -= len(payload)
            try:
                if isinstance(payload, str):
                    await self.ws.send_str(payload)
                else:
                    await self.ws.send_bytes(payload)
            except (ConnectionError, RuntimeError):  # closed under us: the reader ends it
                return

    async def _shell_loop(self) -> None:
        while True:
            msg = await self.shell.get()
            try:
                await self.hub.send_shell(self, msg)
            except (SandboxError, ChannelClosed, FrameError, Closed) as exc:
                closed = _closed(exc)
                self.close(closed.code, str(closed))
                return

    async def serve(self) -> None:
        """Read the client's messages until it goes; shell ones keep their order."""
        async for raw in self.ws:
            try:
                if raw.type == WSMsgType.TEXT:
                    channel, msg = wire.from_text(raw.data)
                elif raw.type == WSMsgType.BINARY:
                    channel, msg = (wire.from_v1(raw.data) if self.v1
                                    else wire.from_legacy_binary(raw.data))
                else:
                    continue
                if channel == "iopub":
                    raise wire.WireError("clients cannot send on iopub; use shell, control or "
                                         "stdin")
            except wire.WireError as exc:
                log.warning("gateway.bad_message", sandbox_id=self.hub.sbx.id, error=str(exc))
                self.close(1007, f"not a Jupyter message: {exc}")
                return
            _fill_header(msg["header"])
            try:
                if channel == "shell":
                    await self.shell.put(msg)
                else:
                    await self.hub.send(self, channel, msg)
            except (SandboxError, ChannelClosed, FrameError, Closed) as exc:
                closed = _closed(exc)
                self.close(closed.code, str(closed))
                return

    async def stop(self) -> None:
        self.closing = True
        tasks = list(self.tasks)
        for task in tasks:
            if task.get_name() != "ws-close":  # a close in progress finishes its handshake
                task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, RuntimeError):
                await task


def _reason(text: str) -> bytes:
    """A close reason fits in 123 bytes."""
    data = text.encode()
    return data if len(data) <= 123 else data[:120].decode("utf-8", "ignore").encode() + b"..."


def _fill_header(header: dict[str, Any]) -> None:
    for name, value in (("session", ""), ("username", ""), ("version", "5.3")):
        header.setdefault(name, value)
    header.setdefault("date", datetime.now(timezone.utc).isoformat())


def _presentable(msg: dict[str, Any]) -> dict[str, Any]:
    """JupyterLab rejects a message whose header fields are not strings; fix them in a copy."""
    header = msg.get("header") or {}
    names = ("msg_id", "msg_type", "session", "username", "version", "date")
    if all(isinstance(header.get(n), str) for n in names):
        return msg
    fixed = {**header, **{n: str(header.get(n) or "") for n in names
                          if not isinstance(header.get(n), str)}}
    return {**msg, "header": fixed}


class Hub:
    """The WebSockets attached to one sandbox, and what they have running on its kernel.

    It is one of ``sandbox.listeners`` while it exists: every Jupyter message of the kernel comes
    through ``on_message`` on the channel's reader, so nothing here may block or raise.
    """

    def __init__(self, gateway: Gateway, manager: SandboxManager, sbx: Sandbox) -> None:
        self.gateway = gateway
        self.manager = manager
        self.sbx = sbx
        self.conns: set[Conn] = set()
        self.origin: OrderedDict[str, Conn] = OrderedDict()  # request msg_id -> its sender
        self.outstanding: set[str] = set()  # gateway execute_requests the kernel has not ended
        self.holding = False  # we hold sbx.lock on behalf of ``outstanding``
        self.quiet_restart = False  # a REST restart runs: its clients reconnect by themselves
        self.session = uuid.uuid4().hex  # of the status messages the gateway writes itself
        self.execution_state = "busy" if sbx.busy else "idle"
        self.last_activity = sbx.record.last_active_at
        self._touched = 0.0

    # -- listener hooks (SandboxListener) -------------------------------------------------------

    def on_message(self, m: JupyterMessage) -> None:
        kind, parent = m.msg_type, m.parent_id
        if kind == "iopub_welcome":  # about the agent's own subscription, not a client's
            return
        if m.channel == "iopub":
            if kind == "status":
                state = m.content.get("execution_state")
                if isinstance(state, str):
                    self.execution_state = state
                if state == "idle" and parent in self.outstanding:
                    self._done(parent)
            targets = list(self.conns)
        else:
            conn = self.origin.get(parent) if parent else None
            if m.channel != "stdin" and kind.endswith("_reply") and parent:
                self.origin.pop(parent, None)
                if kind == "execute_reply" and parent in self.outstanding:
                    self._done(parent)
            targets = [conn] if conn is not None and conn in self.conns else []
        cache: dict[bool, str | bytes] = {}
        for conn in targets:
            conn.push(m.channel, m.msg, cache)
        self._touch()

    def on_event(self, event: dict[str, Any]) -> None:
        what = event.get("event")
        if what == "kernel_died":
            self._settle()
            self.broadcast("restarting")  # JupyterLab reconnects and asks the new kernel
        elif what == "kernel_restarted":
            self._settle()
            if event.get("reason") != "died" and not self.quiet_restart:
                self.broadcast("restarting")  # restarted by another client (SDK, timeout)
            self.execution_state = "idle"  # the agent reports a restart once the kernel is up

    def on_channel(self, connected: bool, reason: str) -> None:
        sbx = self.sbx
        if connected:
            if sbx.record.state == "replacing":  # a fresh VM: the kernel's state is gone
                self._settle()
                self.broadcast("restarting")
                self.execution_state = "idle"
            return
        self._settle()  # replies in flight on the old channel will not come
        if self.manager.sandboxes.get(sbx.id) is not sbx:
            self.broadcast("dead")
            for conn in list(self.conns):
                conn.close(4004, "the sandbox was deleted")
        elif sbx.record.state == "dead":
            self.broadcast("dead")
            for conn in list(self.conns):
                conn.close(4009, f"the sandbox's VM stopped: {reason}")

    # -- bookkeeping ------------------------------------------------------------------------------

    def broadcast(self, state: str) -> None:
        self.execution_state = state
        msg = status_message(state, self.session)
        cache: dict[bool, str | bytes] = {}
        for conn in list(self.conns):
            conn.push("iopub", msg, cache)

    def _done(self, msg_id: str) -> None:
        self.outstanding.discard(msg_id)
        if not self.outstanding:
            self._release()

    def _settle(self) -> None:
        self.outstanding.clear()
        self._release()

    def _release(self) -> None:
        if self.holding:
            self.holding = False
            self.sbx.lock.release()
            self._touch(force=True)
        if not self.conns:
            self.gateway.drop(self)

    def _touch(self, force: bool = False) -> None:
        now = time.time()
        self.last_activity = now
        if force or now - self._touched >= TOUCH_EVERY:
            self._touched = now
            self.sbx.record.last_active_at = now
            if self.manager.sandboxes.get(self.sbx.id) is self.sbx:
                self.manager.store.touch(self.sbx.id, now)

    # -- to the kernel ----------------------------------------------------------------------------

    async def _agent(self) -> AgentClient:
        """The sandbox's live channel, waking a hibernated sandbox (a message is activity)."""
        m, sbx = self.manager, self.sbx
        if m.sandboxes.get(sbx.id) is not sbx:
            raise SandboxNotFound(sbx.id)
        await m._wait_replacement(sbx)
        if sbx.record.state == "hibernated":
            if self.holding:
                await m._ensure_awake(sbx)
            else:
                async with sbx.lock:
                    await m._ensure_awake(sbx)
        m._check_running(sbx)
        agent = sbx.agent
        if agent is None or not agent.connected:
            raise SandboxNotRunning(f"sandbox {sbx.id} has no live VM channel right now; "
                                    "reconnect, or restart the kernel", state=sbx.record.state)
        return agent

    async def send(self, conn: Conn, channel: str, msg: dict[str, Any]) -> None:
        self.origin[msg["header"]["msg_id"]] = conn
        while len(self.origin) > ORIGINS_KEPT:
            self.origin.popitem(last=False)
        agent = await self._agent()
        await agent.send_jupyter(channel, msg)
        self._touch()

    async def send_shell(self, conn: Conn, msg: dict[str, Any]) -> None:
        """A shell message; an execute_request first makes sure the gateway holds the lock."""
        msg_id = msg["header"]["msg_id"]
        execute = (msg["header"]["msg_type"] == "execute_request"
                   and isinstance(msg["content"].get("code"), str))
        if execute:
            if not self.holding:
                await self.sbx.lock.acquire()  # behind a native call that runs now
                self.holding = True
            self.outstanding.add(msg_id)
        try:
            await self.send(conn, "shell", msg)
        except BaseException:
            if execute:
                self._done(msg_id)
            raise

    def attach(self, conn: Conn) -> None:
        self.conns.add(conn)

    def detach(self, conn: Conn) -> None:
        self.conns.discard(conn)
        if not self.conns and not self.outstanding:
            self.gateway.drop(self)


class Gateway:
    """The hubs of the sandboxes that have WebSockets attached; owned by the app."""

    def __init__(self) -> None:
        self.hubs: dict[str, Hub] = {}
        self.ids: dict[str, str] = {}  # kernel id -> sandbox id (derived; a cache)

    def resolve(self, request: web.Request) -> Sandbox:
        """The caller's sandbox named by ``{kernel_id}`` (a kernel id or a sandbox id), or 404."""
        manager = request.app[RUNTIME].manager
        owner, wanted = request[KEY_ID], request.match_info["kernel_id"]
        sandbox_id = wanted if wanted.startswith("sbx_") else self.ids.get(wanted)
        if sandbox_id is None:
            self.ids = {kernel_id(s.id): s.id for s in manager.sandboxes.values()}
            sandbox_id = self.ids.get(wanted)
        sbx = manager.get(owner, sandbox_id or wanted)
        structlog.contextvars.bind_contextvars(sandbox_id=sbx.id)
        return sbx

    def hub(self, manager: SandboxManager, sbx: Sandbox) -> Hub:
        hub = self.hubs.get(sbx.id)
        if hub is None or hub.sbx is not sbx:
            hub = self.hubs[sbx.id] = Hub(self, manager, sbx)
            sbx.listeners.add(hub)
        return hub

    def drop(self, hub: Hub) -> None:
        hub.sbx.listeners.discard(hub)
        if self.hubs.get(hub.sbx.id) is hub:
            del self.hubs[hub.sbx.id]

    def model(self, sbx: Sandbox) -> dict[str, Any]:
        rec = sbx.record
        hub = self.hubs.get(sbx.id)
        if rec.state == "running":
            state = hub.execution_state if hub else (
                "busy" if sbx.busy or sbx.lock.locked() else "idle")
        else:  # a hibernated kernel is idle: its next message wakes it
            state = {"hibernated": "idle", "starting": "starting",
                     "replacing": "restarting"}.get(rec.state, "dead")
        last = max(rec.last_active_at, hub.last_activity if hub else 0.0)
        model: dict[str, Any] = {
            "id": kernel_id(sbx.id), "name": rec.template, "last_activity": iso(last),
            "execution_state": state, "connections": len(hub.conns) if hub else 0,
            "sandbox_id": sbx.id,
        }
        if rec.state == "dead":
            model["reason"] = rec.detail or "the sandbox's VM stopped"
        return model

    async def close_all(self, app: web.Application) -> None:
        """On shutdown: close every WebSocket (going away) and give back the locks held."""
        for hub in list(self.hubs.values()):
            hub._settle()
            for conn in list(hub.conns):
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await conn.ws.close(code=1001, message=b"kernelhost is shutting down")


GATEWAY = web.AppKey("gateway", Gateway)
routes = web.RouteTableDef()


def setup_gateway(app: web.Application) -> None:
    """Add the Kernel Gateway routes and their WebSocket registry to ``app``."""
    app[GATEWAY] = Gateway()
    app.on_shutdown.append(app[GATEWAY].close_all)
    app.add_routes(routes)


def _manager(request: web.Request) -> SandboxManager:
    return request.app[RUNTIME].manager


# -- kernelspecs --------------------------------------------------------------------------------


def _logo_dir() -> Path | None:
    spec = find_spec("ipykernel")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "resources"
    return path if path.is_dir() else None


def _spec_model(name: str) -> dict[str, Any]:
    logos = _logo_dir()
    resources = {f.rsplit(".", 1)[0]: f"/kernelspecs/{name}/{f}"
                 for f in LOGOS if logos is not None and (logos / f).is_file()}
    return {"name": name, "resources": resources, "spec": {
        # what runs in the VM; shown to clients, never run by them
        "argv": ["python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python 3 (kernelhost VM, {name})", "language": "python",
        "interrupt_mode": "signal", "env": {},
        "metadata": {"kernelhost": {"template": name}, "debugger": False}}}


def _default_spec(templates: list[str]) -> str:
    return "python" if "python" in templates or not templates else templates[0]


@routes.get("/api/kernelspecs")
async def list_kernelspecs(request: web.Request) -> web.Response:
    templates = _manager(request).templates()
    return web.json_response({"default": _default_spec(templates),
                              "kernelspecs": {t: _spec_model(t) for t in templates}})


@routes.get("/api/kernelspecs/{name}")
async def get_kernelspec(request: web.Request) -> web.Response:
    name, templates = request.match_info["name"], _manager(request).templates()
    if name not in templates:
        raise web.HTTPNotFound(text=json.dumps({"error": {
            "code": "kernelspec_not_found",
            "message": f"no kernelspec {name!r}; kernelspecs are the templates: "
                       f"{', '.join(templates) or 'none built (run make image)'}"}}),
            content_type="application/json")
    return web.json_response(_spec_model(name))


@routes.get("/kernelspecs/{name}/{file}")
async def kernelspec_resource(request: web.Request) -> web.StreamResponse:
    name, file = request.match_info["name"], request.match_info["file"]
    logos = _logo_dir()
    if name not in _manager(request).templates() or file not in LOGOS or logos is None:
        raise web.HTTPNotFound()
    return web.FileResponse(logos / file)


# -- kernels ------------------------------------------------------------------------------------


@routes.get("/api/kernels")
async def list_kernels(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    return web.json_response([gateway.model(s) for s in _manager(request).owned(request[KEY_ID])])


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
    name = body.get("name") or _default_spec(manager.templates())
    if name == "python3" and "python3" not in manager.templates():
        name = _default_spec(manager.templates())  # jupyter_server's and notebooks' usual name
    env = body.get("env") or {}
    if not isinstance(name, str) or not isinstance(env, dict):
        raise InvalidRequest("'name' must be a kernelspec name (a template) and 'env' an object "
                             "of strings", field="name" if not isinstance(name, str) else "env")
    idle = body.get("idle_timeout_seconds", env.get("KERNEL_IDLE_TIMEOUT_SECONDS"))
    if idle is not None:
        try:
            idle = int(idle)
        except (TypeError, ValueError):
            raise InvalidRequest(f"idle_timeout_seconds={idle!r:.40} must be a whole number of "
                                 "seconds", field="idle_timeout_seconds") from None
    metadata = {MARK_KEY: MARK_VALUE}
    user = env.get("KERNEL_USERNAME")
    if isinstance(user, str) and user:
        metadata["jupyter_user"] = user[:200]
    network = body.get("network")
    if network is None and env.get("KERNEL_NETWORK") is not None:
        allow = str(env.get("KERNEL_NETWORK_ALLOW") or "")
        network = {"mode": env["KERNEL_NETWORK"],
                   "allow": [a.strip() for a in allow.split(",") if a.strip()]}
    sbx = await manager.create(request[KEY_ID], name, idle, metadata, network=network)
    model = request.app[GATEWAY].model(sbx)
    log.info("gateway.kernel_started", sandbox_id=sbx.id, kernel_id=model["id"], template=name)
    return web.json_response(model, status=201,
                             headers={"Location": f"/api/kernels/{model['id']}"})


@routes.get("/api/kernels/{kernel_id}")
async def get_kernel(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    return web.json_response(gateway.model(gateway.resolve(request)))


@routes.delete("/api/kernels/{kernel_id}")
async def delete_kernel(request: web.Request) -> web.Response:
    """Delete a sandbox started as a kernel; detach (close the WebSockets of) any other."""
    gateway = request.app[GATEWAY]
    sbx = gateway.resolve(request)
    if sbx.record.metadata.get(MARK_KEY) == MARK_VALUE:
        # Shielded: the deleted kernel's own bridge may hang up as soon as its WebSocket closes,
        # and a removal cut short would leave the sandbox's record behind.
        await asyncio.shield(_manager(request).delete(request[KEY_ID], sbx.id))
        log.info("gateway.kernel_deleted", sandbox_id=sbx.id)
    else:
        hub = gateway.hubs.get(sbx.id)
        for conn in list(hub.conns if hub else ()):
            conn.close(1000, "detached: this sandbox was not started as a kernel, so it was "
                             "not deleted")
        log.info("gateway.kernel_detached", sandbox_id=sbx.id)
    return web.Response(status=204)


@routes.post("/api/kernels/{kernel_id}/interrupt")
async def interrupt_kernel(request: web.Request) -> web.Response:
    """Interrupt what runs (a native call, or a gateway client's cell); 204 either way."""
    manager = _manager(request)
    sbx = request.app[GATEWAY].resolve(request)
    if sbx.control is not None:  # a native call runs: the manager knows how (python or bash)
        await manager.interrupt(sbx)
        return web.Response(status=204)
    agent = sbx.agent
    if sbx.record.state == "running" and agent is not None and agent.connected:
        try:
            await agent.request("interrupt", timeout=manager.settings.agent_timeout)
        except (asyncio.TimeoutError, AgentError, ChannelClosed) as exc:
            raise AgentUnresponsive(
                f"the agent of sandbox {sbx.id} did not carry out the interrupt within "
                f"{manager.settings.agent_timeout:g}s ({exc or type(exc).__name__}); restart "
                "the kernel") from exc
    return web.Response(status=204)  # a hibernated or starting sandbox runs nothing


@routes.post("/api/kernels/{kernel_id}/restart")
async def restart_kernel(request: web.Request) -> web.Response:
    """Restart the kernel (state lost; a dead VM is replaced); 200 with the kernel model."""
    gateway, manager = request.app[GATEWAY], _manager(request)
    sbx = gateway.resolve(request)
    hub = gateway.hubs.get(sbx.id)
    if hub is not None:
        hub.quiet_restart = True  # JupyterLab reconnects after a REST restart by itself
    try:
        await asyncio.shield(manager.restart(sbx))  # a caller gone mid-way must not halve it
    finally:
        if hub is not None:
            hub.quiet_restart = False
    log.info("gateway.kernel_restarted", sandbox_id=sbx.id)
    return web.json_response(gateway.model(sbx))


@routes.get("/api/kernels/{kernel_id}/channels")
async def kernel_channels(request: web.Request) -> web.StreamResponse:
    """The kernel's Jupyter messages over a WebSocket (see the module docstring)."""
    gateway, manager = request.app[GATEWAY], _manager(request)
    sbx = gateway.resolve(request)
    manager._check_running(sbx)  # 409 before the upgrade for a dead sandbox
    settings = manager.settings
    ws = web.WebSocketResponse(protocols=(wire.V1_PROTOCOL,), heartbeat=30.0,
                               max_msg_size=settings.max_code_bytes + 1024 * 1024)
    await ws.prepare(request)
    hub = gateway.hub(manager, sbx)
    conn = Conn(ws, hub)
    hub.attach(conn)
    conn.start()
    log.info("gateway.attached", sandbox_id=sbx.id, connections=len(hub.conns),
             protocol=ws.ws_protocol or "legacy",
             session_id=request.query.get("session_id", "")[:64])
    try:
        await conn.serve()
    finally:
        hub.detach(conn)
        await conn.stop()
        if not ws.closed:
            await ws.close()
        log.info("gateway.detached", sandbox_id=sbx.id, connections=len(hub.conns),
                 close_code=ws.close_code)
    return ws
