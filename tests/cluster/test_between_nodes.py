"""Issue 35, finding 12, mounted through real nodes: trust between the nodes of a cluster.

The attacker reads the network between nodes (the relay in front of node B keeps every call
forwarded to B) or can write rows of the shared PostgreSQL. Each test names what must fail:

- a captured forwarded call, sent again as it was, is refused (its nonce was seen), and so is it
  sent to another node (signed for B) or changed (another owner, another path);
- a forwarded call carries none of the client's credentials (``Authorization``, ``X-API-KEY``,
  ``X-Access-Token``) nor the cluster secret: nothing on the wire between nodes to reuse;
- a node row whose URL was not registered with the cluster secret gets no forwarded call and no
  placement;
- a checkpoint row naming files outside the node's own directories makes the node delete nothing
  there (refused, logged).

This file runs before test_cluster.py and leaves the cluster as it found it (its rows go, the
one sandbox it makes is deleted).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from kernelhost.api.auth import key_id
from kernelhost.sandboxes.store.db import PostgreSQL

from .conftest import Cluster
from .relay import Captured

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

CREDENTIAL_HEADERS = ("authorization", "x-api-key", "x-access-token", "cookie")


@contextlib.contextmanager
def _store(cluster: Cluster) -> Iterator[PostgreSQL]:
    db = PostgreSQL(cluster.store_url)
    try:
        yield db
    finally:
        db.close()


@contextlib.contextmanager
def _sandbox_row(cluster: Cluster, node: str, owner: str) -> Iterator[str]:
    """A running sandbox's row on ``node``, as the attacker (or a node) wrote it; no VM."""
    sid = "sbx_" + secrets.token_hex(8)
    row = {
        "id": sid,
        "owner": owner,
        "template": "python",
        "domain": "khrow-" + secrets.token_hex(6),
        "state": "running",
        "created_at": time.time(),
        "last_active_at": time.time(),
        "idle_timeout_seconds": 600,
        "memory_mib": 128,
        "vcpus": 1,
        "accel": "tcg",
        "image_key": "",
        "node": node,
        "access_tokens": json.dumps([hashlib.sha256(ENVD_TOKEN.encode()).hexdigest()]),
    }
    cols, marks = ", ".join(row), ", ".join(f":{k}" for k in row)
    with _store(cluster) as db:
        db.execute(f"INSERT INTO sandboxes ({cols}) VALUES ({marks})", row)
        try:
            yield sid
        finally:
            db.execute("DELETE FROM sandboxes WHERE id = ?", (sid,))


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


#: the E2B access token of the rows ``_sandbox_row`` writes (a sandbox keeps only its hash)
ENVD_TOKEN = "kh_" + secrets.token_hex(20)


def _forwarded(cluster: Cluster, sid: str) -> list[Captured]:
    return [r for r in cluster.relay_b.requests() if sid in r.target or r.header("E2b-Sandbox-Id") == sid]


async def _send(
    http: aiohttp.ClientSession, base: str, req: Captured, **change: str
) -> tuple[int, dict[str, Any]]:
    """``req`` sent again to the node at ``base``, with ``change`` (method, target, or headers)."""
    headers = {k: v for k, v in req.headers if k.lower() not in ("host", "content-length")}
    method, target = change.pop("method", req.method), change.pop("target", req.target)
    for name, value in change.items():
        headers = {k: v for k, v in headers.items() if k.lower() != name.lower()}
        headers[name] = value
    async with http.request(method, URL(base + target, encoded=True), headers=headers) as r:
        body = await r.read()
        return r.status, (json.loads(body) if body and r.content_type == "application/json" else {})


def _message(body: dict[str, Any]) -> str:
    return str(body.get("error", {}).get("message", body))


async def test_a_forwarded_call_carries_no_credential_and_cannot_be_replayed_or_altered(
    cluster: Cluster,
) -> None:
    key, other = cluster.a.api_key, cluster.a.other_key
    with _sandbox_row(cluster, "node-b", key_id(key)) as sid:
        cluster.relay_b.clear()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{cluster.a.url}/v1/sandboxes/{sid}", headers=_bearer(key)) as r:
                assert r.status == 404, (r.status, await r.text())  # B answered: it holds no VM
            async with http.get(f"{cluster.a.url}/e2b/sandboxes/{sid}", headers={"X-API-KEY": key}) as r:
                assert r.status == 404, (r.status, await r.text())
            envd = {"E2b-Sandbox-Id": sid, "X-Access-Token": ENVD_TOKEN}
            async with http.get(f"{cluster.a.url}/e2b/sandbox/files?path=/tmp/x", headers=envd) as r:
                assert r.status == 404, (r.status, await r.text())
            # a Kernel Gateway client's key in the URL (?token=, as Open WebUI sends it) is checked
            # at A and left out of the forwarded call's URL (the wire check below)
            async with http.get(f"{cluster.a.url}/api/kernels/{sid}?token={key}") as r:
                assert r.status != 401, (r.status, await r.text())

            seen = _forwarded(cluster, sid)
            assert len(seen) >= 4, [r.target for r in cluster.relay_b.requests()]
            wire = cluster.relay_b.sent()
            for req in seen:
                passed = [k for k, _ in req.headers if k.lower() in CREDENTIAL_HEADERS]
                assert not passed, f"{req.method} {req.target}: the peer got the client's {passed}"
            for secret in (key, cluster.secret):
                assert secret.encode() not in wire, "a client's key or the cluster secret crossed the wire"

            native = next(r for r in seen if r.target == f"/v1/sandboxes/{sid}")
            status, body = await _send(http, cluster.b.url, native)
            assert status == 401 and "replayed" in _message(body), (status, body)
            status, body = await _send(http, cluster.c.url, native)
            assert status == 401 and "signed for node 'node-b'" in _message(body), (status, body)
            status, body = await _send(http, cluster.b.url, native, **{"X-Kernelhost-Owner": key_id(other)})
            assert status == 401 and "signature" in _message(body), (status, body)
            status, body = await _send(http, cluster.b.url, native, target="/v1/sandboxes")
            assert status == 401 and "signature" in _message(body), (status, body)
            status, body = await _send(http, cluster.b.url, native, method="DELETE")
            assert status == 401 and "signature" in _message(body), (status, body)
            drain = {"target": "/v1/cluster/nodes/node-b/drain", "method": "POST", "X-Kernelhost-Owner": ""}
            status, body = await _send(http, cluster.b.url, native, **drain)
            assert status == 401 and "signature" in _message(body), (status, body)
    refused = [e for e in cluster.b.log_events("cluster.peer_call_refused") if e.get("remote")]
    assert len(refused) >= 5, refused


