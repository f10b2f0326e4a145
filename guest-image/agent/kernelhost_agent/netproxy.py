"""The in-guest HTTP proxy on 127.0.0.1, whose connections the host opens through the channel.

Clients in the guest (pip, requests, curl) reach it through the proxy variables and pip.conf of
the network mode (``network.py``). It takes CONNECT (https) and absolute ``http://`` requests and
turns each into a tunnel: frames ``{"op": "net", "t": ..., "tunnel": N}`` with guest -> host
"open" {host, port}, host -> guest "opened" {ok, reason, error}; both ways "data" {data}, "ack"
{n} (bytes written out: each side sends at most NET_WINDOW unacknowledged bytes per tunnel) and
"close". Tunnel ids are the guest's. The host decides what may be reached; this side only
carries bytes.

The host opens connections the other way too (``Capability.INGRESS``): "connect" {port} with a
tunnel id below 0 connects to 127.0.0.1:port (a server the tenant started in the guest), answered
"opened" {ok, error}; then the same "data", "ack" and "close".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from .shared import protocol

__all__ = ["NetProxy"]

Send = Callable[[dict[str, Any]], bool]
HEAD_MAX = 16 * 1024  # a request line and headers larger than this are not a proxy request
HEAD_TIMEOUT = 60.0
OPEN_TIMEOUT = 45.0  # the host resolves and connects meanwhile
_HOP_HEADERS = (b"proxy-connection:", b"connection:", b"keep-alive:", b"proxy-authorization:")
#: the HTTP status this proxy answers with for each reason the host gives for a refusal
REFUSAL_STATUS = {
    protocol.NetRefusal.POLICY: 403,
    protocol.NetRefusal.INVALID: 400,
    protocol.NetRefusal.UNREACHABLE: 502,
    protocol.NetRefusal.BUSY: 503,
}


class _Refused(Exception):
    """An answer of the proxy itself; the reason is the status line's phrase (what pip shows)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Tunnel:
    """One proxied connection: its host-side state and flow control."""

    def __init__(self, tunnel_id: int, writer: asyncio.StreamWriter) -> None:
        self.id = tunnel_id
        self.opened: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.credit = protocol.NET_WINDOW  # bytes we may still send before the host acknowledges
        self.room = asyncio.Event()
        self.room.set()
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.writer = writer

    def refuse(self, error: str) -> None:
        """End the tunnel from our side (the host is gone or closed it)."""
        self.inbox.put_nowait(None)
        if not self.opened.done():
            self.opened.set_result(
                {"ok": False, "reason": protocol.NetRefusal.UNREACHABLE.value, "error": error}
            )


