"""Schema migrations between real nodes (docs/cluster.md, "Schema migrations"): ``kernelhost
serve`` processes on one real PostgreSQL, started at the same instant on an empty database, and
a node of the next release (tests/cluster/newer_node.py) beside nodes of this one.

The nodes boot no VM (no warm pool, no template snapshots, TCG without a probe): what is tested
is their start on a shared store, which takes a few seconds each.
"""

from __future__ import annotations

import json
import secrets
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelhost.api.auth import key_id
from kernelhost.sandboxes.states import SandboxState
from kernelhost.sandboxes.store import Store
from kernelhost.sandboxes.store.db import SCHEMA_LOCK, PostgreSQL
from kernelhost.sandboxes.store.migrations import MIGRATIONS
from tests.unit.test_store_backends import make_record

from ..harness import REPO, Service, cluster_node
from ..pg import PostgresServer
from .newer_node import ADDITIVE, BREAKING

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROUNDS = 5
LATEST = MIGRATIONS[-1].version


class Nodes:
    """Nodes made on demand, each with its own state and run directory; all stopped at the end."""

    def __init__(self, tmp: pytest.TempPathFactory, shared: Path) -> None:
        self.tmp, self.shared = tmp, shared
        self.secret = secrets.token_hex(16)
        self.operator = "operator-key-" + secrets.token_hex(12)
        self.key = "test-key-" + secrets.token_hex(12)  # every node's one client key
        self.made: list[Service] = []
        self.run_dirs: list[Path] = []

    def make(self, name: str, store_url: str, module: str = "kernelhost.cli", **env: str) -> Service:
        run_dir = Path(f"/run/kernelhost/migrate-{name}-{secrets.token_hex(3)}")
        run_dir.mkdir(mode=0o755, parents=True)
        self.run_dirs.append(run_dir)
        svc = cluster_node(
            self.tmp.mktemp(f"state-{name}"), run_dir, name, store_url, self.secret, 6.0, self.shared,
            KERNELHOST_API_KEYS=self.key, KERNELHOST_OPERATOR_KEYS=self.operator,
            KERNELHOST_SNAPSHOTS="off", KERNELHOST_ACCEL="tcg", **env,
        )  # fmt: skip
        svc.api_key = svc.other_key = self.key
        svc.module = module
        self.made.append(svc)
        return svc

    def close(self) -> list[str]:
        leaks: list[str] = []
        results = REPO / "results"
        results.mkdir(exist_ok=True)
        for svc in self.made:
            leaked, leaked_dirs = svc.cleanup()
            leaks += leaked + leaked_dirs
            shutil.copy(svc.log_path, results / f"migrate-{svc.env['KERNELHOST_NODE_ID']}-service.log")
        for run_dir in self.run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
        return leaks


@pytest.fixture
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    made = Nodes(tmp_path_factory, tmp_path_factory.mktemp("hibernated-shared"))
    try:
        yield made
    finally:
        leaks = made.close()
        assert not leaks, f"left behind: {leaks}"


def start_together(
    services: list[Service], gate: PostgreSQL | None = None, timeout: float = 60.0
) -> list[BaseException | None]:
    """Start every service at the same instant; each one's failure, or None. ``gate``: a
    connection holding the schema's lock, released once every service waits for it (they
    then reach the schema at the same moment, whatever their start's jitter)."""
    barrier = threading.Barrier(len(services), timeout=30)
    outcome: list[BaseException | None] = [None] * len(services)

    def start(i: int) -> None:
        barrier.wait()
        try:
            services[i].start(timeout=timeout)
        except BaseException as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(services))]
    for t in threads:
        t.start()
    if gate is not None:
        try:
            deadline = time.monotonic() + timeout
            while waiting_for_the_schema(gate) < len(services):
                assert time.monotonic() < deadline, "the nodes never waited for the schema's lock"
                time.sleep(0.1)
        finally:
            gate.execute("SELECT pg_advisory_unlock(?)", (SCHEMA_LOCK,))
    for t in threads:
        t.join()
    return outcome


def waiting_for_the_schema(db: PostgreSQL) -> int:
    """Connections waiting for the schema's advisory lock (its 64-bit key: two 32-bit halves)."""
    sql = (
        "SELECT COUNT(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND classid::bigint = ? AND objid::bigint = ?"
    )
    return int(db.scalar(sql, (SCHEMA_LOCK >> 32, SCHEMA_LOCK & 0xFFFFFFFF)))


