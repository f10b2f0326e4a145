"""Checkpoint records, in the service's SQLite database beside the sandboxes.

A checkpoint belongs to one sandbox (and so to its key) and names everything its file needs to
be loaded again: the image build the VM ran and the template snapshot whose RAM its pages were
diffed against (``base``: that snapshot's directory and build time; ``{}`` for none), and what a
branch from it needs of its sandbox (``network``: the sandbox's network mode when it was taken;
``{}`` in a record from before the column). A ``keep`` checkpoint outlives its sandbox (E2B's
snapshots): it goes only when deleted.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequest
from .db import Database
from .migrations import ensure_schema, known_columns

MAX_LABEL = 200
DEFAULT_KEEP = 5  # auto_checkpoint=true: undo reaches the last 5 calls
MAX_KEEP = 50

JSON_FIELDS = ("base", "network")


def new_checkpoint_id() -> str:
    return "cp_" + secrets.token_hex(8)


def check_label(label: object) -> str:
    """A checkpoint's label as a record keeps it ("" for none)."""
    if label is None:
        return ""
    if not isinstance(label, str) or len(label) > MAX_LABEL or not _encodable(label):
        raise InvalidRequest(
            f"label={str(label)[:40]!r} must be a string of at most {MAX_LABEL} characters, "
            "in UTF-8 (no lone surrogates)",
            field="label",
        )
    return label


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


CHECKPOINT_ID = re.compile(r"cp_[0-9a-f]{16}")


def is_checkpoint_id(value: object) -> bool:
    """Whether ``value`` can be a checkpoint's id (anything else names none: it is never looked
    up, so no string a client sends reaches the database)."""
    return isinstance(value, str) and CHECKPOINT_ID.fullmatch(value) is not None


def parse_auto_checkpoint(auto_checkpoint: object) -> int:
    """The create option ``auto_checkpoint`` (false, true, or how many calls undo reaches) as
    the sandbox record's count of checkpoints kept before calls."""
    if auto_checkpoint is None or auto_checkpoint is False:
        return 0
    if auto_checkpoint is True:
        return DEFAULT_KEEP
    if isinstance(auto_checkpoint, int) and 1 <= auto_checkpoint <= MAX_KEEP:
        return auto_checkpoint
    raise InvalidRequest(
        f"auto_checkpoint={auto_checkpoint!r} is not valid; use true (undo reaches the last "
        f"{DEFAULT_KEEP} calls), false, or the number of calls undo reaches (1 to {MAX_KEEP})",
        field="auto_checkpoint",
    )


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
    keep: bool = False  # outlives its sandbox, until deleted
    network: dict[str, Any] = field(default_factory=dict)  # its sandbox's network mode; {}: unknown

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint as every interface describes it."""
        from ..sandbox import iso_time

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
    def __init__(self, db: Database) -> None:
        self.db = db
        ensure_schema(db)

    def insert(self, rec: CheckpointRecord) -> None:
        row = {**rec.__dict__, "auto": int(rec.auto), "keep": int(rec.keep)}
        for name in JSON_FIELDS:
            row[name] = json.dumps(row[name])
        cols = ", ".join(row)
        marks = ", ".join(f":{k}" for k in row)
        self.db.execute(f"INSERT INTO checkpoints ({cols}) VALUES ({marks})", row)

    def get(self, checkpoint_id: str) -> CheckpointRecord | None:
        row = self.db.one("SELECT * FROM checkpoints WHERE id = ?", (checkpoint_id,))
        return _record(row) if row else None

    def of_sandbox(self, sandbox_id: str) -> list[CheckpointRecord]:
        rows = self.db.execute(
            "SELECT * FROM checkpoints WHERE sandbox_id = ? ORDER BY created_at", (sandbox_id,)
        )
        return [_record(r) for r in rows]

    def of_owner(self, owner: str, *, kept_only: bool = False) -> list[CheckpointRecord]:
        """The key's checkpoints (``kept_only``: those that outlive their sandbox), oldest first."""
        kept = " AND keep = 1" if kept_only else ""
        rows = self.db.execute(
            f"SELECT * FROM checkpoints WHERE owner = ?{kept} ORDER BY created_at, id", (owner,)
        )
        return [_record(r) for r in rows]

    def all(self) -> list[CheckpointRecord]:
        return [_record(r) for r in self.db.execute("SELECT * FROM checkpoints")]

    def bytes_of(self, owner: str) -> int:
        sql = "SELECT COALESCE(SUM(bytes), 0) AS n FROM checkpoints WHERE owner = ?"
        return int(self.db.scalar(sql, (owner,)))

    def delete(self, checkpoint_id: str) -> None:
        self.db.execute("DELETE FROM checkpoints WHERE id = ?", (checkpoint_id,))


def _record(row: dict[str, Any]) -> CheckpointRecord:
    data = known_columns(CheckpointRecord, row)
    data["auto"] = bool(data["auto"])
    data["keep"] = bool(data["keep"])
    for name in JSON_FIELDS:
        data[name] = json.loads(data[name] or "{}")
    return CheckpointRecord(**data)
