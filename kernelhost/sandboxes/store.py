"""SQLite (WAL) persistence of sandbox records and API keys.

Calls are short single-row statements; they run inline on the event loop (sub-millisecond).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .states import SandboxState

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    template TEXT NOT NULL,
    domain TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    idle_timeout_seconds INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL,
    vcpus INTEGER NOT NULL,
    accel TEXT NOT NULL,
    image_key TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    detail TEXT NOT NULL DEFAULT '',
    network TEXT NOT NULL DEFAULT '{"mode": "none", "allow": []}',
    auto_checkpoint INTEGER NOT NULL DEFAULT 0,
    calls INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sandboxes_owner ON sandboxes(owner);
"""
# Columns added after the first release, with their definitions: an older database gains them
# at start (its sandboxes get the default: network mode "none", what they had).
MIGRATIONS = {
    "network": """TEXT NOT NULL DEFAULT '{"mode": "none", "allow": []}'""",
    "auto_checkpoint": "INTEGER NOT NULL DEFAULT 0",
    "calls": "INTEGER NOT NULL DEFAULT 0",
}
JSON_FIELDS = ("metadata", "network")


def key_id(api_key: str) -> str:
    """Stable, non-secret identifier of an API key (what logs and records carry)."""
    return "key_" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def new_api_key() -> str:
    return "kh_" + secrets.token_urlsafe(32)


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


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        have = {row["name"] for row in self.db.execute("PRAGMA table_info(sandboxes)")}
        for column, definition in MIGRATIONS.items():
            if column not in have:
                self.db.execute(f"ALTER TABLE sandboxes ADD COLUMN {column} {definition}")

    def close(self) -> None:
        self.db.close()

    def insert(self, rec: SandboxRecord) -> None:
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
        row = self.db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return _record(row) if row else None

    def all(self) -> list[SandboxRecord]:
        rows = self.db.execute("SELECT * FROM sandboxes ORDER BY created_at").fetchall()
        return [_record(r) for r in rows]


def _record(row: sqlite3.Row) -> SandboxRecord:
    data = dict(row)
    data["metadata"] = json.loads(data["metadata"] or "{}")
    data["network"] = json.loads(data.get("network") or '{"mode": "none", "allow": []}')
    data["state"] = SandboxState(data["state"])
    return SandboxRecord(**data)