class _Listener:
    """Where an unregistered node row points: anything sent here is what the attacker gets."""

    def __init__(self) -> None:
        self.got: list[tuple[str, str, dict[str, str]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.got.append((request.method, request.path_qs, dict(request.headers)))
        await request.read()
        return web.json_response({"id": "sbx_from_attacker", "node": "node-x"}, status=201)


@contextlib.asynccontextmanager
async def _listener() -> AsyncIterator[tuple[_Listener, str]]:
    sink = _Listener()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", sink.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield sink, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def _node_row(cluster: Cluster, node_id: str, url: str) -> Iterator[None]:
    """A node row copied from node B's (its templates, its registration MAC), with the
    attacker's URL, the most room of all, and a fresh heartbeat."""
    with _store(cluster) as db:
        row = db.one("SELECT * FROM nodes WHERE id = 'node-b'")
        assert row is not None
        row.update(id=node_id, url=url, memory_mib=10**7, committed_mib=0, draining=0)
        row.pop("started_at", None)
        row.pop("heartbeat_at", None)
        cols, marks = ", ".join(row), ", ".join(f":{k}" for k in row)
        db.execute(
            f"INSERT INTO nodes ({cols}, started_at, heartbeat_at) VALUES ({marks}, {db.now}, {db.now})", row
        )
        try:
            yield
        finally:
            db.execute("DELETE FROM nodes WHERE id = ?", (node_id,))


def _beat(cluster: Cluster, node_id: str) -> None:
    with _store(cluster) as db:
        db.execute(f"UPDATE nodes SET heartbeat_at = {db.now} WHERE id = ?", (node_id,))


async def test_a_node_row_with_an_unregistered_url_gets_nothing(cluster: Cluster) -> None:
    key = cluster.a.api_key
    async with _listener() as (sink, url), aiohttp.ClientSession() as http:
        with _node_row(cluster, "node-x", url), _sandbox_row(cluster, "node-x", key_id(key)) as sid:
            _beat(cluster, "node-x")
            async with http.get(f"{cluster.a.url}/v1/sandboxes/{sid}", headers=_bearer(key)) as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "node_refused", (r.status, body)
                assert "not registered" in body["error"]["message"], body
            _beat(cluster, "node-x")
            async with http.post(
                f"{cluster.a.url}/v1/sandboxes", headers=_bearer(key), json={"template": "python"}
            ) as r:
                made = await r.json()
            try:
                assert r.status == 201 and made["node"] in ("node-a", "node-b", "node-c"), made
            finally:
                if r.status == 201 and made.get("node") != "node-x":
                    async with http.delete(
                        f"{cluster.a.url}/v1/sandboxes/{made['id']}", headers=_bearer(key)
                    ):
                        pass
        assert sink.got == [], f"calls went to a URL no node registered: {sink.got}"
    refused = cluster.a.log_events("cluster.node_refused")
    assert any(e.get("node") == "node-x" and e.get("url") == url for e in refused), refused


async def test_a_checkpoint_row_naming_files_elsewhere_deletes_nothing_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    key = cluster.a.api_key
    victim = tmp_path / "precious.txt"
    victim.write_text("not the node's to delete")
    cp_id = "cp_" + secrets.token_hex(8)
    pin = tmp_path / "pins" / cp_id
    pin.parent.mkdir()
    pin.write_text("nor this")
    row = {
        "id": cp_id,
        "sandbox_id": "sbx_" + secrets.token_hex(8),
        "owner": key_id(key),
        "created_at": time.time(),
        "template": "python",
        "image_key": "",
        "base": json.dumps({"path": str(tmp_path), "built_at": 0}),
        "path": str(victim),
        "keep": 1,
    }
    cols, marks = ", ".join(row), ", ".join(f":{k}" for k in row)
    with _store(cluster) as db:
        db.execute(f"INSERT INTO checkpoints ({cols}) VALUES ({marks})", row)
        try:
            async with aiohttp.ClientSession() as http:  # E2B's SDK deletes a snapshot by id
                async with http.delete(
                    f"{cluster.a.url}/e2b/templates/{cp_id}", headers={"X-API-KEY": key}
                ) as r:
                    assert r.status in (204, 500), (r.status, await r.text())
        finally:
            db.execute("DELETE FROM checkpoints WHERE id = ?", (cp_id,))
    assert victim.is_file(), "the node deleted a file outside its checkpoint_dir that a store row named"
    assert pin.is_file(), "the node deleted a pin outside its snapshot directory that a store row named"
    refused = [e for e in cluster.a.log_events("store.path_refused") if e.get("checkpoint_id") == cp_id]
    assert {e.get("what") for e in refused} == {"checkpoint file", "checkpoint base"}, refused