def live_nodes(svc: Service, operator: str) -> list[str]:
    req = urllib.request.Request(
        svc.url + "/v1/cluster/nodes", headers={"Authorization": f"Bearer {operator}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return sorted(n["id"] for n in json.load(r)["nodes"] if n["alive"])


def schema_versions(url: str) -> list[int]:
    db = PostgreSQL(url)
    try:
        return [
            int(r["version"]) for r in db.execute("SELECT version FROM schema_migrations ORDER BY version")
        ]
    finally:
        db.close()


def test_three_nodes_started_at_once_on_an_empty_database_all_start(
    postgres: PostgresServer, nodes: Nodes
) -> None:
    """Five rounds: three nodes started at the same instant on a fresh, empty database (what a
    DaemonSet does; in every other round the test holds the schema's lock until all three wait
    for it, so their migrations surely meet); each round, all three answer and see each other,
    and each version is applied once."""
    for round_ in range(ROUNDS):
        url = postgres.new_database(f"migrate_at_once_{round_}")
        trio = [nodes.make(f"r{round_}-{n}", url) for n in "abc"]
        gate = None
        if round_ % 2 == 0:  # the schema's lock held until all three wait for it: they collide
            gate = PostgreSQL(url)
            gate.execute("SELECT pg_advisory_lock(?)", (SCHEMA_LOCK,))
        try:
            failures = start_together(trio, gate)
        finally:
            if gate is not None:
                gate.close()
        assert failures == [None, None, None], [str(f)[-2000:] for f in failures if f]
        assert live_nodes(trio[0], nodes.operator) == sorted(s.env["KERNELHOST_NODE_ID"] for s in trio)
        assert schema_versions(url) == [m.version for m in MIGRATIONS]
        migrated = [e for s in trio for e in s.log_events("schema.migrated")]
        assert len(migrated) == 1, migrated  # one node applied them; the others found them
        for svc in trio:
            svc.stop()


def test_a_node_of_the_next_schema_starts_beside_nodes_of_this_one(
    postgres: PostgresServer, nodes: Nodes
) -> None:
    """Nodes a and b run this release; c, the next one, adds an (additive) version: it starts
    beside them, a and b keep serving, and a restarted a starts on the newer schema and reads
    records with the new column. A version older nodes cannot read makes a restarted b refuse
    to start, naming both versions and the fix."""
    url = postgres.new_database("migrate_upgrade")
    a, b = nodes.make("up-a", url), nodes.make("up-b", url)
    assert start_together([a, b]) == [None, None]
    c = nodes.make("up-c", url, module="tests.cluster.newer_node", KH_TEST_NEXT_SCHEMA="additive")
    c.start(timeout=60)
    assert schema_versions(url) == [*(m.version for m in MIGRATIONS), ADDITIVE.version]
    assert c.log_events("schema.migrated")[0]["applied"] == [ADDITIVE.version]
    assert live_nodes(a, nodes.operator) == ["up-a", "up-b", "up-c"]

    # a record written on the newer schema (its column has the default): the older nodes read it
    db = PostgreSQL(url)
    try:
        rec = make_record(key_id(a.api_key), state=SandboxState.HIBERNATED)
        Store(db, "up-c").insert(rec)
        db.execute("UPDATE sandboxes SET note = ? WHERE id = ?", ("from the next release", rec.id))
    finally:
        db.close()
    a.stop()
    a.start(timeout=60)  # this release, restarted on the newer schema
    newer = a.log_events("schema.newer")
    assert newer and newer[-1]["version"] == ADDITIVE.version and newer[-1]["known"] == LATEST
    for svc in (a, b):
        req = urllib.request.Request(
            svc.url + "/v1/sandboxes", headers={"Authorization": f"Bearer {a.api_key}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert rec.id in [s["id"] for s in json.load(r)["sandboxes"]]

    # the release after: a version this one cannot read; a node of this release refuses it
    done = nodes.make("up-d", url, module="tests.cluster.newer_node", KH_TEST_NEXT_SCHEMA="breaking")
    done.start(timeout=60)
    assert schema_versions(url)[-1] == BREAKING.version
    b.stop()
    with pytest.raises(RuntimeError, match="kernelhost serve exited"):
        b.start(timeout=60)
    assert b.proc is not None and b.proc.returncode == 1
    said = b.log_path.read_text()
    assert f"has schema version {BREAKING.version}" in said
    assert f"knows schema versions up to {LATEST}" in said
    assert "upgrade kernelhost on this node" in said
