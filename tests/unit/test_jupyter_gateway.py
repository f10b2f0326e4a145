"""The Kernel Gateway without a VM: its WebSocket framings (checked against jupyter_server's own
code), its kernel models, and the hub of one sandbox's WebSockets driven by a fake agent:
routing, the execution lock, restarts and removal."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import datetime
from types import SimpleNamespace
from typing import Any

import pytest

from kernelhost.api import gateway
from kernelhost.channel import AgentClient
from kernelhost.jupyter import wire
from kernelhost.sandboxes import Sandbox, SandboxRecord
from kernelhost.sandboxes.manager import _listen

from .fake_agent import WAIT, FakeAgent, short_socket_dir, stream

pytestmark = pytest.mark.unit


def _msg(msg_type: str = "execute_request", **content: Any) -> dict[str, Any]:
    return {"header": {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": "s",
                       "username": "u", "version": "5.3", "date": "2026-01-01T00:00:00Z"},
            "parent_header": {}, "metadata": {"m": 1}, "content": content or {"code": "1"},
            "buffers": [b"\x00\x01", b"buf"]}


# -- framings -------------------------------------------------------------------------------------


def test_v1_frames_match_jupyter_server() -> None:
    from jupyter_server.services.kernels.connection.base import (
        deserialize_msg_from_ws_v1,
        serialize_msg_to_ws_v1,
    )

    msg = _msg()
    frame = wire.to_v1("shell", msg)
    channel, parts = deserialize_msg_from_ws_v1(frame)
    assert channel == "shell" and [json.loads(p) for p in parts[:4]] == [
        msg["header"], {}, {"m": 1}, {"code": "1"}]
    assert parts[4:] == msg["buffers"]
    theirs = serialize_msg_to_ws_v1([json.dumps(msg[k]).encode() for k in wire.PARTS]
                                    + msg["buffers"], "iopub")
    channel, back = wire.from_v1(theirs)
    assert channel == "iopub" and back == msg


def test_legacy_frames() -> None:
    from jupyter_server.services.kernels.connection.base import serialize_binary_message

    msg = _msg()
    text = json.loads(wire.to_text("stdin", msg))
    assert text["channel"] == "stdin" and text["buffers"] == [] and text["msg_type"] == \
        "execute_request"
    assert wire.from_text(json.dumps({**text, "channel": None}))[0] == "shell"  # default
    binary = serialize_binary_message({"channel": "shell", **msg})
    channel, back = wire.from_legacy_binary(binary)
    assert channel == "shell" and back["buffers"] == msg["buffers"]
    assert back["header"] == msg["header"]
    # null parent and content are "none", and odd values still make JSON
    assert wire.from_text('{"header": {"msg_id": "a", "msg_type": "t"}, "parent_header": null, '
                          '"content": null}')[1]["parent_header"] == {}
    assert json.loads(wire.dumps({"x": float("nan"), "b": b"\xff"})) == {"x": None, "b": "/w=="}


@pytest.mark.parametrize(("frame", "fault"), [
    ("[]", "JSON object"),
    ("{", "one JSON object"),
    ('{"channel": "shell", "header": {"msg_type": "x"}}', "msg_id"),
    ('{"channel": "nope", "header": {"msg_id": "a", "msg_type": "x"}}', "channel"),
    ('{"header": {"msg_id": "a", "msg_type": "x"}, "content": []}', "content"),
])
def test_bad_text_frames_name_the_fault(frame: str, fault: str) -> None:
    with pytest.raises(wire.WireError, match=fault):
        wire.from_text(frame)


def test_bad_v1_frames() -> None:
    good = wire.to_v1("shell", _msg())
    for bad in (b"", good[:20], good[:-1], b"\xff" * 8 + good[8:]):
        with pytest.raises(wire.WireError):
            wire.from_v1(bad)


def test_kernel_ids_and_times_are_what_jupyter_server_parses() -> None:
    kid = gateway.kernel_id("sbx_0123456789abcdef")
    assert kid == gateway.kernel_id("sbx_0123456789abcdef") and str(uuid.UUID(kid)) == kid
    datetime.strptime(gateway.iso(time.time()), "%Y-%m-%dT%H:%M:%S.%fZ")
    assert gateway.iso(0) == "1970-01-01T00:00:00.000000Z"


# -- the hub, on a fake agent ---------------------------------------------------------------------


class FakeConn:
    def __init__(self) -> None:
        self.got: list[tuple[str, dict[str, Any]]] = []
        self.closed: tuple[int, str] | None = None

    def push(self, channel: str, msg: dict[str, Any], cache: dict[bool, Any]) -> None:
        self.got.append((channel, msg))

    def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)

    def types(self, channel: str | None = None) -> list[str]:
        return [m["header"]["msg_type"] for c, m in self.got if channel in (None, c)]


class FakeManager:
    def __init__(self) -> None:
        self.sandboxes: dict[str, Sandbox] = {}
        self.store = SimpleNamespace(touch=lambda *a: None)

    async def _wait_replacement(self, sbx: Sandbox) -> None:
        return None

    async def _ensure_awake(self, sbx: Sandbox) -> None:
        return None

    def _check_running(self, sbx: Sandbox) -> None:
        return None


@pytest.fixture
async def hub_setup():  # type: ignore[no-untyped-def]
    with short_socket_dir() as d:
        fake = await FakeAgent(f"{d}/agent.sock").start()
        agent = AgentClient(f"{d}/agent.sock")
        await agent.connect(timeout=WAIT)
        now = time.time()
        sbx = Sandbox(SandboxRecord("sbx_1", "key", "python", "dom", "running", now, now, 600,
                                    512, 1, "tcg", "k"))
        sbx.agent = agent
        manager = FakeManager()
        manager.sandboxes[sbx.id] = sbx
        _listen(sbx, agent)  # the manager's broadcast, as _bind wires it
        gw = gateway.Gateway()
        hub = gw.hub(manager, sbx)  # type: ignore[arg-type]
        a, b = FakeConn(), FakeConn()
        hub.attach(a)  # type: ignore[arg-type]
        hub.attach(b)  # type: ignore[arg-type]
        try:
            yield fake, sbx, hub, a, b, gw, manager
        finally:
            await agent.close()
            await fake.stop()


async def _until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + WAIT
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def test_replies_go_to_the_sender_and_iopub_to_everyone(hub_setup) -> None:  # type: ignore[no-untyped-def]
    fake, sbx, hub, a, b, _, _ = hub_setup
    request = _msg(code="print('hi')")
    await hub.send_shell(a, request)
    assert sbx.lock.locked() and hub.holding  # a native execute waits for this cell
    request_seen = await fake.wait_for_execute()
    await fake.run_execute(request_seen, [stream("hi\n")])
    await _until(lambda: "execute_reply" in a.types(), "the reply")
    assert a.types("iopub") == b.types("iopub") == ["status", "execute_input", "stream", "status"]
    assert "execute_reply" not in b.types()
    await _until(lambda: not sbx.lock.locked(), "the lock given back")
    assert hub.outstanding == set() and not hub.holding
    # the buffers of the request went to the agent as they were
    assert request_seen["buffers"] == [b"\x00\x01", b"buf"]


async def test_gateway_cells_queue_in_the_kernel_under_one_hold(hub_setup) -> None:  # type: ignore[no-untyped-def]
    fake, sbx, hub, a, b, _, _ = hub_setup
    first, second = _msg(code="1"), _msg(code="2")
    await hub.send_shell(a, first)
    await hub.send_shell(b, second)  # not blocked: the gateway already holds the lock
    assert hub.outstanding == {first["header"]["msg_id"], second["header"]["msg_id"]}
    await fake.wait_until(lambda: len(fake.requests("jupyter")) == 2)
    one, two = (f["msg"] for f in fake.requests("jupyter"))
    await fake.run_execute(one)
    await _until(lambda: len(hub.outstanding) == 1, "the first cell done")
    assert sbx.lock.locked()
    await fake.run_execute(two)
    await _until(lambda: not sbx.lock.locked(), "the lock given back")


async def test_a_gateway_cell_waits_for_a_native_call(hub_setup) -> None:  # type: ignore[no-untyped-def]
    fake, sbx, hub, a, _, _, _ = hub_setup
    await sbx.lock.acquire()  # a native execute runs
    sending = asyncio.ensure_future(hub.send_shell(a, _msg(code="1")))
    await asyncio.sleep(0.05)
    assert not sending.done() and fake.requests("jupyter") == []
    sbx.lock.release()
    await asyncio.wait_for(sending, WAIT)
    assert hub.holding
    await fake.wait_until(lambda: len(fake.requests("jupyter")) == 1)


async def test_restarts_release_the_lock_and_tell_the_clients(hub_setup) -> None:  # type: ignore[no-untyped-def]
    fake, sbx, hub, a, b, _, _ = hub_setup
    await hub.send_shell(a, _msg(code="import time; time.sleep(100)"))
    assert sbx.lock.locked()
    await fake.event("kernel_restarted", reason="requested")  # the SDK restarted it
    await _until(lambda: not sbx.lock.locked(), "the lock given back")
    for conn in (a, b):
        assert conn.got[-1][1]["content"] == {"execution_state": "restarting"}
    # a restart asked through the gateway's REST API is not announced (clients reconnect)
    hub.quiet_restart = True
    await fake.event("kernel_restarted", reason="requested")
    await fake.event("kernel_died", exit_code=1)  # ... a death always is
    await _until(lambda: len(a.got) == 2, "the death announced")


async def test_removal_closes_the_websockets(hub_setup) -> None:  # type: ignore[no-untyped-def]
    _, sbx, hub, a, b, gw, manager = hub_setup
    del manager.sandboxes[sbx.id]
    assert sbx.agent is not None
    await sbx.agent.close()
    assert a.closed is not None and a.closed[0] == 4004 and b.closed == a.closed
    assert a.got[-1][1]["content"] == {"execution_state": "dead"}
    hub.detach(a)
    hub.detach(b)
    assert hub not in sbx.listeners and sbx.id not in gw.hubs


def test_models() -> None:
    now = time.time()
    sbx = Sandbox(SandboxRecord("sbx_2", "key", "python", "dom", "hibernated", now, now, 600,
                                512, 1, "tcg", "k"))
    model = gateway.Gateway().model(sbx)
    assert model["execution_state"] == "idle" and model["connections"] == 0
    assert model["id"] == gateway.kernel_id("sbx_2") and model["sandbox_id"] == "sbx_2"
    sbx.record.state, sbx.record.detail = "dead", "the VM stopped"
    model = gateway.Gateway().model(sbx)
    assert model["execution_state"] == "dead" and model["reason"] == "the VM stopped"


@pytest.mark.parametrize("module", ["kernelhost.jupyter.provisioner", "kernelhost.jupyter.bridge",
                                    "kernelhost.jupyter.kernelspec"])
def test_the_jupyter_client_side_speaks_http_only(module: str) -> None:
    """Like the SDK, the provisioner and its bridge import nothing of the server."""
    import subprocess
    import sys

    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    mods = set(json.loads(out.stdout))
    server = {"kernelhost.api", "kernelhost.sandboxes", "kernelhost.channel", "hypervisor",
              "libvirt", "aiohttp.web"}
    assert not mods & server, mods & server
