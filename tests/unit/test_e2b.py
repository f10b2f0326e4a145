"""The E2B surface's own parts, offline: the Connect codec (sans-IO), and the error shapes and
auth checks of /e2b on libvirt's test driver (no VM: a sandbox call needs one, the tests under
tests/clients/agents/test_e2b.py make them)."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kernelhost.api import init_app
from kernelhost.api.e2b.connect import ConnectError, end_stream, envelope, parse_stream_request
from kernelhost.api.e2b.process import command_line, script

from .offline import fake_image_dir, offline_settings

pytestmark = pytest.mark.unit
ApiClient = TestClient[web.Request, web.Application]
KEY = "unit-test-key-0123456789"


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[ApiClient]:
    settings = offline_settings(tmp_path, image_dir=fake_image_dir(tmp_path), pool_size=0, api_keys=(KEY,))
    async with TestClient(TestServer(init_app(settings))) as c:
        yield c


def test_envelopes_round_trip_and_the_end_of_stream_carries_the_error() -> None:
    frame = envelope({"event": {"start": {"pid": 7}}})
    assert frame[0] == 0 and struct.unpack(">I", frame[1:5])[0] == len(frame) - 5
    assert parse_stream_request(frame) == {"event": {"start": {"pid": 7}}}
    end = end_stream(ConnectError("deadline_exceeded", "too slow"))
    assert end[0] == 0x02 and json.loads(end[5:]) == {
        "error": {"code": "deadline_exceeded", "message": "too slow"}
    }
    assert json.loads(end_stream()[5:]) == {}


@pytest.mark.parametrize(
    "body, says",
    [
        (b"\x00\x00", "not an enveloped"),
        (b"\x01\x00\x00\x00\x02{}", "compressed"),
        (struct.pack(">BI", 0, 50) + b"{}", "truncated"),
        (struct.pack(">BI", 0, 2) + b"[]", "JSON object"),
    ],
)
def test_bad_stream_requests_are_named(body: bytes, says: str) -> None:
    with pytest.raises(ConnectError, match=says):
        parse_stream_request(body)


def test_commands_run_as_e2b_sends_them_in_a_subshell_of_their_own() -> None:
    assert command_line({"cmd": "/bin/bash", "args": ["-l", "-c", "echo $A"]}) == "echo $A"
    assert command_line({"cmd": "ls", "args": ["-l", "a b"]}) == "ls -l 'a b'"
    body = script({"cmd": "/bin/bash", "args": ["-l", "-c", "pwd"], "cwd": "/tmp x", "envs": {"A": "1 2"}})
    assert body == "(\nexport HOME=/home/user\ncd -- '/tmp x' || exit 1\nexport A='1 2'\npwd\n)"
    with pytest.raises(ConnectError, match="not valid"):
        script({"cmd": "true", "envs": {"A-B": "x"}})


async def test_lifecycle_errors_are_e2b_shaped(client: ApiClient) -> None:
    r = await client.post("/e2b/v2/sandboxes", json={})
    assert r.status == 401 and (await r.json())["code"] == 401 and r.headers["Should-Retry"] == "false"
    headers = {"X-API-KEY": KEY}
    r = await client.get("/e2b/sandboxes/sbx_0000000000000000", headers=headers)
    assert r.status == 404 and set(await r.json()) == {"code", "message"}
    r = await client.get("/e2b/volumes", headers=headers)
    assert r.status == 501 and "volumes" in (await r.json())["message"]
    r = await client.get("/e2b/no/such/thing", headers=headers)
    assert r.status == 404 and "not part of kernelhost's E2B surface" in (await r.json())["message"]
    r = await client.post("/e2b/v2/sandboxes", json={"templateID": 5}, headers=headers)
    assert r.status == 400 and "templateID" in (await r.json())["message"]


async def test_in_sandbox_calls_need_a_known_sandbox(client: ApiClient) -> None:
    r = await client.get("/e2b/sandbox/health")
    assert r.status == 204
    r = await client.get("/e2b/sandbox/files", params={"path": "/x"})
    assert r.status == 404 and "E2B_SANDBOX_URL" in (await r.json())["message"]
    r = await client.post(
        "/e2b/sandbox/filesystem.Filesystem/Stat", json={}, headers={"E2b-Sandbox-Id": "sbx_nope"}
    )
    assert r.status == 404 and (await r.json())["code"] == "not_found"
