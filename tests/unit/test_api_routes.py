"""The HTTP layer's sandbox routes and limit settings: the routes, error statuses, the guest's
filesystem errors mapped to clear ones, and the validation of limit settings."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kernelhost.api import init_app
from kernelhost.api.errors import status_for
from kernelhost.config import ConfigError, Settings
from kernelhost.sandboxes import (
    AgentUnresponsive,
    FileOperationFailed,
    FileTooLarge,
    NotSupportedByImage,
    PathNotFound,
    Sandbox,
    SandboxDiskFull,
)
from kernelhost.sandboxes.inside.files import _fs_error, _rechunk

from .offline import fake_image_dir, offline_settings

pytestmark = pytest.mark.unit
ApiClient = TestClient[web.Request, web.Application]  # aiohttp's test client over the service's app

KEY = "unit-test-key-0123456789"


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[ApiClient]:
    settings = offline_settings(
        tmp_path, image_dir=fake_image_dir(tmp_path), boot_timeout=1.0, snapshots="off", api_keys=(KEY,)
    )
    async with TestClient(TestServer(init_app(settings))) as c:
        yield c


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/sandboxes/sbx_nope/interrupt"),
        ("POST", "/v1/sandboxes/sbx_nope/restart"),
        ("GET", "/v1/sandboxes/sbx_nope/files?path=a.txt"),
        ("PUT", "/v1/sandboxes/sbx_nope/files?path=a.txt"),
        ("DELETE", "/v1/sandboxes/sbx_nope/files?path=a.txt"),
        ("GET", "/v1/sandboxes/sbx_nope/files/list"),
    ],
)
async def test_sandbox_routes_answer_404_for_an_unknown_sandbox(
    client: ApiClient, method: str, path: str
) -> None:
    r = await client.request(
        method, path, headers={"Authorization": f"Bearer {KEY}"}, data=b"x" if method == "PUT" else None
    )
    assert r.status == 404
    body = await r.json()
    assert body["error"]["code"] == "sandbox_not_found" and "sbx_nope" in body["error"]["message"]


@pytest.mark.parametrize(
    "checkpoint", ["cp_0123456789abcdef", "\ud800", "x" * 5000, "cp_" + "0" * 15 + "\x00"]
)
async def test_a_branch_from_no_such_checkpoint_is_a_404(client: ApiClient, checkpoint: str) -> None:
    body = '{"checkpoint": ' + json.dumps(checkpoint) + "}"  # a lone surrogate stays escaped
    r = await client.post(
        "/v1/sandboxes",
        data=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status == 404, await r.text()
    assert (await r.json())["error"]["code"] == "checkpoint_not_found"


async def test_sandbox_routes_need_a_key(client: ApiClient) -> None:
    r = await client.get("/v1/sandboxes/sbx_nope/files?path=a.txt")
    assert r.status == 401


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (PathNotFound("x"), 404),
        (FileTooLarge("x"), 413),
        (SandboxDiskFull("x"), 507),
        (AgentUnresponsive("x"), 503),
        (NotSupportedByImage("x"), 501),
        (FileOperationFailed("x"), 400),
    ],
)
def test_error_statuses(error: Exception, status: int) -> None:
    assert status_for(error) == status  # type: ignore[arg-type]


# a stand-in with all that _fs_error reads of a sandbox
SBX = cast(Sandbox, SimpleNamespace(id="sbx_1", record=SimpleNamespace(memory_mib=512)))


def test_guest_filesystem_errors_become_clear_ones() -> None:
    missing = _fs_error(
        SBX, {"errno": "ENOENT", "message": "No such file", "path": "/home/user/a"}, {"path": "a"}
    )
    assert isinstance(missing, PathNotFound) and "/home/user/a" in str(missing)
    full = _fs_error(SBX, {"errno": "ENOSPC", "message": "No space"}, {"path": "big.bin"})
    assert isinstance(full, SandboxDiskFull) and "vm_memory_mib" in str(full)
    busy = _fs_error(
        SBX, {"errno": "ENOTEMPTY", "message": "Directory not empty", "path": "/home/user/d"}, {"path": "d"}
    )
    assert isinstance(busy, FileOperationFailed) and "recursive=true" in str(busy)
    assert busy.details["errno"] == "ENOTEMPTY"
    # a hostile guest's nonsense is still an error, of bounded size, naming what was asked
    junk = _fs_error(SBX, ["not", "a", "map"], {"dst": "target.txt"})
    assert isinstance(junk, FileOperationFailed) and "target.txt" in str(junk)
    long = _fs_error(SBX, {"errno": "E" * 10_000, "message": "m" * 10_000}, {"path": "p"})
    assert len(str(long)) < 400


async def test_rechunk_gives_exact_pieces() -> None:
    async def source() -> AsyncIterator[bytes]:
        for part in (b"ab", b"cdefg", b"", b"h", b"ijklmnop"):
            yield part

    assert [p async for p in _rechunk(source(), 3)] == [b"abc", b"def", b"ghi", b"jkl", b"mno", b"p"]


@pytest.mark.parametrize(
    ("name", "value", "word"),
    [
        ("max_output_bytes", "10", "max_output_bytes"),
        ("max_file_bytes", "0", "max_file_bytes"),
        ("max_result_bytes", str(128 << 20), "max_frame_bytes"),
        ("agent_timeout", "0", "agent_timeout"),
        ("restart_timeout", "-1", "restart_timeout"),
        ("default_execution_timeout", "-5", "default_execution_timeout"),
    ],
)
def test_limit_settings_are_validated(name: str, value: str, word: str) -> None:
    with pytest.raises(ConfigError) as err:
        Settings.load({f"KERNELHOST_{name.upper()}": value})
    assert word in str(err.value)


def test_limit_settings_defaults_and_env() -> None:
    s = Settings.load({"KERNELHOST_MAX_OUTPUT_BYTES": "2048", "KERNELHOST_DEFAULT_EXECUTION_TIMEOUT": "30"})
    assert s.max_output_bytes == 2048 and s.default_execution_timeout == 30.0
    d = Settings.load({})
    assert (d.max_result_bytes, d.max_file_bytes, d.agent_timeout) == (16 << 20, 256 << 20, 10.0)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for name in (
        "max_output_bytes",
        "max_result_bytes",
        "max_file_bytes",
        "default_execution_timeout",
        "restart_timeout",
        "agent_timeout",
    ):
        assert f"`{name}`" in doc
