#!/usr/bin/env python3
"""What forwarding costs in a cluster, in one run; writes bench/results/cluster_forward.json.

    .venv/bin/python bench/bench_cluster_forward.py [--rounds 40] [--quick]

A real PostgreSQL (tests/pg.py) and two real nodes, A and B, on this machine. One sandbox
placed on B. ``1+1`` executes, interleaved: through A (forwarded to B) and straight to B (the
reference, same run), medians and p95; the difference is what a forward adds on loopback. The
forward alone: ``GET /v1/sandboxes/{id}`` (answered without the VM) through A and straight to
B, ten times the rounds. Then
B is killed (service and VMs) and the time until A answers 410 for its sandbox is measured
(the lease is 6 s here; the default is 15).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, RESULTS, Service, machine_facts, now_utc, report, summary

from tests.harness import cluster_node
from tests.pg import running_postgres

LEASE = 6.0


def _node(name: str, url: str, secret: str, key: str, shared: Path) -> Service:
    state = Path(f"/tmp/kh-bench-cluster-{name}-{secrets.token_hex(3)}")
    state.mkdir(mode=0o700)
    run_dir = Path(f"/run/kernelhost/bench-{name}-{secrets.token_hex(3)}")
    run_dir.mkdir(mode=0o755, parents=True)
    svc = cluster_node(state, run_dir, name, url, secret, LEASE, shared, KERNELHOST_API_KEYS=key)
    svc.api_key = key
    return svc


async def _one_plus_one(http: aiohttp.ClientSession, base: str, key: str, sid: str) -> float:
    t0 = time.perf_counter()
    url = f"{base}/v1/sandboxes/{sid}/execute"
    async with http.post(url, headers={"Authorization": f"Bearer {key}"}, json={"code": "1+1"}) as r:
        body = await r.read()
    assert r.status == 200 and b'"2"' in body, body
    return time.perf_counter() - t0


async def measure(a: Service, b: Service, rounds: int, out: dict[str, Any]) -> None:
    auth = {"Authorization": f"Bearer {a.api_key}"}
    async with aiohttp.ClientSession() as http:
        sid = ""
        for _ in range(4):  # placement spreads: the second create lands on the other node
            async with http.post(a.url + "/v1/sandboxes", headers=auth, json={"template": "python"}) as r:
                made = await r.json()
            if made.get("node") == "node-b":
                sid = made["id"]
                break
        assert sid, "no sandbox was placed on node B"
        for _ in range(3):  # warm both paths
            await _one_plus_one(http, a.url, a.api_key, sid)
            await _one_plus_one(http, b.url, a.api_key, sid)
        via_a, direct = [], []
        for _ in range(rounds):
            via_a.append(await _one_plus_one(http, a.url, a.api_key, sid))
            direct.append(await _one_plus_one(http, b.url, a.api_key, sid))
        fa, fb = summary(via_a), summary(direct)
        report(out, "forwarded_1plus1", fa, "1+1 through A (forwarded to B)")
        report(out, "direct_1plus1", fb, "1+1 straight to B (reference)")
        added = (fa["median"] - fb["median"]) * 1000
        report(out, "forward_added_ms", round(added, 2), "what a forward adds to 1+1, median (ms)")
        # the forward alone: a call the node answers without its VM, 10x the rounds
        get_a: list[float] = []
        get_b: list[float] = []
        for _ in range(rounds * 10):
            for base, into in ((a.url, get_a), (b.url, get_b)):
                t0 = time.perf_counter()
                async with http.get(f"{base}/v1/sandboxes/{sid}", headers=auth) as r:
                    await r.read()
                into.append(time.perf_counter() - t0)
        ga, gb = summary(get_a), summary(get_b)
        report(out, "forwarded_get", ga, "GET the sandbox through A (forwarded)")
        report(out, "direct_get", gb, "GET the sandbox straight from B (reference)")
        alone = round((ga["median"] - gb["median"]) * 1000, 2)
        report(out, "forward_alone_ms", alone, "a forward alone, median (ms)")
        b.kill()
        t0 = time.monotonic()
        while time.monotonic() - t0 < LEASE * 4:
            async with http.get(f"{a.url}/v1/sandboxes/{sid}", headers=auth) as r:
                if r.status == 410:
                    break
            await asyncio.sleep(0.05)
        report(out, "death_to_410_s", round(time.monotonic() - t0, 2), f"node death to 410 (lease {LEASE} s)")
        async with http.get(a.url + "/v1/sandboxes", headers=auth) as r:
            for s in (await r.json())["sandboxes"]:
                if s.get("node") == "node-a":
                    await http.delete(f"{a.url}/v1/sandboxes/{s['id']}", headers=auth)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="10 rounds")
    args = parser.parse_args()
    rounds = 10 if args.quick else args.rounds
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts(), "rounds": rounds}
    shared = Path(f"/tmp/kh-bench-hibernated-{secrets.token_hex(3)}")
    shared.mkdir()
    with running_postgres() as pg:
        url = pg.new_database("bench_forward")
        secret, key = secrets.token_hex(16), "bench-key-" + secrets.token_hex(12)
        nodes = [_node(n, url, secret, key, shared) for n in ("node-a", "node-b")]
        try:
            for svc in nodes:
                svc.start(timeout=180)
            asyncio.run(measure(nodes[0], nodes[1], rounds, out))
        finally:
            for svc in nodes:
                svc.cleanup()
                shutil.rmtree(svc.state_dir, ignore_errors=True)
                shutil.rmtree(svc.run_dir, ignore_errors=True)
            shutil.rmtree(shared, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cluster_forward.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {(RESULTS / 'cluster_forward.json').relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
