"""Template records and their builds, in the service's SQLite database beside the sandboxes.

A template is ``(owner, name)``: ``owner`` is an API key's id for a template built through the
API, ``""`` for one the operator ships as a spec file (visible to every key). Built-in templates
are images only (``make image``) and have no record.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .db import Database
from .migrations import ensure_schema, known_columns


@dataclass
class TemplateRecord:
    owner: str
    name: str
    spec: dict[str, Any]
    state: str  # building | ready | failed (the latest build's outcome; ready keeps the image)
    image_key: str = ""  # the layer build sandboxes start from; "" until one succeeded
    build_id: str = ""  # the latest build
    error: str = ""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)


class TemplateStore:
    def __init__(self, db: Database, node: str = "") -> None:
        self.db = db
        self.node = node  # builds run on the node that got them; a cluster's others leave them be
        ensure_schema(db)

    # -- templates -------------------------------------------------------------------------------

    def put(self, rec: TemplateRecord) -> None:
        rec.updated_at = time.time()
        row = asdict(rec)
        row["spec"] = json.dumps(row["spec"])
        cols = ", ".join(row)
        marks = ", ".join(f":{k}" for k in row)
        self.db.execute(f"INSERT INTO templates ({cols}) VALUES ({marks}) {_upsert(row, 'owner, name')}", row)

    def get(self, owner: str, name: str) -> TemplateRecord | None:
        row = self.db.one("SELECT * FROM templates WHERE owner = ? AND name = ?", (owner, name))
        return _template(row) if row else None

    def all(self) -> list[TemplateRecord]:
        return [_template(r) for r in self.db.execute("SELECT * FROM templates ORDER BY owner, name")]

    def delete(self, owner: str, name: str) -> None:
        self.db.execute("DELETE FROM templates WHERE owner = ? AND name = ?", (owner, name))
        self.db.execute("DELETE FROM template_builds WHERE owner = ? AND name = ?", (owner, name))

    # -- builds ----------------------------------------------------------------------------------

    def put_build(self, build: dict[str, Any]) -> None:
        row = {k: build.get(k) for k in _BUILD_COLUMNS}
        row["node"] = build.get("node") or self.node
        row["stages"] = json.dumps(row["stages"] or [])
        row["error"] = row["error"] or ""
        cols = ", ".join(row)
        marks = ", ".join(f":{k}" for k in row)
        self.db.execute(f"INSERT INTO template_builds ({cols}) VALUES ({marks}) {_upsert(row, 'id')}", row)

    def build(self, build_id: str) -> dict[str, Any] | None:
        row = self.db.one("SELECT * FROM template_builds WHERE id = ?", (build_id,))
        return _build(row) if row else None

    def builds(self, owner: str, name: str) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT * FROM template_builds WHERE owner = ? AND name = ? ORDER BY created_at", (owner, name)
        )
        return [_build(r) for r in rows]

    def unfinished_builds(self) -> list[dict[str, Any]]:
        """This node's builds that were queued or running (every build, on a single host)."""
        rows = self.db.execute(
            "SELECT * FROM template_builds WHERE state IN ('queued', 'running') AND (node = ? OR ? = '')",
            (self.node, self.node if self.db.dialect == "postgresql" else ""),
        )
        return [_build(r) for r in rows]


_BUILD_COLUMNS = (
    "id", "owner", "name", "key", "state", "stage", "stages", "error",
    "created_at", "started_at", "finished_at",
)  # fmt: skip


def _upsert(row: dict[str, Any], key: str) -> str:
    """The ``ON CONFLICT`` clause that makes an insert of ``row`` replace the row with its key."""
    keys = {k.strip() for k in key.split(",")}
    sets = ", ".join(f"{k} = excluded.{k}" for k in row if k not in keys)
    return f"ON CONFLICT ({key}) DO UPDATE SET {sets}"


def _template(row: dict[str, Any]) -> TemplateRecord:
    data = known_columns(TemplateRecord, row)
    data["spec"] = json.loads(data["spec"])
    return TemplateRecord(**data)


def _build(row: dict[str, Any]) -> dict[str, Any]:
    data = dict(row)
    data["stages"] = json.loads(data["stages"] or "[]")
    return data
