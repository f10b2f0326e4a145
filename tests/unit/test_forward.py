"""The cluster's WebSocket bridge (kernelhost/api/cluster/forward.py) on a real pair of aiohttp apps: a
"peer" that records what reaches it, and a "node" whose route forwards to it, as a node
forwards a Kernel Gateway WebSocket of a sandbox on another node (issue 35, finding 13: the
bridge took messages of any size, both ways, and buffered each whole)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kernelhost.api.cluster.forward import forward, new_session
from kernelhost.api.state import SETTINGS

from .offline import offline_settings, serving

pytestmark = pytest.mark.unit

CODE_BYTES = 4096  # max_code_bytes: a client's message may be 4096 + 1 MiB
FRAME_BYTES = 256 * 1024  # max_frame_bytes: a peer's message may be 512 KiB


@dataclass
class Peer:
    """The node that holds the sandbox: records each message, and answers ``big N`` with N bytes."""

    app: web.Application = field(default_factory=web.Application)
    url: str = ""
    got: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.app.router.add_get("/ws", self.ws)

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            self.got.append(len(msg.data))
            if msg.data.startswith("big "):
                await ws.send_str("y" * int(msg.data[4:]))
            else:
                await ws.send_str(f"echo {len(msg.data)}")
        return ws


@dataclass
class Node:
    """The node the client called: forwards ``/ws`` to the peer through the bridge."""

    peer: Peer
    app: web.Application = field(default_factory=web.Application)
    url: str = ""

    async def ws(self, request: web.Request) -> web.StreamResponse:
        async with new_session() as session:
            return await forward(session, request, self.peer.url, lambda binding: {})


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    peer = Peer()
    node = Node(peer)
    node.app[SETTINGS] = offline_settings(
        tmp_path, max_code_bytes=CODE_BYTES, max_frame_bytes=FRAME_BYTES, max_result_bytes=FRAME_BYTES
    )
    node.app.router.add_get("/ws", node.ws)
    async with serving(peer), serving(node):
        yield node


async def test_the_bridge_refuses_a_client_message_over_max_ws_message_bytes(node: Node) -> None:
    limit = node.app[SETTINGS].max_ws_message_bytes
    assert limit == CODE_BYTES + 1024 * 1024
    async with aiohttp.ClientSession() as http, http.ws_connect(node.url + "/ws", max_msg_size=0) as ws:
        await ws.send_str("x" * 1000)
        assert (await ws.receive(timeout=10)).data == "echo 1000"  # under the cap: through
        await ws.send_str("x" * (limit + 1))
        msg = await ws.receive(timeout=10)
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
        assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG, ws.close_code
    assert node.peer.got == [1000]  # the big one never reached the peer


async def test_the_bridge_refuses_a_peer_message_over_max_ws_relay_bytes(node: Node) -> None:
    limit = node.app[SETTINGS].max_ws_relay_bytes
    assert limit == 2 * FRAME_BYTES
    async with aiohttp.ClientSession() as http, http.ws_connect(node.url + "/ws", max_msg_size=0) as ws:
        await ws.send_str(f"big {limit - 1024}")
        assert len((await ws.receive(timeout=10)).data) == limit - 1024  # under the cap: through
        await ws.send_str(f"big {limit + 1}")
        msg = await ws.receive(timeout=10)  # the bridge closes instead of passing it on
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING), (
            msg.type,
            msg.data if isinstance(msg.data, int) else len(msg.data or ""),
        )
        assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG, ws.close_code
