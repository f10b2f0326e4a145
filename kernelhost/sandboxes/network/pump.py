"""Bytes both ways through one tunnel of an agent's channel, within its windows: what the
guest's connections out (``tunnels.py``) and the host's connections in (``ingress.py``) share.
Neither side sends more than ``NET_WINDOW`` unacknowledged bytes of a tunnel (``data`` /
``ack``), so a slow reader on either end never grows host memory."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from ...channel import AgentClient, ChannelError
from ...channel.protocol import NET_CHUNK, NET_WINDOW, Frame, NetFrame

SEND_TIMEOUT = 30.0  # seconds one frame to the guest may take before its tunnel ends


@dataclass(eq=False)
class Tunnel:
    id: int
    credit: int = NET_WINDOW  # bytes we may still send to the guest
    room: asyncio.Event = field(default_factory=asyncio.Event)
    inbox: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    inbox_bytes: int = 0  # bytes from the guest not yet written out (at most NET_WINDOW)
    task: asyncio.Task[None] | None = None
    guest_closed: bool = False


class Pumps:
    """The pumping half of a channel's tunnels; ``agent`` is the channel."""

    agent: AgentClient

    def _take(self, tun: Tunnel, kind: Any, frame: dict[str, Any]) -> bool:
        """A guest's data, ack or close frame for an open tunnel (on the channel's reader: never
        blocks). False when its data breaks flow control: the tunnel is ended."""
        if kind == NetFrame.DATA:
            data = frame.get("data")
            if not isinstance(data, bytes) or tun.inbox_bytes + len(data) > NET_WINDOW:
                if tun.task is not None:
                    tun.task.cancel()
                return False
            tun.inbox_bytes += len(data)
            tun.inbox.put_nowait(data)
        elif kind == NetFrame.ACK:
            n = frame.get("n")
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                tun.credit = min(NET_WINDOW, tun.credit + n)
                tun.room.set()
        elif kind == NetFrame.CLOSE:
            tun.guest_closed = True
            tun.inbox.put_nowait(None)
        return True

    async def _send(self, kind: NetFrame, tunnel_id: int, **fields: Any) -> None:
        await self.agent.send_net(
            {"op": Frame.NET.value, "t": kind.value, "tunnel": tunnel_id, **fields}, timeout=SEND_TIMEOUT
        )

    async def _pump(self, tun: Tunnel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up = asyncio.ensure_future(self._to_remote(tun, writer))
        down = asyncio.ensure_future(self._from_remote(tun, reader))
        try:
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
            for task in (up, down):
                with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError, ChannelError):
                    await task

    async def _to_remote(self, tun: Tunnel, writer: asyncio.StreamWriter) -> None:
        while True:
            data = await tun.inbox.get()
            if data is None:
                return
            writer.write(data)
            await writer.drain()
            tun.inbox_bytes -= len(data)
            await self._send(NetFrame.ACK, tun.id, n=len(data))

    async def _from_remote(self, tun: Tunnel, reader: asyncio.StreamReader) -> None:
        while True:
            data = await reader.read(await self._credit(tun))
            if not data:
                return
            await self._send_data(tun, data)

    async def _credit(self, tun: Tunnel) -> int:
        """Wait until the guest has room for more of this tunnel; how much (at most NET_CHUNK)."""
        while tun.credit <= 0:
            tun.room.clear()
            await tun.room.wait()
        return min(NET_CHUNK, tun.credit)

    async def _send_data(self, tun: Tunnel, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = await self._credit(tun)
            piece, view = bytes(view[:n]), view[n:]
            tun.credit -= len(piece)
            await self._send(NetFrame.DATA, tun.id, data=piece)
