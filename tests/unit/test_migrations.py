"""The store's versioned schema (store/migrations.py) on SQLite and PostgreSQL: a fresh database,
one an earlier release made (adopted), a schema a newer kernelhost migrated (additive: this node
runs; incompatible: it refuses), and nodes migrating at the same instant, from threads with a
connection each and from processes running ``kernelhost migrate``."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernelhost.sandboxes.cluster import Figures, NodeTable
from kernelhost.sandboxes.states import SandboxState
from kernelhost.sandboxes.store import (
    CheckpointStore,
    Database,
    Migration,
    Outcome,
    SchemaTooNew,
    Store,
    TemplateStore,
    migrate,
)
from kernelhost.sandboxes.store.db import SQLite
from kernelhost.sandboxes.store.migrations import MIGRATIONS
from kernelhost.sandboxes.store.schema import NODES, TABLES
from tests.unit.test_store_backends import OLD_SANDBOXES, connect_again, make_record

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LATEST = MIGRATIONS[-1].version


def add_note(db: Database) -> None:
    """What a newer release might add: a column with a default on two tables, and a table."""
    db.add_columns("sandboxes", {"note": "TEXT NOT NULL DEFAULT ''"})
    db.add_columns("nodes", {"zone": "TEXT NOT NULL DEFAULT ''"})
    db.script("CREATE TABLE IF NOT EXISTS notes (id TEXT PRIMARY KEY, body TEXT NOT NULL)")


ADDITIVE = Migration(LATEST + 1, "sandbox notes", add_note, MIGRATIONS[-1].min_compatible)
BREAKING = Migration(LATEST + 2, "a change older nodes cannot read", lambda db: None, LATEST + 2)


def versions(db: Database) -> list[int]:
    return [int(r["version"]) for r in db.execute("SELECT version FROM schema_migrations ORDER BY version")]


def test_a_fresh_database_gets_every_version_once(db: Database) -> None:
    assert migrate(db, dry_run=True).pending == [m.version for m in MIGRATIONS]
    assert not db.columns("schema_migrations")  # a dry run changes nothing
    first = migrate(db)
    assert first.applied == [m.version for m in MIGRATIONS] and not first.adopted
    assert (first.version, first.known) == (LATEST, LATEST)
    assert all(db.columns(table) for table in TABLES)
    assert migrate(db) == Outcome(LATEST, LATEST, 1)  # nothing left to apply
    assert versions(db) == [m.version for m in MIGRATIONS]
    store = Store(db, "n1")  # the stores find the schema made
    store.insert(make_record("key_a"))
    assert len(store.of_owner("key_a")) == 1 and db.schema_version == LATEST


def test_a_database_of_an_earlier_release_is_adopted(db: Database) -> None:
    """Tables made by ``CREATE TABLE IF NOT EXISTS`` before versions existed (an older sandboxes
    table, a nodes table without ``url_mac``), and no ``schema_migrations``: version 1 brings
    them to today's columns and is recorded; the rows stay."""
    db.script(OLD_SANDBOXES)
    db.script(NODES.replace(",\n    url_mac TEXT NOT NULL DEFAULT ''", ""))
    assert "url_mac" not in db.columns("nodes")
    db.execute(
        "INSERT INTO sandboxes (id, owner, template, domain, state, created_at, last_active_at, "
        "idle_timeout_seconds, memory_mib, vcpus, accel, image_key) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ("sbx_0", "key_a", "python", "kh-0", "hibernated", 1.5, 2.5, 600, 512, 1, "kvm", "img"),
    )
    outcome = migrate(db)
    assert outcome.adopted and outcome.applied[0] == 1
    assert {"network", "node", "access_tokens", "wake_on_call"} <= db.columns("sandboxes")
    assert "url_mac" in db.columns("nodes") and db.columns("checkpoints")
    got = Store(db).get("sbx_0")
    assert got is not None and got.state == SandboxState.HIBERNATED and got.network["mode"] == "none"
    assert versions(db) == [m.version for m in MIGRATIONS]


def test_a_newer_additive_schema_runs_beside_this_release(db: Database) -> None:
    """A node of the next release added a column and a table: this node starts and its stores
    read and write as before (they ignore the column)."""
    newer = migrate(db, [*MIGRATIONS, ADDITIVE])
    assert newer.applied[-1] == ADDITIVE.version
    here = connect_again(db)
    try:
        outcome = migrate(here)
        assert (outcome.applied, outcome.version, outcome.known) == ([], ADDITIVE.version, LATEST)
        store = Store(here, "n1")
        rec = make_record("key_a")
        store.insert(rec)
        assert store.get(rec.id) == rec and store.of_owner("key_a") == [rec]
        nodes = NodeTable(here, lease_seconds=30)
        nodes.heartbeat("n1", "http://n1:8000", Figures(memory_mib=1024), fresh=True)
        node = nodes.get("n1")
        assert node is not None and node.alive
        CheckpointStore(here).all()
        TemplateStore(here).all()
    finally:
        here.close()
    assert db.one("SELECT note FROM sandboxes") == {"note": ""}  # the newer node's default


def test_a_schema_this_release_cannot_read_is_refused(db: Database) -> None:
    migrate(db, [*MIGRATIONS, ADDITIVE, BREAKING])
    here = connect_again(db)
    try:
        with pytest.raises(SchemaTooNew) as exc:
            Store(here, "n1")
    finally:
        here.close()
    message = str(exc.value)
    assert f"schema version {BREAKING.version}" in message  # the database's
    assert f"up to {LATEST}" in message  # this node's
    assert "upgrade kernelhost on this node" in message
    assert versions(db)[-1] == BREAKING.version  # and nothing was touched


def test_nodes_migrating_at_the_same_instant_all_succeed(db: Database) -> None:
    """Eight connections (eight nodes starting together) migrate one empty database: each waits
    for the schema's lock; one applies every version, the others find them applied."""
    conns = [connect_again(db) for _ in range(8)]
    barrier = threading.Barrier(len(conns), timeout=30)

    def start(conn: Database) -> Outcome:
        barrier.wait()
        Store(conn, "n")  # what a node's start does
        NodeTable(conn, lease_seconds=30)
        return migrate(conn)

    try:
        with ThreadPoolExecutor(len(conns)) as pool:
            outcomes = list(pool.map(start, conns))
        assert all(conn.schema_version == LATEST for conn in conns)
    finally:
        for conn in conns:
            conn.close()
    assert all(o.version == LATEST for o in outcomes)
    assert versions(db) == [m.version for m in MIGRATIONS]  # each once


def test_kernelhost_migrate_from_processes_at_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    command = [sys.executable, "-m", "kernelhost.cli", "migrate", "--store-url", url]
    procs = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]  # fmt: skip
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outputs
    printed = "".join(out for out, _ in outputs)
    assert printed.count("applied ") == len(MIGRATIONS), printed  # by one of them
    assert printed.count("nothing to apply") == 3
    assert printed.count(f"schema version {LATEST} (this kernelhost knows up to {LATEST})") == 4


def test_kernelhost_migrate_names_a_schema_too_new(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    db = SQLite(path)
    migrate(db, [*MIGRATIONS, ADDITIVE, BREAKING])
    db.close()
    command = [sys.executable, "-m", "kernelhost.cli", "migrate", "--store-url", f"sqlite:///{path}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"schema version {BREAKING.version}" in done.stderr and "upgrade kernelhost" in done.stderr
