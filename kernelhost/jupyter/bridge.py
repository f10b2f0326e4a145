"""The local end of a provisioned kernel: Jupyter's ZeroMQ sockets on 127.0.0.1, relayed to the
kernel's Kernel Gateway WebSocket on the kernelhost service.

``KernelhostProvisioner`` starts ``python -m kernelhost.jupyter.bridge`` and writes its
configuration as one JSON object to its stdin::

    {"url": "http://127.0.0.1:8999", "api_key": "...", "kernel_id": "<uuid>",
     "ip": "127.0.0.1", "ports": {"shell_port": 0, ...}, "key": "<hex>",
     "signature_scheme": "hmac-sha256", "reconnect_seconds": 60,
     "setup": "<a cell>", "setup_timeout": 120, "parent_pid": 1234}

It binds the five sockets (a port of 0 picks a free one; a restart passes the previous ports so
connected clients keep working), connects the WebSocket with the ``v1.kernel.websocket.jupyter.org``
framing (binary buffers survive), runs ``setup`` (if any: the provisioner's forwarded variables
and working directory, ``workdir.py``) as a silent cell that stores no history, and prints
``{"ports": {...}}`` (or ``{"error": "..."}`` and exits 1) as its only line on stdout.
Messages from local clients are checked against the session key and forwarded as they are;
replies come back to the socket identity that sent the request (a shell reply only once its
request's ``idle`` status is out, or after ``REPLY_HOLD_S``); iopub goes to every subscriber.
A ``shutdown_request`` on control is answered here and ends the process; without ``restart`` it
first deletes the kernel (as a local kernel ends when asked), so a client with no kernel manager
(``jupyter console``) leaves nothing behind. A restart is the provisioner's to carry out over
HTTP. If the WebSocket drops, the bridge reconnects for up to ``reconnect_seconds``; a deleted or
dead sandbox ends it at once, and so does a kernel that died or was restarted under it (the
service's ``restarting`` status), as a local kernel process ends when its kernel dies. The bridge
also ends, deleting the kernel, when ``parent_pid`` (the manager's process) is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections import OrderedDict
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from jupyter_client.session import Session

from .wire import V1_PROTOCOL, WireError, from_text, pack_v1, unpack_v1

DELIM = b"<IDS|MSG>"
SOCKETS = (
    ("shell", zmq.ROUTER),
    ("control", zmq.ROUTER),
    ("stdin", zmq.ROUTER),
    ("iopub", zmq.XPUB),
    ("hb", zmq.REP),
)
ROUTES_KEPT = 8192
REPLY_HOLD_S = 3.0  # the longest a shell reply waits for its request's idle status
IDLE_KEPT = 256  # requests whose idle went out before their reply (a kernel may publish it first)
PARENT_POLL_S = 1.0  # how often the bridge checks that its parent lives
FATAL_CLOSE_CODES = {4004: "the sandbox was deleted", 4009: "the sandbox is not running"}


def log(*parts: Any) -> None:
    print("kernelhost bridge:", *parts, file=sys.stderr, flush=True)


class Bridge:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.session = Session(
            key=str(cfg["key"]).encode(),
            check_pid=False,
            signature_scheme=cfg.get("signature_scheme", "hmac-sha256"),
            username="kernelhost",
        )
        self.ctx = zmq.asyncio.Context()
        self.socks: dict[str, zmq.asyncio.Socket] = {}
        self.ports: dict[str, int] = {}
        self.routes: OrderedDict[str, list[bytes]] = OrderedDict()  # request msg_id -> identity
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.connected = asyncio.Event()
        self.done = asyncio.Event()
        self.exit_code = 0
        self.http: aiohttp.ClientSession | None = None
        self.deleting = False  # the kernel is being deleted: its WebSocket's end is expected
        # shell replies held until their request's idle is out on iopub: request msg_id ->
        # (release time, frames). A client reads iopub up to the idle after the reply, allowing
        # a local kernel's gap (jupyter_kernel_test: 0.1 s per message), not an emulated VM's
        self.held: dict[str, tuple[float, list[bytes]]] = {}
        self.idle: OrderedDict[str, None] = OrderedDict()

    def bind(self) -> None:
        ip = self.cfg.get("ip", "127.0.0.1")
        wanted = self.cfg.get("ports") or {}
        for name, kind in SOCKETS:
            sock = self.ctx.socket(kind)
            sock.linger = 1000
            if kind == zmq.ROUTER:
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client that reconnects takes over
            if kind == zmq.XPUB:
                sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, for iopub_welcome
            port = int(wanted.get(f"{name}_port") or 0)
            if port:
                sock.bind(f"tcp://{ip}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{ip}")
            self.socks[name], self.ports[f"{name}_port"] = sock, port

    async def connect(self) -> None:
        """Open the WebSocket; raises with a message that names the cause."""
        url = self.cfg["url"].rstrip("/").replace("http", "ws", 1)
        url = f"{url}/api/kernels/{self.cfg['kernel_id']}/channels"
        if self.http is None:
            self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(
            url,
            protocols=(V1_PROTOCOL,),
            heartbeat=30.0,
            max_msg_size=0,
            headers={"Authorization": f"token {self.cfg['api_key']}"},
            timeout=aiohttp.ClientWSTimeout(ws_close=10.0),
        )
        self.connected.set()

    async def run_setup(self, code: str, timeout: float) -> None:
        """Run ``code`` in the kernel as a silent cell before any client's message is relayed;
        raises ``RuntimeError`` naming the kernel's error. What else arrives meanwhile (the
        cell's own busy and idle) goes to no client: none is served yet."""
        msg = self.session.msg(
            "execute_request",
            {
                "code": code,
                "silent": True,
                "store_history": False,
                "user_expressions": {},
                "allow_stdin": False,
                "stop_on_error": False,
            },
        )
        assert self.ws is not None
        await self.ws.send_bytes(pack_v1("shell", self.session.serialize(msg)[2:]))
        async with asyncio.timeout(timeout):
            async for raw in self.ws:
                if raw.type != aiohttp.WSMsgType.BINARY:
                    continue
                channel, parts = unpack_v1(raw.data)
                if channel != "shell" or len(parts) < 4:
                    continue
                header, parent = json.loads(parts[0]), json.loads(parts[1])
                if (
                    parent.get("msg_id") != msg["header"]["msg_id"]
                    or header.get("msg_type") != "execute_reply"
                ):
                    continue
                content = json.loads(parts[3])
                if content.get("status") != "ok":
                    raise RuntimeError(
                        f"setting the environment and working directory failed in the kernel: "
                        f"{content.get('ename')}: {content.get('evalue')}"
                    )
                return
        raise RuntimeError(f"the WebSocket closed (code {self.ws.close_code}) before the setup cell ended")

    async def run(self) -> int:
        tasks = [
            asyncio.create_task(c)
            for c in (
                self.from_clients("shell"),
                self.from_clients("control"),
                self.from_clients("stdin"),
                self.subscriptions(),
                self.heartbeat(),
                self.from_kernel(),
                self.release_held(),
                self.watch_parent(),
            )
        ]
        try:
            await self.done.wait()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self.ws is not None:
                await self.ws.close()
            if self.http is not None:
                await self.http.close()
            self.ctx.destroy(linger=1000)  # the shutdown_reply still goes out
        return self.exit_code

    async def watch_parent(self) -> None:
        """End with the process that started the bridge (the kernel manager's), as ipykernel ends
        with its parent: a manager that exits without shutting its kernel down (a script that
        never calls shutdown_kernel, a killed tool) leaves no bridge and no sandbox behind."""
        parent = self.cfg.get("parent_pid")
        if not parent:
            return
        while os.getppid() == parent:  # noqa: ASYNC110 (no event tells of a parent's end)
            await asyncio.sleep(PARENT_POLL_S)
        log(f"the process that started the bridge ({parent}) is gone; deleting the kernel")
        self.deleting = True
        await self.delete_kernel()
        self.stop(0)

    def stop(self, code: int) -> None:
        self.exit_code = code
        self.done.set()

    # -- local clients -> kernel -----------------------------------------------------------------

    async def from_clients(self, channel: str) -> None:
        sock = self.socks[channel]
        while True:
            parts = await sock.recv_multipart()
            try:
                idents, msg_list = self.session.feed_identities(parts)
                msg = self.session.deserialize(msg_list, content=False)
            except (ValueError, KeyError, TypeError) as exc:  # bad signature, not Jupyter
                log(f"dropping a {channel} message: {exc}")
                continue
            header = msg["header"]
            if channel == "control" and header.get("msg_type") == "shutdown_request":
                await self.shutdown(idents, msg)
                return
            self.routes[str(header.get("msg_id"))] = idents
            while len(self.routes) > ROUTES_KEPT:
                self.routes.popitem(last=False)
            frame = pack_v1(channel, [p if isinstance(p, bytes) else p.bytes for p in msg_list[1:]])
            await self.connected.wait()
            assert self.ws is not None
            try:
                await self.ws.send_bytes(frame)
            except (ConnectionError, RuntimeError) as exc:
                log(f"lost a {channel} message while the WebSocket reconnects: {exc}")

    async def shutdown(self, idents: list[bytes], msg: dict[str, Any]) -> None:
        """Answer a shutdown_request here and end; the provisioner restarts or deletes over HTTP."""
        content = json.loads(msg["content"]) if isinstance(msg["content"], bytes) else {}
        restart = bool(content.get("restart")) if isinstance(content, dict) else False
        reply = self.session.msg("shutdown_reply", {"status": "ok", "restart": restart}, parent=msg["header"])
        await self.socks["control"].send_multipart(self.session.serialize(reply, ident=idents))
        await self.socks["iopub"].send_multipart(self.session.serialize(reply))
        if not restart:
            # The end of the kernel, as when a local kernel process exits: a client that owns no
            # manager (jupyter console) shuts down with this request alone.
            self.deleting = True
            await self.delete_kernel()
        self.stop(0)

    async def delete_kernel(self) -> None:
        url = f"{self.cfg['url'].rstrip('/')}/api/kernels/{self.cfg['kernel_id']}"
        assert self.http is not None
        try:
            async with self.http.delete(
                url,
                timeout=aiohttp.ClientTimeout(total=30),
                headers={"Authorization": f"token {self.cfg['api_key']}"},
            ) as resp:
                if resp.status not in (204, 404):
                    log(f"deleting the kernel answered {resp.status}: {await resp.text()}")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log(f"could not delete the kernel ({exc}); the service's idle timeout will")

    async def subscriptions(self) -> None:
        """Greet each new iopub subscriber (protocol 5.5), so it knows it is subscribed."""
        sock = self.socks["iopub"]
        while True:
            event = await sock.recv()
            if event[:1] == b"\x01":
                welcome = self.session.msg(
                    "iopub_welcome", {"subscription": event[1:].decode("utf-8", "replace")}
                )
                await sock.send_multipart(self.session.serialize(welcome))

    async def heartbeat(self) -> None:
        sock = self.socks["hb"]
        while True:
            await sock.send(await sock.recv())

    # -- kernel -> local clients -----------------------------------------------------------------

    async def from_kernel(self) -> None:
        deadline_s = float(self.cfg.get("reconnect_seconds", 60))
        while True:
            assert self.ws is not None
            async for raw in self.ws:
                if raw.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    try:
                        await self.to_clients(raw.data)
                    except (WireError, ValueError) as exc:
                        log(f"dropping a message from the service: {exc}")
            code = self.ws.close_code
            self.connected.clear()
            if self.deleting:
                return  # shutdown() ends the bridge once the DELETE is answered
            if code in FATAL_CLOSE_CODES:
                log(f"{FATAL_CLOSE_CODES[code]}; the kernel is gone")
                self.stop(1)
                return
            log(f"the WebSocket closed (code {code}); reconnecting for up to {deadline_s:g}s")
            if not await self.reconnect(deadline_s):
                self.stop(1)
                return

    async def reconnect(self, budget: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + budget, 0.5
        while loop.time() < deadline:
            try:
                await self.connect()
                log("reconnected")
                return True
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status in (401, 403, 404):
                    log(f"the service refused the WebSocket ({exc.status}); the kernel is gone")
                    return False
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                log(f"reconnect failed: {exc}")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)
        log(f"could not reconnect within {budget:g}s; the kernel is gone")
        return False

    async def to_clients(self, data: str | bytes) -> None:
        if isinstance(data, bytes):
            channel, parts = unpack_v1(data)
        else:  # the service fell back to the legacy framing
            channel, msg = from_text(data)
            parts = [json.dumps(msg[k]).encode() for k in ("header", "parent_header", "metadata", "content")]
        if len(parts) < 4:
            raise WireError(f"a {channel} message with {len(parts)} parts")
        signed = [DELIM, self.session.sign(parts[:4]), *parts]
        header, parent = json.loads(parts[0]), json.loads(parts[1])
        parent_id = str(parent.get("msg_id")) if isinstance(parent, dict) else ""
        if channel == "iopub":
            await self.socks["iopub"].send_multipart(signed)
            state = _status(header, parts[3])
            if state == "idle":
                await self.idle_sent(parent_id)
            elif state == "restarting":
                self.kernel_replaced()
            return
        idents = self.routes.get(parent_id)
        if idents is None or channel not in self.socks:
            return  # a reply to another client of the same kernel
        msg_type = header.get("msg_type", "") if isinstance(header, dict) else ""
        if channel in ("shell", "control") and str(msg_type).endswith("_reply"):
            self.routes.pop(parent_id, None)
        if channel == "shell" and parent_id not in self.idle:
            loop = asyncio.get_running_loop()
            self.held[parent_id] = (loop.time() + REPLY_HOLD_S, [*idents, *signed])
            return
        await self.socks[channel].send_multipart([*idents, *signed])

    def kernel_replaced(self) -> None:
        """The service says the kernel behind this bridge is gone: it died (the VM's agent starts
        a fresh one) or another client restarted it. The replies in flight and the kernel's
        state are lost, so the bridge ends, as a local kernel process ends when it dies: the
        manager sees a dead kernel (nbclient raises DeadKernelError instead of waiting for a
        reply that never comes) and a restarter restarts it through the provisioner. A restart
        the manager asks for never gets here: its bridge ends at the shutdown_request."""
        log("the kernel died or was restarted by another client; this kernel is gone")
        self.stop(1)

    async def idle_sent(self, parent_id: str) -> None:
        """The idle of ``parent_id`` is out: its held reply follows; else it goes out unheld."""
        held = self.held.pop(parent_id, None)
        if held is not None:
            await self.socks["shell"].send_multipart(held[1])
            return
        self.idle[parent_id] = None
        while len(self.idle) > IDLE_KEPT:
            self.idle.popitem(last=False)

    async def release_held(self) -> None:
        """A reply whose idle never comes (a kernel that died between them) goes out anyway."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(0.25)
            now = loop.time()
            for parent_id in [p for p, (due, _) in self.held.items() if due <= now]:
                await self.socks["shell"].send_multipart(self.held.pop(parent_id)[1])


def _status(header: Any, content: bytes) -> str | None:
    """The execution state a ``status`` message announces; None for any other message."""
    if not isinstance(header, dict) or header.get("msg_type") != "status":
        return None
    state = json.loads(content)
    value = state.get("execution_state") if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


async def main() -> int:
    cfg = json.loads(sys.stdin.read())
    bridge = Bridge(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, bridge.stop, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts go to the kernel over HTTP
    try:
        bridge.bind()
        await bridge.connect()
        if cfg.get("setup"):
            await bridge.run_setup(str(cfg["setup"]), float(cfg.get("setup_timeout") or 120))
    except (TimeoutError, aiohttp.ClientError, OSError, zmq.ZMQError, RuntimeError, WireError) as exc:
        if isinstance(exc, aiohttp.WSServerHandshakeError):
            answer({"error": f"the service refused the kernel's WebSocket: HTTP {exc.status} {exc.message}"})
        else:
            answer({"error": f"{type(exc).__name__}: {exc}"})
        if bridge.http is not None:
            await bridge.http.close()
        bridge.ctx.destroy(linger=0)
        return 1
    answer({"ports": bridge.ports})
    return await bridge.run()


def answer(obj: dict[str, Any]) -> None:
    """The one line on stdout; then stdout points at /dev/null, so nothing can block on it."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
