"""The provisioner's bridge without a service: what its local clients receive, and in what order,
for messages the kernel's WebSocket delivers (``Bridge.to_clients``)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kernelhost.jupyter import bridge as bridge_mod
from kernelhost.jupyter.bridge import Bridge
from kernelhost.jupyter.wire import pack_v1

pytestmark = pytest.mark.unit


def _frame(channel: str, msg_type: str, parent: str, **content: Any) -> bytes:
    header = {"msg_id": f"{msg_type}-{parent}", "msg_type": msg_type, "session": "k", "version": "5.3"}
    parts = [header, {"msg_id": parent}, {}, content]
    return pack_v1(channel, [json.dumps(p).encode() for p in parts])


class Client:
    """A local client: a DEALER on shell, a SUB on iopub; every message it gets, in order."""

    def __init__(self, ctx: zmq.asyncio.Context, ports: dict[str, int]) -> None:
        self.shell = ctx.socket(zmq.DEALER)
        self.shell.setsockopt(zmq.IDENTITY, b"client")
        self.shell.connect(f"tcp://127.0.0.1:{ports['shell_port']}")
        self.iopub = ctx.socket(zmq.SUB)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(f"tcp://127.0.0.1:{ports['iopub_port']}")

    async def received(self, seconds: float) -> list[str]:
        """The msg_types that arrived within ``seconds``, in arrival order."""
        got: list[str] = []
        poller = zmq.asyncio.Poller()
        poller.register(self.shell, zmq.POLLIN)
        poller.register(self.iopub, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while (left := end - loop.time()) > 0:
            for sock, _ in await poller.poll(timeout=left * 1000):
                parts = await sock.recv_multipart()
                header = json.loads(parts[parts.index(bridge_mod.DELIM) + 2])
                got.append(header["msg_type"])
        return got


@pytest.fixture
async def wired() -> AsyncIterator[tuple[Bridge, Client]]:
    bridge = Bridge({"key": "secret", "ip": "127.0.0.1"})
    bridge.bind()
    ctx = zmq.asyncio.Context()
    client = Client(ctx, bridge.ports)
    await asyncio.sleep(0.3)  # the SUB's subscription reaches the XPUB
    bridge.routes["req"] = [b"client"]  # as from_clients records a request
    try:
        yield bridge, client
    finally:
        ctx.destroy(linger=0)
        bridge.ctx.destroy(linger=0)


async def test_a_reply_waits_for_its_requests_idle(wired: tuple[Bridge, Client]) -> None:
    bridge, client = wired
    await bridge.to_clients(_frame("iopub", "status", "req", execution_state="busy"))
    await bridge.to_clients(_frame("iopub", "stream", "req", name="stdout", text="hi"))
    await bridge.to_clients(_frame("shell", "execute_reply", "req", status="ok"))
    assert await client.received(0.5) == ["status", "stream"]  # the reply is held
    await bridge.to_clients(_frame("iopub", "status", "req", execution_state="idle"))
    assert sorted(await client.received(0.5)) == ["execute_reply", "status"]
    assert bridge.held == {}


async def test_a_reply_after_its_idle_is_not_held(wired: tuple[Bridge, Client]) -> None:
    bridge, client = wired
    await bridge.to_clients(_frame("iopub", "status", "req", execution_state="idle"))
    await bridge.to_clients(_frame("shell", "kernel_info_reply", "req", status="ok"))
    # both go out at once (the order between two sockets is the client's poller's)
    assert sorted(await client.received(0.5)) == ["kernel_info_reply", "status"]


async def test_a_reply_whose_idle_never_comes_goes_out_after_the_hold(
    wired: tuple[Bridge, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    bridge, client = wired
    monkeypatch.setattr(bridge_mod, "REPLY_HOLD_S", 0.5)
    releaser = asyncio.create_task(bridge.release_held())
    try:
        await bridge.to_clients(_frame("shell", "execute_reply", "req", status="ok"))
        assert await client.received(0.3) == []
        assert await client.received(1.0) == ["execute_reply"]
    finally:
        releaser.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releaser


async def test_a_kernel_restarted_under_the_bridge_ends_it_as_a_dead_kernel(
    wired: tuple[Bridge, Client],
) -> None:
    # the service's status when the VM's kernel died (or another client restarted it): the
    # clients see it, then the bridge ends, so the manager sees a dead kernel (no reply comes)
    bridge, client = wired
    await bridge.to_clients(_frame("iopub", "status", "req", execution_state="busy"))
    assert not bridge.done.is_set()
    await bridge.to_clients(_frame("iopub", "status", "", execution_state="restarting"))
    assert await client.received(0.5) == ["status", "status"]
    assert bridge.done.is_set() and bridge.exit_code == 1


async def test_the_bridge_deletes_its_kernel_and_ends_when_its_parent_is_gone(
    wired: tuple[Bridge, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    bridge, _ = wired
    deleted: list[bool] = []

    async def delete_kernel() -> None:
        deleted.append(True)

    monkeypatch.setattr(bridge, "delete_kernel", delete_kernel)
    monkeypatch.setattr(bridge_mod, "PARENT_POLL_S", 0.05)
    parent = {"pid": os.getppid()}
    monkeypatch.setattr(os, "getppid", lambda: parent["pid"])
    bridge.cfg["parent_pid"] = parent["pid"]
    watcher = asyncio.create_task(bridge.watch_parent())
    await asyncio.sleep(0.2)
    assert not deleted and not bridge.done.is_set()  # the parent lives
    parent["pid"] = 1  # reparented: the manager's process exited
    await asyncio.wait_for(watcher, 2)
    assert deleted == [True] and bridge.done.is_set() and bridge.exit_code == 0
