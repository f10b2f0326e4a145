"""The host side of one agent's network tunnels (docs/network.md).

In modes ``allowlist`` and ``outbound`` the guest's agent runs an HTTP proxy and asks the host,
over the channel, to open each connection (``net`` frames, ``protocol.NetFrame``). ``Tunnels``
checks each against the sandbox's ``Policy``, connects with a deadline and pumps bytes both
ways with per-tunnel windows (``data`` / ``ack``): neither side sends more than ``NET_WINDOW``
unacknowledged bytes of a tunnel, so a slow reader on either end never grows host memory.

The guest is hostile: a frame never costs the host more than a bounded amount of work. Only an
accepted ``open`` (at most ``MAX_TUNNELS`` at once) starts a task; refusals and the ``close``
answers to frames of unknown tunnels go through one bounded outbox with one sender task, and
what does not fit is dropped. Frames a well-behaved agent sends only in races (for a tunnel
that just ended) or never (any tunnel frame in mode ``none``) are counted in a bucket
(``STRAY_RATE``, ``STRAY_BURST``): a guest that overdraws it is cut off, and its VM destroyed.
Refusals are logged at most ``LOG_RATE`` a second per sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from ...channel import AgentClient, ChannelError, ChannelListener, ProtocolViolation
from ...channel.protocol import NET_CHUNK, Frame, NetFrame, NetRefusal
from ...ratelimit import TokenBucket
from ...tasks import TaskSet
from .policy import CONNECT_TIMEOUT, IPAddress, Policy, Refused
from .pump import SEND_TIMEOUT, Pumps, Tunnel

log = structlog.get_logger("kernelhost.network")

MAX_TUNNELS = 32  # connections open at once per sandbox
OUTBOX = 256  # control frames (refusals, close answers) waiting to be sent
RECENTLY_ENDED = 1024  # tunnel ids whose close answer was already sent
STRAY_RATE, STRAY_BURST = 20.0, 512.0  # frames for no tunnel: per second, and at once
LOG_RATE, LOG_BURST = 1.0, 20.0  # refusals logged per second, and at once
LOOKUPS = 2  # name lookups one sandbox may have running in the resolver's threads


#: ``count(result)`` with "opened" or "refused": connections, for the service's metrics
Count = Callable[[str], None]


class Tunnels(Pumps, ChannelListener):
    """The tunnels of one agent's channel; ``close()`` ends every one of them."""

    def __init__(
        self, policy: Policy, agent: AgentClient, sandbox_id: str, count: Count | None = None
    ) -> None:
        self.policy = policy
        self.agent = agent
        self.log = log.bind(sandbox_id=sandbox_id, network=policy.mode)
        self.tunnels: dict[int, Tunnel] = {}
        self.tasks = TaskSet(f"tunnels:{sandbox_id}")
        self.closed = False
        self._count = count or (lambda result: None)
        self._outbox: deque[dict[str, Any]] = deque()
        self._outbox_ready = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._ended: OrderedDict[int, None] = OrderedDict()
        self._strays = TokenBucket(STRAY_RATE, STRAY_BURST)
        self._logs = TokenBucket(LOG_RATE, LOG_BURST)
        self.refused = 0
        self._lookups = asyncio.Semaphore(LOOKUPS)  # name lookups of this sandbox at once

    # -- frames from the guest (on the channel's reader: never blocks) ----------------------------

    def on_net(self, frame: dict[str, Any]) -> None:
        kind, tunnel_id = frame.get("t"), frame.get("tunnel")
        if self.closed or (isinstance(tunnel_id, int) and tunnel_id < 0):
            return  # below 0: the host's own connections into the guest (``ingress.py``)
        if (
            self.policy.mode == "none"
            or not isinstance(tunnel_id, int)
            or isinstance(tunnel_id, bool)
            or not 0 < tunnel_id < 1 << 62
        ):
            self._stray("tunnel frames it has no business sending")
            return
        tun = self.tunnels.get(tunnel_id)
        if kind == NetFrame.OPEN:
            if tun is None:
                self._open(tunnel_id, frame.get("host"), frame.get("port"))
            else:
                self._stray("opens for tunnels already open")
        elif tun is None:
            self._stray("frames for tunnels that do not exist")
            if kind != NetFrame.CLOSE:  # a tunnel of an earlier host, or one we ended
                self._answer_unknown(tunnel_id)
        elif not self._take(tun, kind, frame):
            self.log.warning("network.flow_control_broken", tunnel=tunnel_id)

    def on_close(self, reason: str, violation: bool) -> None:
        self.close()

    def _stray(self, what: str) -> None:
        """Count a frame no well-behaved agent sends this often; cut the guest off past it."""
        if not self._strays.take():
            raise ProtocolViolation(f"the guest floods its channel with {what}")

    def _log_refusal(self, host: str, port: int, reason: str) -> None:
        self.refused += 1
        self._count("refused")
        if self._logs.take():
            self.log.warning(
                "network.refused", host=host[:100], port=port, reason=reason[:300], refused=self.refused
            )

    def _open(self, tunnel_id: int, host: Any, port: Any) -> None:
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
            self._refuse(tunnel_id, NetRefusal.INVALID, "kernelhost: open needs a host and a port")
            return
        if len(self.tunnels) >= MAX_TUNNELS:
            self._log_refusal(host, port, "too many connections")
            self._refuse(
                tunnel_id,
                NetRefusal.BUSY,
                f"kernelhost: this sandbox already has {MAX_TUNNELS} connections open",
            )
            return
        tun = Tunnel(tunnel_id)
        tun.room.set()
        self.tunnels[tunnel_id] = tun
        tun.task = self.tasks.spawn(self._run(tun, host[:300], port), name=f"tunnel:{tunnel_id}")

    def _refuse(self, tunnel_id: int, reason: NetRefusal, error: str) -> None:
        self._post(
            {
                "op": Frame.NET.value,
                "t": NetFrame.OPENED.value,
                "tunnel": tunnel_id,
                "ok": False,
                "reason": reason.value,
                "error": error,
            }
        )

    def _answer_unknown(self, tunnel_id: int) -> None:
        if tunnel_id in self._ended:
            return
        self._ended[tunnel_id] = None
        while len(self._ended) > RECENTLY_ENDED:
            self._ended.popitem(last=False)
        self._post({"op": Frame.NET.value, "t": NetFrame.CLOSE.value, "tunnel": tunnel_id})

    def _post(self, frame: dict[str, Any]) -> None:
        """Queue a control frame for the one sender task; dropped when the outbox is full."""
        if self.closed or len(self._outbox) >= OUTBOX:
            return
        self._outbox.append(frame)
        self._outbox_ready.set()
        if self._sender is None or self._sender.done():
            self._sender = self.tasks.spawn(self._send_outbox(), name="tunnels-outbox")

    async def _send_outbox(self) -> None:
        with contextlib.suppress(ChannelError):
            while self._outbox:
                await self.agent.send_net(self._outbox.popleft(), timeout=SEND_TIMEOUT)

    def close(self) -> None:
        """End every tunnel (the sandbox closes, hibernates, forks away or changes VM)."""
        self.closed = True
        self._outbox.clear()
        self.tasks.cancel()
        self.tunnels.clear()

    async def aclose(self) -> None:
        self.close()
        await self.tasks.close(timeout=5.0)

    # -- one tunnel --------------------------------------------------------------------------------

    async def _run(self, tun: Tunnel, host: str, port: int) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            try:
                reader, writer = await self._connect(host, port)
            except Refused as exc:
                self._log_refusal(host, port, str(exc))
                await self._send(NetFrame.OPENED, tun.id, ok=False, reason=exc.reason.value, error=str(exc))
                return
            self._count("opened")
            await self._send(NetFrame.OPENED, tun.id, ok=True)
            await self._pump(tun, reader, writer)
        except ChannelError:
            pass  # the channel closed or the guest stopped reading: the tunnel ends
        finally:
            self.tunnels.pop(tun.id, None)
            if writer is not None:
                writer.close()
            if not tun.guest_closed and not self.closed and self.agent.connected:
                self._answer_unknown(tun.id)  # tell the guest the tunnel is over (once)

    async def _connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        local = self.policy.local_endpoint(host, port)
        if local is not None:
            return await _open_local(local)
        async with self._lookups:
            addrs = await self.policy.resolve(host, port)
        return await _open_tcp(host, addrs, port)


async def _open_local(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            return await asyncio.open_unix_connection(str(path), limit=NET_CHUNK)
    except (OSError, TimeoutError) as exc:
        raise Refused(
            f"kernelhost: the host's package index is not available: {exc or 'timed out'}",
            NetRefusal.UNREACHABLE,
        ) from None


async def _open_tcp(
    host: str, addrs: list[IPAddress], port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    errors = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_TIMEOUT
    for addr in addrs:
        left = deadline - loop.time()
        if left <= 0:
            break
        try:
            async with asyncio.timeout(left):
                return await asyncio.open_connection(str(addr), port, limit=NET_CHUNK)
        except (OSError, TimeoutError) as exc:
            errors.append(f"{addr}: {exc or 'timed out'}")
    raise Refused(
        f"kernelhost: cannot connect to {host}:{port}: {'; '.join(errors)[:200] or 'timed out'}",
        NetRefusal.UNREACHABLE,
    )