class NetProxy:
    """The proxy on 127.0.0.1:``port``: CONNECT (https) and absolute http:// requests."""

    def __init__(self, send: Send, port: int = protocol.PROXY_PORT) -> None:
        self._send = send
        self.port = port
        self.server: asyncio.AbstractServer | None = None
        self.tunnels: dict[int, _Tunnel] = {}
        self._ids = itertools.count(1)
        self._clients: set[asyncio.Task[Any]] = set()  # connections being served

    def frame_handlers(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """The frame kinds this area takes from the host."""
        return {protocol.Frame.NET: self.on_frame}

    @property
    def capability(self) -> protocol.Capability:
        return protocol.Capability.INGRESS

    def ops(self) -> Mapping[str, Any]:
        return {}  # its frames are "net" frames (``frame_handlers``), not requests

    async def listen(self) -> None:
        """Listen on 127.0.0.1:``port`` (again), if not already."""
        if self.server is None:
            self.server = await asyncio.start_server(
                self._serve_client, "127.0.0.1", self.port, limit=HEAD_MAX, reuse_address=True
            )

    async def stop(self) -> None:
        """Stop listening; tunnels already open carry on until they close."""
        if self.server is not None:
            self.server.close()
            self.server = None

    async def close(self) -> None:
        """Stop listening and end every connection (the agent is stopping)."""
        await self.stop()
        self.reset()
        clients = list(self._clients)
        for task in clients:
            task.cancel()
        if clients:
            await asyncio.wait(clients, timeout=2.0)

    def reset(self) -> None:
        """Drop every tunnel (a new host knows none of them)."""
        for tun in list(self.tunnels.values()):
            waiting = not tun.opened.done()
            tun.refuse("the host reconnected; retry")
            if not waiting:  # one still waiting for "opened" is answered 502 by its own task
                tun.writer.close()
        self.tunnels.clear()

    def _net(self, kind: str, tunnel_id: int, **fields: Any) -> None:
        self._send({"op": protocol.Frame.NET, "t": kind, "tunnel": tunnel_id, **fields})

    def on_frame(self, frame: dict[str, Any]) -> None:
        """A net frame from the host; one for a tunnel we do not know is answered close."""
        kind, tunnel_id = frame.get("t"), frame.get("tunnel")
        tun = self.tunnels.get(tunnel_id) if isinstance(tunnel_id, int) else None
        if tun is None:
            if kind == protocol.NetFrame.CONNECT and isinstance(tunnel_id, int) and tunnel_id < 0:
                self._spawn(self._serve_inbound(tunnel_id, frame.get("port")))
            elif kind != protocol.NetFrame.CLOSE and isinstance(tunnel_id, int):
                self._net(protocol.NetFrame.CLOSE, tunnel_id)
            return
        if kind == protocol.NetFrame.OPENED:
            if not tun.opened.done():
                tun.opened.set_result(frame)
        elif kind == protocol.NetFrame.DATA and isinstance(frame.get("data"), bytes):
            tun.inbox.put_nowait(frame["data"])
        elif kind == protocol.NetFrame.ACK and _positive_int(frame.get("n")):
            tun.credit = min(protocol.NET_WINDOW, tun.credit + frame["n"])
            tun.room.set()
        elif kind == protocol.NetFrame.CLOSE:
            tun.refuse("closed by the host")

    # -- one client connection ---------------------------------------------------------------

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection: parse its request, open a tunnel, pump bytes."""
        task = asyncio.current_task()
        if task is not None:
            self._clients.add(task)
        tun: _Tunnel | None = None
        try:
            try:
                async with asyncio.timeout(HEAD_TIMEOUT):
                    head = await reader.readuntil(b"\r\n\r\n")
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            host, port, first = _parse_head(head)
            tun = _Tunnel(next(self._ids), writer)
            self.tunnels[tun.id] = tun
            await self._open(tun, host, port, first)
            await self._pump(tun, reader, writer)
        except _Refused as refused:
            await _respond(writer, refused.status, refused.reason)
        except (ConnectionError, OSError):
            pass
        finally:
            if tun is not None and self.tunnels.pop(tun.id, None) is not None:
                self._net(protocol.NetFrame.CLOSE, tun.id)
            writer.close()
            if task is not None:
                self._clients.discard(task)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._clients.add(task)
        task.add_done_callback(self._clients.discard)

    async def _serve_inbound(self, tunnel_id: int, port: Any) -> None:
        """A connection of the host's to 127.0.0.1:``port``: connect, answer, pump bytes."""
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            self._net(protocol.NetFrame.OPENED, tunnel_id, ok=False, error=f"no such port: {port!r:.20}")
            return
        try:
            reader, writer = await _open_local_port(port)
        except (OSError, TimeoutError) as exc:
            error = f"nothing in the sandbox accepts connections on port {port}: {exc or 'timed out'}"
            self._net(protocol.NetFrame.OPENED, tunnel_id, ok=False, error=error[:300])
            return
        tun = _Tunnel(tunnel_id, writer)
        tun.opened.set_result({"ok": True})
        self.tunnels[tunnel_id] = tun
        try:
            self._net(protocol.NetFrame.OPENED, tunnel_id, ok=True)
            await self._pump(tun, reader, writer)
        except (ConnectionError, OSError):
            pass
        finally:
            if self.tunnels.pop(tunnel_id, None) is not None:
                self._net(protocol.NetFrame.CLOSE, tunnel_id)
            writer.close()

    async def _open(self, tun: _Tunnel, host: str, port: int, first: bytes) -> None:
        """Ask the host to connect; then send the request head, or answer CONNECT's 200."""
        self._net(protocol.NetFrame.OPEN, tun.id, host=host, port=port)
        try:
            async with asyncio.timeout(OPEN_TIMEOUT):
                reply = await asyncio.shield(tun.opened)
        except TimeoutError:
            raise _Refused(504, "kernelhost proxy: the host did not answer") from None
        if not reply.get("ok"):
            reason = reply.get("reason")
            status = REFUSAL_STATUS[protocol.NetRefusal(reason)] if reason in REFUSAL_STATUS else 403
            raise _Refused(status, str(reply.get("error") or "refused"))
        if first:
            tun.credit -= len(first)
            self._net(protocol.NetFrame.DATA, tun.id, data=first)
        else:
            tun.writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

    async def _pump(self, tun: _Tunnel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Bytes both ways until either side ends: up within the window, down with acks."""

        async def up() -> None:
            while True:
                while tun.credit <= 0:
                    tun.room.clear()
                    await tun.room.wait()
                data = await reader.read(min(protocol.NET_CHUNK, tun.credit))
                if not data:
                    return
                tun.credit -= len(data)
                self._net(protocol.NetFrame.DATA, tun.id, data=data)

        async def down() -> None:
            while True:
                data = await tun.inbox.get()
                if data is None:
                    return
                writer.write(data)
                await writer.drain()
                self._net(protocol.NetFrame.ACK, tun.id, n=len(data))

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _open_local_port(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a server on ``port`` of the loopback: IPv4, else IPv6 (a server that
    listens on "localhost" may have taken ::1 only)."""
    try:
        async with asyncio.timeout(OPEN_TIMEOUT):
            return await asyncio.open_connection("127.0.0.1", port, limit=protocol.NET_CHUNK)
    except ConnectionRefusedError:
        async with asyncio.timeout(OPEN_TIMEOUT):
            return await asyncio.open_connection("::1", port, limit=protocol.NET_CHUNK)


def _parse_head(head: bytes) -> tuple[str, int, bytes]:
    """(host, port, the request head to send on) of a proxy request; CONNECT sends none."""
    line, _, rest = head[:-4].partition(b"\r\n")
    words = line.decode("latin-1").split()
    if len(words) != 3:
        raise _Refused(400, "kernelhost proxy: malformed request line")
    method, target, version = words
    first = b""
    if method.upper() == "CONNECT":
        host, _, port_text = target.rpartition(":")
        host = host.strip("[]")
    else:
        url = urllib.parse.urlsplit(target)
        if url.scheme.lower() != "http" or not url.hostname:
            raise _Refused(400, "kernelhost proxy: send CONNECT host:port or an absolute http:// URL")
        try:
            port_text = str(url.port or 80)
        except ValueError:  # a port that is no number or out of range
            port_text = ""
        host = url.hostname
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        headers = [h for h in rest.split(b"\r\n") if h and not h.lower().startswith(_HOP_HEADERS)]
        request_line = f"{method} {path} {version}".encode("latin-1")
        first = b"\r\n".join([request_line, *headers, b"Connection: close", b"", b""])
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _Refused(400, f"kernelhost proxy: bad target {target[:100]}")
    return host, int(port_text), first


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


async def _respond(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    """An error answer of the proxy; the reason is the status line's phrase (what pip shows)."""
    phrase = "".join(c if 32 <= ord(c) < 127 else " " for c in reason)[:300]
    body = (phrase + "\n").encode()
    writer.write(
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(ConnectionError, OSError):
        await writer.drain()
