"""Checkpoint records, in the service's SQLite database beside the sandboxes.

A checkpoint belongs to one sandbox (and so to its key) and names everything its file needs to
be loaded again: the image build the VM ran and the template snapshot whose RAM its pages were
diffed against (``base``: that snapshot's directory and build time; ``{}`` for none).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    id TEXT PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    label TEXT NOT NULL DEFAULT '',
    auto INTEGER NOT NULL DEFAULT 0,
    call_index INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,
    template TEXT NOT NULL,
    image_key TEXT NOT NULL,
    base TEXT NOT NULL DEFAULT '{}',
    path TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_sandbox ON checkpoints(sandbox_id);
CREATE INDEX IF NOT EXISTS checkpoints_owner ON checkpoints(owner);
"""


def new_checkpoint_id() -> str:
    return "cp_" + secrets.token_hex(8)


@dataclass
class CheckpointRecord:
    id: str
    sandbox_id: str
    owner: str
    template: str
    image_key: str
    path: str
    label: str = ""
    auto: bool = False
    call_index: int = 0  # an automatic checkpoint: the state before this call (1 = the first)
    created_at: float = field(default_factory=time.time)
    bytes: int = 0
    base: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint as every interface describes it."""
        from .sandbox import iso_time

        return {
            "id": self.id,
            "sandbox_id": self.sandbox_id,
            "label": self.label,
            "auto": self.auto,
            "created_at": iso_time(self.created_at),
            "bytes": self.bytes,
            **({"before_call": self.call_index} if self.auto else {}),
        }


class CheckpointStore:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        db.executescript(SCHEMA)

    def insert(self, rec: CheckpointRecord) -> None:
        row = {**rec.__dict__, "auto": int(rec.auto), "base": json.dumps(rec.base)}
        cols = ", ".join(row)
        marks = ", ".join(f":{k}" for k in row)
        self.db.execute(f"INSERT INTO checkpoints ({cols}) VALUES ({marks})", row)

    def get(self, checkpoint_id: str) -> CheckpointRecord | None:
        row = self.db.execute("SELECT * FROM checkpoints WHERE id = ?", (checkpoint_id,)).fetchone()
        return _record(row) if row else None

    def of_sandbox(self, sandbox_id: str) -> list[CheckpointRecord]:
        rows = self.db.execute(
            "SELECT * FROM checkpoints WHERE sandbox_id = ? ORDER BY created_at", (sandbox_id,)
        ).fetchall()
        return [_record(r) for r in rows]

    def all(self) -> list[CheckpointRecord]:
        return [_record(r) for r in self.db.execute("SELECT * FROM checkpoints").fetchall()]

    def bytes_of(self, owner: str) -> int:
        row = self.db.execute("SELECT COALESCE(SUM(bytes), 0) FROM checkpoints WHERE owner = ?", (owner,))
        return int(row.fetchone()[0])

    def delete(self, checkpoint_id: str) -> None:
        self.db.execute("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))


def _record(row: sqlite3.Row) -> CheckpointRecord:
    data = dict(row)
    data["auto"] = bool(data["auto"])
    data["base"] = json.loads(data["base"] or "{}")
    return CheckpointRecord(**data)
