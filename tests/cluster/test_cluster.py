"""A cluster of three nodes on one PostgreSQL, driven only through node A (docs/cluster.md).

The tests run in order and share the cluster: sandboxes land on every node; a streaming execute,
a 50 MB upload and download and a Kernel Gateway WebSocket reach node C's sandbox through A;
20 concurrent creates against a limit of 5 yield exactly 5; node C dies (service and VMs): its
running sandbox answers 410 within the lease, its key's quota is freed, creates go on, and its
hibernated sandbox wakes on another node with its variables; a drained node takes no new sandbox.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import aiohttp
import pytest

from .conftest import LEASE, LIMIT, Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

KEEP: dict[str, str] = {}  # node id -> a sandbox of the main key on it (shared by the tests)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _call(
    http: aiohttp.ClientSession, cl: Cluster, method: str, path: str, *, key: str = "", **kw: Any
) -> tuple[int, Any]:
    async with http.request(method, cl.a.url + path, headers=_auth(key or cl.a.api_key), **kw) as r:
        body = await r.read()
        return r.status, (json.loads(body) if body and r.content_type == "application/json" else body)


async def _create(http: aiohttp.ClientSession, cl: Cluster, key: str = "") -> dict[str, Any]:
    status, body = await _call(http, cl, "POST", "/v1/sandboxes", key=key, json={"template": "python"})
    assert status == 201, body
    return dict(body)


async def _execute(http: aiohttp.ClientSession, cl: Cluster, sid: str, code: str) -> list[dict[str, Any]]:
    events = []
    url = f"{cl.a.url}/v1/sandboxes/{sid}/execute"
    async with http.post(url, headers=_auth(cl.a.api_key), json={"code": code}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.strip():
                events.append(json.loads(line))
    return events


def _stdout(events: list[dict[str, Any]]) -> str:
    return "".join(e["text"] for e in events if e["type"] == "stdout")


async def test_nodes_and_placement(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as http:
        status, body = await _call(http, cluster, "GET", "/v1/cluster/nodes", key=cluster.operator_key)
        assert status == 200, body
        alive = {n["id"]: n["alive"] for n in body["nodes"]}
        assert alive == {"node-a": True, "node-b": True, "node-c": True}
        status, body = await _call(http, cluster, "GET", "/v1/cluster/nodes")
        assert status == 403, "a client key is not an operator key"
        made = [await _create(http, cluster) for _ in range(3)]
        assert sorted(s["node"] for s in made) == ["node-a", "node-b", "node-c"], made
        KEEP.update({s["node"]: s["id"] for s in made})
        status, listed = await _call(http, cluster, "GET", "/v1/sandboxes")
        assert {s["id"] for s in listed["sandboxes"]} >= set(KEEP.values())


async def test_streaming_execute_reaches_node_c_through_a(cluster: Cluster) -> None:
    sid = KEEP["node-c"]
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        arrivals: list[float] = []
        url = f"{cluster.a.url}/v1/sandboxes/{sid}/execute"
        code = "import time\nfor i in range(5):\n    print(i, flush=True)\n    time.sleep(0.3)\nx = 41"
        events = []
        async with http.post(url, headers=_auth(cluster.a.api_key), json={"code": code}) as r:
            async for line in r.content:
                if line.strip():
                    events.append(json.loads(line))
                    arrivals.append(time.monotonic() - t0)
        assert _stdout(events) == "".join(f"{i}\n" for i in range(5))
        assert events[-1]["type"] == "end" and events[-1]["status"] == "ok"
        firsts = [t for t, e in zip(arrivals, events, strict=True) if e["type"] == "stdout"]
        assert firsts[-1] - firsts[0] > 0.6, f"output arrived all at once, not streamed: {firsts}"
        answer = await _execute(http, cluster, sid, "x + 1")
        assert [e["data"]["text/plain"] for e in answer if e["type"] == "result"] == ["42"]
        status, got = await _call(http, cluster, "GET", f"/v1/sandboxes/{sid}")
        assert status == 200 and got["node"] == "node-c"


async def test_50_mb_upload_and_download_through_a(cluster: Cluster) -> None:
    sid = KEEP["node-c"]
    payload = os.urandom(50 * 1024 * 1024)
    want = hashlib.sha256(payload).hexdigest()
    async with aiohttp.ClientSession() as http:
        status, body = await _call(
            http, cluster, "PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/big.bin", data=io.BytesIO(payload)
        )
        assert status == 201, body
        code = "import hashlib; print(hashlib.sha256(open('/tmp/big.bin', 'rb').read()).hexdigest())"
        inside = await _execute(http, cluster, sid, code)
        assert _stdout(inside).strip() == want
        digest = hashlib.sha256()
        url = f"{cluster.a.url}/v1/sandboxes/{sid}/files?path=/tmp/big.bin"
        async with http.get(url, headers=_auth(cluster.a.api_key)) as r:
            assert r.status == 200
            async for chunk in r.content.iter_chunked(1 << 20):
                digest.update(chunk)
        assert digest.hexdigest() == want


async def test_gateway_websocket_reaches_node_c_through_a(cluster: Cluster) -> None:
    sid = KEEP["node-c"]
    ws_url = cluster.a.url.replace("http://", "ws://") + f"/api/kernels/{sid}/channels"
    msg_id = uuid.uuid4().hex
    request = {
        "header": {
            "msg_id": msg_id,
            "msg_type": "execute_request",
            "session": "cluster-test",
            "username": "",
            "version": "5.3",
            "date": "",
        },
        "parent_header": {},
        "metadata": {},
        "content": {"code": "print('via', x + 1)", "silent": False},
        "channel": "shell",
    }
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(ws_url, headers=_auth(cluster.a.api_key)) as ws:
            await ws.send_str(json.dumps(request))
            seen, status = "", None
            deadline = time.monotonic() + 60
            while status is None and time.monotonic() < deadline:
                msg = await ws.receive(timeout=60)
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                frame = json.loads(msg.data)
                if frame.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                if frame["msg_type"] == "stream":
                    seen += frame["content"]["text"]
                elif frame["msg_type"] == "execute_reply":
                    status = frame["content"]["status"]
        assert status == "ok" and seen == "via 42\n"


async def test_concurrent_creates_never_pass_the_key_limit(cluster: Cluster) -> None:
    key = cluster.a.other_key
    async with aiohttp.ClientSession() as http:

        async def one() -> tuple[int, Any]:
            return await _call(http, cluster, "POST", "/v1/sandboxes", key=key, json={"template": "python"})

        answers = await asyncio.gather(*(one() for _ in range(20)))
        made = [b for s, b in answers if s == 201]
        refused = [b for s, b in answers if s != 201]
        try:
            assert len(made) == LIMIT, answers
            assert all(b["error"]["limit"] == "max_sandboxes_per_key" for b in refused), refused
            assert len({s["node"] for s in made}) > 1, "the creates were not spread over the nodes"
        finally:
            for s in made:
                await _call(http, cluster, "DELETE", f"/v1/sandboxes/{s['id']}", key=key)


def test_an_unmodified_e2b_program_runs_on_another_node_through_a(cluster: Cluster) -> None:
    """E2B's SDK pointed at node A only; its sandbox is placed on node B or C, so every
    lifecycle, envd and code-interpreter call of the program crosses from A to that node."""
    from ..clients.agents import test_e2b as e2b_tests

    async def fill_a() -> dict[str, Any]:
        async with aiohttp.ClientSession() as http:  # a fork's child stays on its parent's node
            path = f"/v1/sandboxes/{KEEP['node-a']}/fork"
            status, body = await _call(http, cluster, "POST", path, json={"n": 1})
            assert status == 201, body
            return dict(body["sandboxes"][0])

    extra = asyncio.run(fill_a())  # node A now holds the most: the E2B sandbox goes to B or C
    try:
        assert extra["node"] == "node-a", extra
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
        env.update(
            E2B_API_URL=f"{cluster.a.url}/e2b",
            E2B_SANDBOX_URL=f"{cluster.a.url}/e2b/sandbox",
            E2B_API_KEY=cluster.a.other_key,
        )
        done = subprocess.run(
            [sys.executable, str(e2b_tests.HERE / "e2b_program.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        assert seen["text"] == "42" and seen["stdout"] == ["hello\n"], seen
        assert seen["read"] == "written by E2B code" and seen["exit_code"] == 0, seen
        made_elsewhere = [
            json.loads(line)
            for svc in (cluster.b, cluster.c)
            for line in svc.log_path.read_text().splitlines()
            if seen["id"] in line and '"sandbox.created"' in line
        ]
        on_a = [line for line in cluster.a.log_path.read_text().splitlines() if seen["id"] in line]
        assert made_elsewhere and made_elsewhere[0].get("peer") == "node-a", (seen["id"], on_a[:5])
    finally:

        async def drop() -> None:
            async with aiohttp.ClientSession() as http:
                await _call(http, cluster, "DELETE", f"/v1/sandboxes/{extra['id']}")

        asyncio.run(drop())


async def test_an_e2b_call_for_node_cs_sandbox_is_checked_at_a(cluster: Cluster) -> None:
    """Node A checks an in-sandbox call's access token against the shared record before it
    forwards it (issue 35): without one, node C's sandbox is the same 404 as an unknown id, its
    kernel untouched; with the token connect gave (through A, made by C), the call goes through."""
    sid = KEEP["node-c"]
    url = cluster.a.url
    async with aiohttp.ClientSession() as http:
        await _execute(http, cluster, sid, "kept_on_c = 'yes'")
        r = await http.post(f"{url}/e2b/sandboxes/{sid}/connect", headers={"X-API-KEY": cluster.a.api_key})
        token = (await r.json())["envdAccessToken"]
        seen = set()
        for headers in (
            {"E2b-Sandbox-Id": sid},
            {"E2b-Sandbox-Id": sid, "X-Access-Token": "kh_sbx_forged"},
            {"E2b-Sandbox-Id": "sbx_00000000deadbeef", "X-Access-Token": token},
        ):
            async with http.post(f"{url}/e2b/sandbox/contexts/python/restart", headers=headers) as r:
                seen.add((r.status, await r.read()))
        assert len(seen) == 1 and next(iter(seen))[0] == 404, seen
        traffic = {"E2b-Sandbox-Id": sid, "E2B-Traffic-Access-Token": token}
        async with http.get(f"{url}/e2b/sandbox/contexts", headers=traffic) as r:
            assert r.status == 200, await r.text()
        answer = await _execute(http, cluster, sid, "kept_on_c")  # never restarted
        assert [e["data"]["text/plain"] for e in answer if e["type"] == "result"] == ["'yes'"]


async def test_a_dead_node(cluster: Cluster) -> None:
    """Node C dies: its running sandbox answers 410 within the lease and leaves the quota, a
    create still works, and its hibernated sandbox wakes with its state on the live node with the
    most room (placed like a create, whichever node the call reached)."""
    async with aiohttp.ClientSession() as http:
        hib = KEEP["node-c"]  # x == 41 in it
        status, body = await _call(http, cluster, "POST", f"/v1/sandboxes/{hib}/fork", json={"n": 1})
        assert status == 201, body
        running = body["sandboxes"][0]
        assert running["node"] == "node-c", "a fork's child goes to its parent's node"
        KEEP["lost"] = running["id"]
        status, body = await _call(http, cluster, "POST", f"/v1/sandboxes/{hib}/hibernate")
        assert status == 200 and body["state"] == "hibernated", body
        fifth = await _create(http, cluster)  # the key now holds its limit of 5
        status, body = await _call(http, cluster, "POST", "/v1/sandboxes", json={"template": "python"})
        assert status == 429, body
        cluster.c.kill()
        t0 = time.monotonic()
        while True:
            status, body = await _call(http, cluster, "GET", f"/v1/sandboxes/{running['id']}")
            if status == 410 or time.monotonic() - t0 > LEASE * 3:
                break
            await asyncio.sleep(0.25)
        assert status == 410, body
        assert "the host of this sandbox failed; its state is lost" in body["error"]["message"]
        assert time.monotonic() - t0 <= LEASE * 2
        replacement = await _create(http, cluster)  # C's running child left the quota
        assert replacement["node"] in ("node-a", "node-b")
        _, listed = await _call(http, cluster, "GET", "/v1/sandboxes")
        running = {n: 0 for n in ("node-a", "node-b")}
        for s in listed["sandboxes"]:
            if s["state"] == "running" and s.get("node") in running:
                running[s["node"]] += 1
        roomiest = {n for n, k in running.items() if k == min(running.values())}
        woken = await _execute(http, cluster, hib, "x + 1")
        assert [e["data"]["text/plain"] for e in woken if e["type"] == "result"] == ["42"], woken
        status, body = await _call(http, cluster, "GET", f"/v1/sandboxes/{hib}")
        assert body["node"] in roomiest and body["state"] == "running", (body, running)
        for sid in (fifth["id"], replacement["id"]):
            await _call(http, cluster, "DELETE", f"/v1/sandboxes/{sid}")


def _cli(cluster: Cluster, *args: str) -> str:
    """``kernelhost ...`` with node A's settings, as an operator runs it on that node."""
    done = subprocess.run(
        [sys.executable, "-m", "kernelhost.cli", *args],
        env=cluster.a.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_a_drained_node_takes_no_new_sandbox(cluster: Cluster) -> None:
    async with aiohttp.ClientSession() as http:
        _, listed = await _call(http, cluster, "GET", "/v1/sandboxes")
    # KEEP["node-b"], and the dead node's sandbox if it woke here (node B had the most room)
    on_b = [s["id"] for s in listed["sandboxes"] if s.get("node") == "node-b" and s["state"] == "running"]
    assert KEEP["node-b"] in on_b, listed
    drained = await asyncio.to_thread(_cli, cluster, "node", "drain", "--node", "node-b")
    assert f"node node-b drains: {len(on_b)} sandboxes hibernated" in drained, (drained, on_b)
    listed = await asyncio.to_thread(_cli, cluster, "nodes")
    states = {line.split()[0]: line.split()[1] for line in listed.splitlines()[1:]}
    assert states == {"node-a": "alive", "node-b": "draining", "node-c": "dead"}, listed
    async with aiohttp.ClientSession() as http:
        status, body = await _call(http, cluster, "GET", f"/v1/sandboxes/{KEEP['node-b']}")
        assert status == 200 and body["state"] == "hibernated", body
        made = await _create(http, cluster)
        assert made["node"] == "node-a", made
        woken = await _execute(http, cluster, KEEP["node-b"], "print('moved')")
        assert _stdout(woken) == "moved\n"
        status, body = await _call(http, cluster, "GET", f"/v1/sandboxes/{KEEP['node-b']}")
        assert status == 200 and body["node"] == "node-a", body
        await _call(http, cluster, "DELETE", f"/v1/sandboxes/{made['id']}")


async def test_a_node_back_after_its_lease_gives_up_what_the_cluster_gave_up(cluster: Cluster) -> None:
    """Node C restarts long after its lease: the sandbox that answered 410 is gone for good, and
    C destroyed what was left of it; C takes new sandboxes again."""
    cluster.c.start(timeout=180)
    async with aiohttp.ClientSession() as http:
        status, body = await _call(http, cluster, "GET", "/v1/cluster/nodes", key=cluster.operator_key)
        assert {n["id"]: n["alive"] for n in body["nodes"]}["node-c"] is True, body
        status, body = await _call(http, cluster, "GET", f"/v1/sandboxes/{KEEP['lost']}")
        assert status == 404, body
    hv = cluster.c.hypervisor()
    try:
        assert [d.name for d in hv.domains()] == []
    finally:
        hv.close()
