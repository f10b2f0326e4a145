"""The Kernel Gateway without a VM: its WebSocket framings (checked against jupyter_server's own
code) and its kernel models. (The sessions behind its WebSockets: test_session.py.)"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

from kernelhost.api import gateway
from kernelhost.jupyter import wire
from kernelhost.sandboxes import Sandbox, SandboxRecord, SandboxState

pytestmark = pytest.mark.unit


def _msg(msg_type: str = "execute_request", **content: Any) -> dict[str, Any]:
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "session": "s",
            "username": "u",
            "version": "5.3",
            "date": "2026-01-01T00:00:00Z",
        },
        "parent_header": {},
        "metadata": {"m": 1},
        "content": content or {"code": "1"},
        "buffers": [b"\x00\x01", b"buf"],
    }


# -- framings -------------------------------------------------------------------------------------


def test_v1_frames_match_jupyter_server() -> None:
    from jupyter_server.services.kernels.connection import base

    # unannotated upstream: typed here as this test calls them
    deserialize_msg_from_ws_v1: Callable[[bytes], tuple[str, list[bytes]]] = base.deserialize_msg_from_ws_v1
    serialize_msg_to_ws_v1: Callable[[list[bytes], str], bytes] = base.serialize_msg_to_ws_v1

    msg = _msg()
    frame = wire.to_v1("shell", msg)
    channel, parts = deserialize_msg_from_ws_v1(frame)
    assert channel == "shell" and [json.loads(p) for p in parts[:4]] == [
        msg["header"],
        {},
        {"m": 1},
        {"code": "1"},
    ]
    assert parts[4:] == msg["buffers"]
    theirs = serialize_msg_to_ws_v1(
        [json.dumps(msg[k]).encode() for k in wire.PARTS] + msg["buffers"], "iopub"
    )
    channel, back = wire.from_v1(theirs)
    assert channel == "iopub" and back == msg


def test_legacy_frames() -> None:
    from jupyter_server.services.kernels.connection import base

    # unannotated upstream: typed here as this test calls it
    serialize_binary_message: Callable[[dict[str, Any]], bytes] = base.serialize_binary_message

    msg = _msg()
    text = json.loads(wire.to_text("stdin", msg))
    assert text["channel"] == "stdin" and text["buffers"] == [] and text["msg_type"] == "execute_request"
    assert wire.from_text(json.dumps({**text, "channel": None}))[0] == "shell"  # default
    binary = serialize_binary_message({"channel": "shell", **msg})
    channel, back = wire.from_legacy_binary(binary)
    assert channel == "shell" and back["buffers"] == msg["buffers"]
    assert back["header"] == msg["header"]
    # null parent and content are "none", and odd values still make JSON
    assert (
        wire.from_text(
            '{"header": {"msg_id": "a", "msg_type": "t"}, "parent_header": null, "content": null}'
        )[1]["parent_header"]
        == {}
    )
    assert json.loads(wire.dumps({"x": float("nan"), "b": b"\xff"})) == {"x": None, "b": "/w=="}


@pytest.mark.parametrize(
    ("frame", "fault"),
    [
        ("[]", "JSON object"),
        ("{", "one JSON object"),
        ('{"channel": "shell", "header": {"msg_type": "x"}}', "msg_id"),
        ('{"channel": "nope", "header": {"msg_id": "a", "msg_type": "x"}}', "channel"),
        ('{"header": {"msg_id": "a", "msg_type": "x"}, "content": []}', "content"),
    ],
)
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


def test_models() -> None:
    now = time.time()
    sbx = Sandbox(
        SandboxRecord(
            "sbx_2", "key", "python", "dom", SandboxState.HIBERNATED, now, now, 600, 512, 1, "tcg", "k"
        )
    )
    model = gateway.kernel_model(sbx)
    assert model["execution_state"] == "idle" and model["connections"] == 0
    assert model["id"] == gateway.kernel_id("sbx_2") and model["sandbox_id"] == "sbx_2"
    sbx.record.state, sbx.record.detail = SandboxState.DEAD, "the VM stopped"
    model = gateway.kernel_model(sbx)
    assert model["execution_state"] == "dead" and model["reason"] == "the VM stopped"


@pytest.mark.parametrize(
    "module", ["kernelhost.jupyter.provisioner", "kernelhost.jupyter.bridge", "kernelhost.jupyter.kernelspec"]
)
def test_the_jupyter_client_side_speaks_http_only(module: str) -> None:
    """Like the SDK, the provisioner and its bridge import nothing of the server."""
    import subprocess
    import sys

    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    mods = set(json.loads(out.stdout))
    server = {
        "kernelhost.api",
        "kernelhost.sandboxes",
        "kernelhost.channel",
        "hypervisor",
        "libvirt",
        "aiohttp.web",
    }
    assert not mods & server, mods & server
