"""``kernelhost migrate``: bring the store's schema to this release's, ahead of a rollout
(docs/cluster.md, "Schema migrations"). A node migrates at start as well; running it first means
no node of the rollout waits on the schema's lock, and a problem shows before any node restarts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError, Settings


def add_migrate_command(sub: Any) -> None:
    cmd = sub.add_parser(
        "migrate",
        help="apply the store's schema migrations (what a node does at start), ahead of a rollout",
        description="Apply the schema migrations this kernelhost knows to its store (store_url, or "
        "the state directory's SQLite file), under the schema's lock, and print what was applied. "
        "Safe to run while nodes are up and from several places at once.",
    )
    cmd.add_argument(
        "--store-url",
        help="the store (postgresql://... or sqlite:///path); default: this node's settings "
        "(KERNELHOST_STORE_URL, else the state directory's SQLite file)",
    )
    cmd.add_argument("--dry-run", action="store_true", help="print what would be applied; change nothing")
    cmd.set_defaults(func=_migrate)


def _migrate(args: argparse.Namespace) -> int:
    from ..sandboxes.store import StoreUnavailable, migrate, open_database
    from ..sandboxes.store.db import redact
    from ..sandboxes.store.migrations import known_migrations

    try:
        url, default = _target(args.store_url)
        db = open_database(url, default)
    except (ConfigError, StoreUnavailable) as exc:
        print(f"kernelhost migrate: {exc}", file=sys.stderr)
        return 2
    where = redact(url) if url else str(default)
    try:
        outcome = migrate(db, dry_run=args.dry_run)
    except StoreUnavailable as exc:  # SchemaTooNew among them
        print(f"kernelhost migrate: {exc}", file=sys.stderr)
        return 1
    finally:
        db.close()
    names = {m.version: m.name for m in known_migrations()}
    print(f"store: {where}")
    for version in outcome.pending:
        print(f"would apply  {version:>4}  {names.get(version, '')}")
    for version in outcome.applied:
        note = " (adopted the tables an earlier release made)" if version == 1 and outcome.adopted else ""
        print(f"applied      {version:>4}  {names.get(version, '')}{note}")
    if not outcome.applied and not outcome.pending:
        print("nothing to apply")
    newer = f"; a newer kernelhost added up to {outcome.version}" if outcome.version > outcome.known else ""
    now = max(outcome.version, *outcome.pending) if outcome.pending else outcome.version
    print(f"schema version {now} (this kernelhost knows up to {outcome.known}{newer})")
    return 0


def _target(store_url: str | None) -> tuple[str, Path]:
    """The store to migrate: ``--store-url``, else this node's settings."""
    if store_url:
        return store_url, Path("/nonexistent")  # a URL names its database: no default is used
    settings = Settings.load()
    return settings.store_url, settings.db_path
