"""E2B's in-sandbox credentials, offline (issue 35): tokens random and kept only as hashes,
every refusal the same 404, a key no longer configured, refused calls not counted, a bounded
process summary, an older table migrated. No VM: a branch's record is put in place."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kernelhost.api import init_app
from kernelhost.api.e2b.common import NO_SUCH_SANDBOX
from kernelhost.api.e2b.process import summary
from kernelhost.api.state import RUNTIME
from kernelhost.sandboxes.access import (
    MAX_ACCESS_TOKENS,
    TOKEN_PREFIX,
    kept_hashes,
    new_access_token,
    token_hash,
    token_matches,
)
from kernelhost.sandboxes.checkpoints.service import Checkpoints
from kernelhost.sandboxes.store.db import SQLite
from kernelhost.sandboxes.store.sandboxes import Store

from .e2b_support import KEY, ApiClient, put_kept
from .e2b_support import client as client  # the fixture: pytest finds it by its name
from .offline import fake_image_dir, offline_settings

pytestmark = pytest.mark.unit


@pytest.fixture
async def branched(client: ApiClient, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """An E2B create's answer for a live sandbox whose VM was never started."""

    async def launched(self: Checkpoints, sbx: object, cp: object, image: object) -> None:
        return None

    monkeypatch.setattr(Checkpoints, "_launch", launched)
    put_kept(client, "sbx_gone00000000007", label="start")
    r = await client.post("/e2b/v2/sandboxes", json={"templateID": "start"}, headers={"X-API-KEY": KEY})
    assert r.status == 201, await r.text()
    made: dict[str, Any] = await r.json()
    return made


def _in(made: dict[str, Any], token: str | None = "", sandbox_id: str = "") -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": sandbox_id or made["sandboxID"]}
    if token is not None:
        headers["X-Access-Token"] = token or made["envdAccessToken"]
    return headers


async def test_tokens_are_random_and_only_their_hashes_arekept(
    client: ApiClient, branched: dict[str, Any]
) -> None:
    token = branched["envdAccessToken"]
    assert branched["trafficAccessToken"] == token and token.startswith(TOKEN_PREFIX)
    rec = client.app[RUNTIME].store.get(branched["sandboxID"])
    # its hash, and the seed it derives from with the service's key (a signed URL's check)
    assert rec is not None and [t.partition(".")[0] for t in rec.access_tokens] == [token_hash(token)]
    db_bytes = b"".join(p.read_bytes() for p in client.app[RUNTIME].settings.state_dir.glob("*.sqlite3*"))
    assert token.encode() not in db_bytes
    manager = client.app[RUNTIME].manager
    sbx = manager.find(branched["sandboxID"])
    assert sbx is not None
    again = manager.mint_access_token(sbx)  # what a connect does (a VM-less sandbox cannot wake)
    assert again != token
    # (envd's /health: an in-sandbox call that needs no guest, which this VM-less one lacks)
    for presented in (token, again):  # a connect's token does not cut off the creator's
        r = await client.get("/e2b/sandbox/health", headers=_in(branched, presented))
        assert r.status == 204, await r.text()
        assert (await client.get("/e2b/sandbox/health", headers=_in(branched, "kh_sbx_wrong"))).status == 502
    traffic = {"E2b-Sandbox-Id": branched["sandboxID"], "E2B-Traffic-Access-Token": token}
    r = await client.get("/e2b/sandbox/health", headers=traffic)  # what the SDKs send there
    assert r.status == 204, await r.text()


async def test_every_refusal_of_an_in_sandbox_call_is_the_same_404(
    client: ApiClient, branched: dict[str, Any]
) -> None:
    cases = [
        _in(branched, "kh_sbx_wrong"),
        _in(branched, None),
        _in(branched, sandbox_id="sbx_00000000deadbeef"),
        {"E2b-Sandbox-Id": branched["sandboxID"], "E2B-Traffic-Access-Token": "kh_sbx_wrong"},
    ]
    for method, path in (
        ("GET", "/e2b/sandbox/contexts"),
        ("POST", "/e2b/sandbox/contexts/python/restart"),
        ("POST", "/e2b/sandbox/filesystem.Filesystem/ListDir"),
    ):
        seen = set()
        for headers in cases:
            r = await client.request(method, path, headers=headers, json={})
            seen.add((r.status, await r.read()))
        assert len(seen) == 1 and next(iter(seen))[0] == 404, (path, seen)
        # the message as a forwarding cluster node words it too
        assert json.loads(next(iter(seen))[1])["message"] == NO_SUCH_SANDBOX


