"""Sandbox records, in the service's database (``db.py``: SQLite by default, PostgreSQL for a
cluster), and the cluster's queries on them (what a key or a node holds, a take-over).

Calls are short single-row statements; they run inline on the event loop (sub-millisecond on
SQLite, a round trip on PostgreSQL). In a shared (PostgreSQL) database every record names the
``node`` whose VM it is, and a node's ``all()`` is its own records.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...config import Settings
from ..states import SandboxState
from .db import Database, SQLite, open_database
from .migrations import ensure_schema, known_columns

JSON_FIELDS = ("metadata", "network", "access_tokens")


_HIBERNATED = SandboxState.HIBERNATED.value  # a hibernated sandbox holds no VM memory

# The cluster's counts over this table (cluster/quota.py), as subqueries: the quota puts them in
# one statement with its reservations, so one snapshot sees a record and its reservation once.
#: VM memory each node's sandboxes hold: ``node``, ``mib``
COMMITTED_BY_NODE = (
    f"SELECT node, SUM(memory_mib) AS mib FROM sandboxes WHERE state != '{_HIBERNATED}' GROUP BY node"
)
#: VM memory the sandboxes of the node ``?`` hold
COMMITTED_ON_NODE = (
    f"SELECT COALESCE(SUM(memory_mib), 0) FROM sandboxes WHERE node = ? AND state != '{_HIBERNATED}'"
)


def held_by_owner(live_nodes: str) -> str:
    """A subquery: what the key ``?`` holds, ``n`` sandboxes (hibernated ones, and those on the
    nodes the subquery ``live_nodes`` selects) and ``mib``, the VM memory its running ones hold."""
    return (
        f"SELECT COUNT(*) AS n, COALESCE(SUM(CASE WHEN state != '{_HIBERNATED}' THEN memory_mib "
        f"ELSE 0 END), 0) AS mib FROM sandboxes WHERE owner = ? AND (state = '{_HIBERNATED}' "
        f"OR node IN ({live_nodes}))"
    )


@dataclass
class SandboxRecord:
    id: str
    owner: str
    template: str
    domain: str
    state: SandboxState
    created_at: float
    last_active_at: float
    idle_timeout_seconds: int
    memory_mib: int
    vcpus: int
    accel: str
    image_key: str
    metadata: dict[str, str] = field(default_factory=dict)
    detail: str = ""
    network: dict[str, Any] = field(default_factory=lambda: {"mode": "none", "allow": []})
    auto_checkpoint: int = 0  # checkpoints kept before calls (undo); 0: none are taken
    calls: int = 0  # executions started (what undo counts back from)
    node: str = ""  # the node whose VM it is (docs/cluster.md); the store sets it
    access_tokens: list[str] = field(default_factory=list)  # SHA-256 hashes, never tokens (access.py)
    idle_action: str = ""  # "hibernate" or "delete" at its idle timeout; "": the service's
    wake_on_call: int = 1  # 0: hibernated, it wakes only when asked to (E2B's auto_resume off)
    run_as: str = ""  # the account its code runs as (the agent's set_user); "": root


class Store:
    def __init__(self, db: Database | Path, node: str = "") -> None:
        self.db = SQLite(db) if isinstance(db, Path) else db
        self.node = node
        self.shared = self.db.dialect == "postgresql"  # other nodes' records live here too
        ensure_schema(self.db)

    def close(self) -> None:
        self.db.close()

    def insert(self, rec: SandboxRecord) -> None:
        rec.node = self.node
        row = asdict(rec)
        for name in JSON_FIELDS:
            row[name] = json.dumps(row[name])
        cols = ", ".join(row)
        marks = ", ".join(f":{k}" for k in row)
        self.db.execute(f"INSERT INTO sandboxes ({cols}) VALUES ({marks})", row)

    def update(self, sandbox_id: str, **fields: Any) -> None:
        for name in JSON_FIELDS:
            if name in fields:
                fields[name] = json.dumps(fields[name])
        sets = ", ".join(f"{k} = :{k}" for k in fields)
        self.db.execute(f"UPDATE sandboxes SET {sets} WHERE id = :id", {**fields, "id": sandbox_id})

    def touch(self, sandbox_id: str, when: float | None = None) -> None:
        self.update(sandbox_id, last_active_at=time.time() if when is None else when)

    def delete(self, sandbox_id: str) -> None:
        self.db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        row = self.db.one("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,))
        return _record(row) if row else None

    def all(self) -> list[SandboxRecord]:
        """This node's records (every record, in a database of its own)."""
        if self.shared:
            rows = self.db.execute("SELECT * FROM sandboxes WHERE node = ? ORDER BY created_at", (self.node,))
        else:
            rows = self.db.execute("SELECT * FROM sandboxes ORDER BY created_at")
        return [_record(r) for r in rows]

    def ids(self) -> set[str]:
        """The ids of every record, on any node."""
        return {r["id"] for r in self.db.execute("SELECT id FROM sandboxes")}

    def still_here(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` are still this node's (another node may have taken a hibernated one)."""
        if not ids:
            return set()
        marks = ", ".join("?" for _ in ids)
        rows = self.db.execute(
            f"SELECT id FROM sandboxes WHERE node = ? AND id IN ({marks})", (self.node, *ids)
        )
        return {r["id"] for r in rows}

    def take_over(self, sandbox_id: str, from_node: str, domain: str) -> bool:
        """Make a hibernated sandbox of ``from_node`` this node's, under the VM name ``domain``;
        False if it is no longer hibernated there (another node took it first)."""
        rows = self.db.execute(
            "UPDATE sandboxes SET node = ?, domain = ? WHERE id = ? AND node = ? AND state = ? RETURNING id",
            (self.node, domain, sandbox_id, from_node, _HIBERNATED),
        )
        return bool(rows)

    def of_owner(self, owner: str) -> list[SandboxRecord]:
        """Every record of ``owner``, on any node."""
        rows = self.db.execute("SELECT * FROM sandboxes WHERE owner = ? ORDER BY created_at", (owner,))
        return [_record(r) for r in rows]


def _record(row: dict[str, Any]) -> SandboxRecord:
    data = known_columns(SandboxRecord, row)
    data["metadata"] = json.loads(data["metadata"] or "{}")
    data["network"] = json.loads(data.get("network") or '{"mode": "none", "allow": []}')
    tokens = json.loads(data.get("access_tokens") or "[]")
    data["access_tokens"] = [t for t in tokens if isinstance(t, str)] if isinstance(tokens, list) else []
    data["state"] = SandboxState(data["state"])
    return SandboxRecord(**data)


def open_store(settings: Settings) -> Store:
    """The service's store, as its start-up opens it (before libvirt is touched): ``store_url``'s
    database, or the state directory's SQLite file; its schema migrated under its lock
    (``SchemaTooNew`` for one a newer kernelhost wrote)."""
    db = open_database(settings.store_url, settings.db_path)
    try:
        return Store(db, settings.node_id)
    except BaseException:
        db.close()
        raise
