#!/usr/bin/env python3
"""Placement in a cluster's shared PostgreSQL store under load, in one run; writes
bench/results/cluster.json.

    .venv/bin/python bench/bench_cluster.py [--seconds 20] [--nodes 500] [--creators 64] [--quick]

A throwaway PostgreSQL server (tests/pg.py). ``--nodes`` simulated nodes heartbeat through
``NodeTable.heartbeat`` (each every 5 s, spread evenly, from a pool of threads), each filled to 7/8
of its VM memory with 512 MiB sandboxes. For ``--seconds``, ``--creators`` threads (each with its
own connection, as the nodes of a cluster have) place a 512 MiB sandbox for a random
key of 200 (``ClusterQuota.place``), insert its record on the chosen node, release the
reservation and delete the creator's oldest sandbox: the cluster stays near full, where a double
booking would show at once. Figures, printed as they are measured: placements/s, place() p50, p95
and p99, refusals (no node with room found), and the heartbeats' latency and lateness. Reference
in the same run: the same placements from one creator. After each phase every node must hold at
most its VM memory ("double booking: none"); otherwise the offending nodes are printed, exit 1.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine_facts, now_utc, report

from kernelhost.sandboxes.cluster import ClusterQuota, Figures, NodeTable
from kernelhost.sandboxes.errors import NodeFull
from kernelhost.sandboxes.registry import Quota, VmShape, new_record
from kernelhost.sandboxes.store.db import PostgreSQL
from kernelhost.sandboxes.store.sandboxes import Store
from tests.pg import running_postgres

NODE_MIB = 4096
PREFILL = 7  # 512 MiB sandboxes per node: 7/8 full
SANDBOX_MIB = 512  # the cluster stays as full as it starts: a refusal lost a race, it never was full
PERIOD = 5.0  # seconds between two heartbeats of a node
LEASE = 15.0
HEARTBEAT_THREADS = 8
OWNERS = [f"key_{i:03d}" for i in range(200)]
LIMIT = Quota(max_sandboxes=10**6, max_memory_mib=10**9)  # high enough never to refuse
TEMPLATES = {"python": "img_1"}


def pcts(samples: list[float]) -> dict[str, float]:
    s = sorted(samples) or [float("nan")]
    at = {q: s[min(len(s) - 1, round(q * (len(s) - 1)))] for q in (0.5, 0.95, 0.99)}
    return {"median": at[0.5], "p95": at[0.95], "p99": at[0.99], "max": s[-1], "n": len(samples)}


def report_ms(out: dict[str, Any], key: str, fig: dict[str, float], label: str) -> None:
    out[key] = fig
    print(
        f"  {label:44} p50 {fig['median'] * 1000:7.2f} ms  p95 {fig['p95'] * 1000:7.2f} ms  "
        f"p99 {fig['p99'] * 1000:7.2f} ms  n={fig['n']}",
        flush=True,
    )


class Heartbeats:
    """Every node heartbeats each PERIOD, node j at offset j/N of it; a thread beats every
    HEARTBEAT_THREADS-th node, on a connection of its own."""

    def __init__(self, url: str, node_ids: list[str]) -> None:
        self.ids = node_ids
        self.stop = threading.Event()
        self.latency: list[float] = []
        self.late: list[float] = []
        self.tables = [NodeTable(PostgreSQL(url), LEASE) for _ in range(HEARTBEAT_THREADS)]
        self.pool = ThreadPoolExecutor(HEARTBEAT_THREADS, thread_name_prefix="heartbeat")
        self.t0 = time.monotonic()
        self.futures = [self.pool.submit(self._beat, t) for t in range(HEARTBEAT_THREADS)]

    def _beat(self, t: int) -> None:
        table, n = self.tables[t], len(self.ids)
        figures = Figures(memory_mib=NODE_MIB, templates=TEMPLATES, accel="kvm")
        k = 0
        while True:
            for j in range(t, n, HEARTBEAT_THREADS):
                wait = self.t0 + (k + j / n) * PERIOD - time.monotonic()
                if wait > 0 and self.stop.wait(wait):
                    return
                self.late.append(max(0.0, -wait))
                t1 = time.perf_counter()
                table.heartbeat(self.ids[j], f"http://{self.ids[j]}:8000", figures)
                self.latency.append(time.perf_counter() - t1)
            k += 1

    def close(self) -> None:
        self.stop.set()
        for future in self.futures:
            future.result(timeout=60)  # a heartbeat that raised fails the run
        self.pool.shutdown()
        for table in self.tables:
            table.db.close()


class Creator:
    """One thread placing sandboxes, on a connection of its own."""

    def __init__(self, url: str, seed: int) -> None:
        self.db = PostgreSQL(url)
        self.quota = ClusterQuota(self.db, NodeTable(self.db, LEASE), "bench", LIMIT, hold_seconds=60)
        # A node's store is bound to itself; this thread writes for whichever node a placement
        # chose, so it points its one Store at that node before each insert.
        self.store = Store(self.db)
        self.rng = random.Random(seed)
        self.mine: deque[str] = deque()  # its sandboxes, oldest first
        self.latency: list[float] = []
        self.refused = 0

    def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            owner, mib = self.rng.choice(OWNERS), SANDBOX_MIB
            t1 = time.perf_counter()
            try:
                placed = self.quota.place(owner, "python", 1, mib)
            except NodeFull:
                self.refused += 1
            else:
                self.latency.append(time.perf_counter() - t1)
                rec = new_record(
                    owner=owner, template="python", domain=f"kh-{self.rng.getrandbits(64):016x}",
                    image_key="img_1", shape=VmShape(mib, 1, "kvm"), idle_timeout=600, metadata={},
                    network={"mode": "none", "allow": []},
                )  # fmt: skip
                self.store.node = placed.node.id
                self.store.insert(rec)
                self.quota.release(placed.reservation)
                self.mine.append(rec.id)
            if self.mine:
                self.store.delete(self.mine.popleft())


def prefill(db: PostgreSQL, node_ids: list[str], creators: list[Creator], rng: random.Random) -> None:
    """Empty the sandboxes and reservations, then fill every node to 7/8 with 512 MiB sandboxes,
    dealt to the creators in a random order (what each deletes first: no node empties first)."""
    db.execute("DELETE FROM sandboxes")
    db.execute("DELETE FROM reservations")
    store = Store(db)
    made: list[str] = []
    with db.transaction():
        for node in node_ids:
            store.node = node
            for _ in range(PREFILL):
                rec = new_record(
                    owner=rng.choice(OWNERS), template="python", domain=f"kh-{rng.getrandbits(64):016x}",
                    image_key="img_1", shape=VmShape(SANDBOX_MIB, 1, "kvm"), idle_timeout=600, metadata={},
                    network={"mode": "none", "allow": []},
                )  # fmt: skip
                store.insert(rec)
                made.append(rec.id)
    rng.shuffle(made)
    for i, sid in enumerate(made):
        creators[i % len(creators)].mine.append(sid)
    db.execute("ANALYZE")


def overbooked(db: PostgreSQL) -> list[dict[str, Any]]:
    return db.execute(
        "SELECT n.id, n.memory_mib, SUM(s.memory_mib) AS used FROM nodes n JOIN sandboxes s "
        "ON s.node = n.id GROUP BY n.id, n.memory_mib HAVING SUM(s.memory_mib) > n.memory_mib ORDER BY n.id"
    )


def phase(
    url: str, db: PostgreSQL, node_ids: list[str], n: int, seconds: float, out: dict[str, Any], name: str
) -> bool:
    """``n`` creators for ``seconds``; False if a node ended up overbooked."""
    creators = [Creator(url, seed=1000 + i) for i in range(n)]
    try:
        prefill(db, node_ids, creators, random.Random(7))
        print(f"{name}: {n} creator{'s' if n > 1 else ''}, {seconds:g} s", flush=True)
        deadline = time.monotonic() + seconds
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n, thread_name_prefix="creator") as pool:
            for future in [pool.submit(c.run, deadline) for c in creators]:
                future.result(timeout=seconds + 120)
        took = time.perf_counter() - t0
    finally:
        for c in creators:
            c.db.close()
    latency = [x for c in creators for x in c.latency]
    refused = sum(c.refused for c in creators)
    res: dict[str, Any] = {"creators": n}
    out[name] = res
    report(res, "placements_per_s", round(len(latency) / took, 1), "placements/s")
    report_ms(res, "place", pcts(latency), "place() latency")
    report(res, "refused", refused, "refused (no node with room found)")
    bad = overbooked(db)
    res["overbooked"] = [{k: int(v) if k != "id" else v for k, v in r.items()} for r in bad]
    if bad:
        print("  double booking: " + ", ".join(f"{r['id']} {r['used']}/{r['memory_mib']} MiB" for r in bad))
    else:
        print("  double booking: none", flush=True)
    return not bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="each phase's length (default 20)")
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--creators", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="5 s phases")
    args = ap.parse_args()
    seconds = 5.0 if args.quick else args.seconds
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts(), "nodes": args.nodes}
    node_ids = [f"node-{i:03d}" for i in range(args.nodes)]
    ok = True
    with running_postgres() as pg:
        db = PostgreSQL(pg.url)
        Store(db)
        table = NodeTable(db, LEASE)
        for node in node_ids:
            table.heartbeat(node, f"http://{node}:8000", Figures(NODE_MIB, templates=TEMPLATES), fresh=True)
        beats = Heartbeats(pg.url, node_ids)
        try:
            ok &= phase(pg.url, db, node_ids, 1, seconds, out, "reference, one creator")
            ok &= phase(pg.url, db, node_ids, args.creators, seconds, out, "concurrent")
        finally:
            beats.close()
        one = out["reference, one creator"]["placements_per_s"]
        many = out["concurrent"]["placements_per_s"]
        print("heartbeats", flush=True)
        report_ms(out, "heartbeat", pcts(beats.latency), "NodeTable.heartbeat latency")
        report_ms(out, "heartbeat_late", pcts(beats.late), "heartbeat behind its schedule")
        dead = len(table.all()) - len(table.live())
        report(out, "nodes_dead_at_end", dead, "nodes past their lease at the end")
        gain = round(many / one, 2) if one else None
        report(out, "concurrency_gain", gain, f"placements/s, {args.creators} creators / 1 creator")
        db.close()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cluster.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