async def test_a_sandbox_of_a_key_no_longer_configured_takes_no_token(
    client: ApiClient, branched: dict[str, Any]
) -> None:
    sbx = client.app[RUNTIME].manager.find(branched["sandboxID"])
    assert sbx is not None
    sbx.record.owner = "key_removed00"  # as after a restart without its key
    forged = hmac.new(b"", f"e2b-envd:{sbx.id}".encode(), hashlib.sha256).hexdigest()[:40]
    for token in ("kh_" + forged, branched["envdAccessToken"]):
        r = await client.get("/e2b/sandbox/contexts", headers=_in(branched, token))
        assert r.status == 404, (token, await r.text())


async def test_refused_calls_are_not_counted_and_bodies_have_a_deadline(tmp_path: Path) -> None:
    settings = offline_settings(
        tmp_path,
        image_dir=fake_image_dir(tmp_path),
        pool_size=0,
        api_keys=(KEY,),
        max_requests_per_key=2,
        body_timeout=0.5,
    )
    async with TestClient(TestServer(init_app(settings))) as c:
        host, port = c.server.host, c.server.port

        async def held(path: str, *headers: str) -> bytes:
            reader, writer = await asyncio.open_connection(host, port)
            head = [f"POST {path} HTTP/1.1", f"Host: {host}", *headers, "Content-Length: 100", "", ""]
            writer.write("\r\n".join(head).encode())
            try:
                return await asyncio.wait_for(reader.readline(), 5)
            finally:
                writer.close()

        refused = await asyncio.gather(
            *[held("/e2b/sandbox/contexts", "E2b-Sandbox-Id: sbx_00000000deadbeef") for _ in range(5)]
        )
        assert refused == [b"HTTP/1.1 404 Not Found\r\n"] * 5
        slow = await held("/e2b/v2/sandboxes", f"X-API-KEY: {KEY}")
        assert slow.startswith(b"HTTP/1.1 408"), slow
        r = await c.get("/e2b/sandboxes", headers={"X-API-KEY": KEY})
        assert r.status == 200  # nothing counted is left open


def test_a_sandbox_keeps_its_first_token_and_its_newest() -> None:
    hashes: list[str] = []
    for n in range(MAX_ACCESS_TOKENS + 5):
        hashes = kept_hashes(hashes, f"h{n}")
    assert (
        len(hashes) == MAX_ACCESS_TOKENS and hashes[0] == "h0" and hashes[-1] == f"h{MAX_ACCESS_TOKENS + 4}"
    )
    token, digest = new_access_token()
    assert token_matches([digest], token) and not token_matches([digest], token + "x")
    assert not token_matches([], "") and not token_matches([token_hash("")], "")


def test_a_process_keeps_a_bounded_summary_of_its_request() -> None:
    config = {
        "cmd": "/bin/bash",
        "args": ["-l", "-c", "x" * 1_000_000, *["a" * 500] * 100],
        "envs": {f"V{i}": "v" * 1000 for i in range(100)},
        "cwd": "/" + "d" * 5000,
    }
    kept = summary(config)
    assert len(json.dumps(kept)) < 6000
    assert kept["args"][:2] == ["-l", "-c"] and kept["args"][2].endswith("…") and len(kept["args"]) == 16


def test_an_older_sandbox_table_gains_access_tokens(tmp_path: Path) -> None:
    db = SQLite(tmp_path / "old.sqlite3")
    db.execute(
        "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, owner TEXT NOT NULL, template TEXT NOT NULL, "
        "domain TEXT NOT NULL UNIQUE, state TEXT NOT NULL, created_at REAL NOT NULL, last_active_at "
        "REAL NOT NULL, idle_timeout_seconds INTEGER NOT NULL, memory_mib INTEGER NOT NULL, vcpus "
        "INTEGER NOT NULL, accel TEXT NOT NULL, image_key TEXT NOT NULL, metadata TEXT NOT NULL "
        "DEFAULT '{}', detail TEXT NOT NULL DEFAULT '')"
    )
    db.execute(
        "INSERT INTO sandboxes (id, owner, template, domain, state, created_at, last_active_at, "
        "idle_timeout_seconds, memory_mib, vcpus, accel, image_key) VALUES ('sbx_1', 'key_1', "
        "'python', 'kh-1', 'running', 1.0, 1.0, 60, 512, 1, 'tcg', 'k1')"
    )
    old = Store(db).get("sbx_1")
    assert old is not None and old.access_tokens == []
