"""The host's connections to ports in a guest (docs/ports.md): a server the tenant started in the
sandbox (a web app, a dev server, a Jupyter server) reached from outside without the guest
having any network interface.

``Ingress.connect(port)`` sends ``connect`` {port} with a tunnel id of the host's (below 0); the
guest's agent connects to 127.0.0.1:port and answers ``opened`` {ok, error}. The caller gets one
end of a local socket pair; the other end is pumped through the tunnel within its windows
(``pump.py``), as the guest's own connections out are. What the caller speaks over it (HTTP,
WebSocket) is the API layer's business: this side carries bytes.

The guest is hostile: frames for a host tunnel that does not exist are counted in a bucket and
a guest that overdraws it is cut off, as in ``tunnels.py``; at most ``MAX_INGRESS`` are open at
once per sandbox, and each open waits at most ``CONNECT_TIMEOUT`` for the guest's answer.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import Any

from ...channel import AgentClient, ChannelError, ChannelListener, NotSupportedByAgent, ProtocolViolation
from ...channel.protocol import NET_CHUNK, Capability, NetFrame
from ...ratelimit import TokenBucket
from ...tasks import TaskSet
from .pump import Pumps, Tunnel

MAX_INGRESS = 64  # the host's connections open at once to one sandbox's ports
CONNECT_TIMEOUT = 30.0  # seconds the guest has to answer a connect
STRAY_RATE, STRAY_BURST = 20.0, 512.0  # frames for no host tunnel: per second, and at once


class PortClosed(Exception):
    """Nothing in the sandbox accepts connections on the port (the guest's reason)."""


class Ingress(Pumps, ChannelListener):
    """The host's tunnels into one agent's guest; ``close()`` ends every one of them."""

    def __init__(self, agent: AgentClient, sandbox_id: str) -> None:
        self.agent = agent
        self.tunnels: dict[int, Tunnel] = {}
        self.opening: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.tasks = TaskSet(f"ingress:{sandbox_id}")
        self.closed = False
        self._ids = itertools.count(-1, -1)
        self._strays = TokenBucket(STRAY_RATE, STRAY_BURST)

    async def connect(self, port: int) -> socket.socket:
        """A local socket connected, through the channel, to 127.0.0.1:``port`` in the guest.
        Raises ``PortClosed`` (the guest's reason), ``NotSupportedByAgent`` (an image without
        ingress), ``ChannelError`` or ``TimeoutError``."""
        if not self.agent.supports(Capability.INGRESS):
            raise NotSupportedByAgent("net connect", Capability.INGRESS.value)
        if self.closed:
            raise ChannelError("the sandbox's channel closed")
        if len(self.tunnels) + len(self.opening) >= MAX_INGRESS:
            raise PortClosed(f"this sandbox already has {MAX_INGRESS} connections to its ports open")
        tid = next(self._ids)
        answer = self.opening[tid] = asyncio.get_running_loop().create_future()
        try:
            await self._send(NetFrame.CONNECT, tid, port=port)
            async with asyncio.timeout(CONNECT_TIMEOUT):
                reply = await answer
        finally:
            self.opening.pop(tid, None)
        if not reply.get("ok"):
            raise PortClosed(str(reply.get("error") or f"port {port} refused the connection")[:300])
        ours, theirs = socket.socketpair()
        tun = Tunnel(tid)
        tun.room.set()
        self.tunnels[tid] = tun
        tun.task = self.tasks.spawn(self._run(tun, theirs), name=f"ingress:{tid}")
        return ours

    async def _run(self, tun: Tunnel, sock: socket.socket) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(sock=sock, limit=NET_CHUNK)
            await self._pump(tun, reader, writer)
        except (ChannelError, OSError):
            pass  # the channel closed, the guest stopped reading, or the caller went away
        finally:
            self.tunnels.pop(tun.id, None)
            if writer is not None:
                writer.close()
            else:
                sock.close()
            if not tun.guest_closed and not self.closed and self.agent.connected:
                try:
                    await self._send(NetFrame.CLOSE, tun.id)
                except ChannelError:
                    pass

    # -- frames from the guest (on the channel's reader: never blocks) ----------------------------

    def on_net(self, frame: dict[str, Any]) -> None:
        tid = frame.get("tunnel")
        if self.closed or not isinstance(tid, int) or isinstance(tid, bool) or tid >= 0:
            return  # the guest's own tunnels (``tunnels.py``)
        kind = frame.get("t")
        answer = self.opening.get(tid)
        if answer is not None and kind in (NetFrame.OPENED, NetFrame.CLOSE):
            if not answer.done():
                answer.set_result(frame if kind == NetFrame.OPENED else {"ok": False, "error": "closed"})
            return
        tun = self.tunnels.get(tid)
        if tun is None:
            if not self._strays.take():
                raise ProtocolViolation("the guest floods its channel with frames for host tunnels")
            return
        self._take(tun, kind, frame)  # broken flow control ends the tunnel

    def on_close(self, reason: str, violation: bool) -> None:
        self.close()

    def close(self) -> None:
        """End every connection (the channel closed, or another agent took over)."""
        self.closed = True
        for answer in self.opening.values():
            if not answer.done():
                answer.set_exception(ChannelError("the sandbox's channel closed"))
        self.opening.clear()
        self.tasks.cancel()
        self.tunnels.clear()
