"""The store's schema, versioned: one ordered list of migrations, applied once each, by one
connection at a time on any node, the same way on SQLite and PostgreSQL (docs/cluster.md,
"Schema migrations").

``schema_migrations`` holds a row per version applied. ``migrate()`` takes the schema's lock
(PostgreSQL: an advisory lock with a fixed key; SQLite: the write lock of ``BEGIN IMMEDIATE``),
reads the versions applied, applies the missing ones in order and records each, in one
transaction: nodes that start together wait for each other, and the first one's work is what the
others find. A database an earlier release made (its tables, no ``schema_migrations``) is adopted
by version 1, which brings any such database to today's tables and is then recorded.

Migrations are additive: a column with a default, a table, an index. Readers ignore columns they
do not know, so a node still runs beside a database one of its newer peers migrated. Each
migration names ``min_compatible``: the oldest schema version whose nodes still work once it is
applied (for an additive migration, the one before it keeps its value; a change that older
nodes cannot live with sets its own version). A node refuses a database whose highest
``min_compatible`` is newer than the newest version it knows: ``SchemaTooNew``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from importlib import metadata
from typing import Any

import structlog

from .db import Database, StoreUnavailable, redact
from .schema import TABLES, version_1, version_2

log = structlog.get_logger("kernelhost.store")

VERSIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    min_compatible INTEGER NOT NULL,
    applied_at REAL NOT NULL,
    applied_by TEXT NOT NULL DEFAULT ''
)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    apply: Callable[[Database], None]  # runs inside the migration's transaction, under the lock
    min_compatible: int  # the oldest schema version whose nodes work once this one is applied


#: every schema version, in order; a new one goes at the end and is never edited once released
MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "the tables of the releases before versioned migrations", version_1, 1),
    Migration(2, "sandboxes.run_as: the account a sandbox's code runs as", version_2, 1),
)


class SchemaTooNew(StoreUnavailable):
    """The database's schema needs a newer kernelhost than this node runs."""


@dataclass
class Outcome:
    """What ``migrate()`` found and did."""

    version: int  # the database's schema version after it (the highest applied)
    known: int  # the newest version this kernelhost knows
    min_compatible: int  # the oldest version whose nodes may use the database
    applied: list[int] = field(default_factory=list)  # versions applied now, in order
    adopted: bool = False  # version 1 took over tables that an earlier release made
    pending: list[int] = field(default_factory=list)  # dry run: what would be applied


def known_migrations() -> tuple[Migration, ...]:
    """The migrations this kernelhost knows (read at each call: a test may add one)."""
    return MIGRATIONS


def migrate(db: Database, migrations: Sequence[Migration] | None = None, *, dry_run: bool = False) -> Outcome:
    """Bring ``db``'s schema to the newest of ``migrations`` (default: this kernelhost's), under
    the schema's lock; raise ``SchemaTooNew`` when the database needs a newer kernelhost.
    ``dry_run``: change nothing, say what would be applied."""
    steps = sorted(migrations if migrations is not None else known_migrations(), key=lambda m: m.version)
    known = steps[-1].version if steps else 0
    with db.transaction():
        db.lock_schema()
        exists = bool(db.columns("schema_migrations"))
        if not exists and not dry_run:
            db.script(VERSIONS_TABLE)
        rows = db.execute("SELECT version, min_compatible FROM schema_migrations") if exists else []
        applied = {int(r["version"]): int(r["min_compatible"]) for r in rows}
        outcome = Outcome(max(applied, default=0), known, max(applied.values(), default=0))
        _refuse_if_too_new(db, outcome)
        todo = [m for m in steps if m.version not in applied]
        if dry_run:
            outcome.pending = [m.version for m in todo]
            return outcome
        if todo and not applied:
            outcome.adopted = any(db.columns(table) for table in TABLES)
        for step in todo:
            step.apply(db)
            db.execute(
                "INSERT INTO schema_migrations (version, name, min_compatible, applied_at, applied_by) "
                "VALUES (?, ?, ?, ?, ?)",
                (step.version, step.name, step.min_compatible, time.time(), f"kernelhost {_release()}"),
            )
            outcome.applied.append(step.version)
            applied[step.version] = step.min_compatible
        outcome.version = max(applied, default=0)
        outcome.min_compatible = max(applied.values(), default=0)
    return outcome


def ensure_schema(db: Database) -> None:
    """Once per connection, before a store uses it: migrate, and log what was done or found."""
    if db.schema_version:
        return
    outcome = migrate(db)
    db.schema_version = outcome.version
    if outcome.applied:
        log.info("schema.migrated", applied=outcome.applied, version=outcome.version, adopted=outcome.adopted)
    if outcome.version > outcome.known:
        log.warning(
            "schema.newer",
            version=outcome.version,
            known=outcome.known,
            min_compatible=outcome.min_compatible,
            note="a newer kernelhost migrated this store; its changes are additive, so this node runs",
        )


def known_columns(record: type, row: Mapping[str, Any]) -> dict[str, Any]:
    """The values of ``row`` that the dataclass ``record`` has fields for: a column a newer
    node's migration added is not this node's to read."""
    names = {f.name for f in fields(record)}
    return {k: v for k, v in row.items() if k in names}


def _refuse_if_too_new(db: Database, outcome: Outcome) -> None:
    if outcome.min_compatible <= outcome.known:
        return
    where = redact(getattr(db, "url", "")) or str(getattr(db, "path", "the database"))
    raise SchemaTooNew(
        f"the store at {where} has schema version {outcome.version}, which needs a kernelhost that "
        f"knows schema version {outcome.min_compatible} or later; this kernelhost ({_release()}) "
        f"knows schema versions up to {outcome.known}: upgrade kernelhost on this node to the "
        "release the other nodes run"
    )


def _release() -> str:
    try:
        return metadata.version("kernelhost")
    except metadata.PackageNotFoundError:  # run from a tree that was never installed
        return "0"
