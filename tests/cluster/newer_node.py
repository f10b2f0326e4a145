"""``kernelhost`` as the next release would be: this release's migrations and one more, chosen
by ``KH_TEST_NEXT_SCHEMA`` (read here only; kernelhost knows nothing of it):

- ``additive``: a column with a default on ``sandboxes`` and ``nodes``, and a table (an older
  node still runs beside it);
- ``breaking``: that, then a version that older nodes cannot read (``min_compatible`` its own).

    python -m tests.cluster.newer_node serve|migrate ...
"""

from __future__ import annotations

import os
import sys

from kernelhost.cli import main
from kernelhost.sandboxes.store import Database, Migration, migrations

CURRENT = migrations.MIGRATIONS[-1]


def add_notes(db: Database) -> None:
    db.add_columns("sandboxes", {"note": "TEXT NOT NULL DEFAULT ''"})
    db.add_columns("nodes", {"zone": "TEXT NOT NULL DEFAULT ''"})
    db.script("CREATE TABLE IF NOT EXISTS notes (id TEXT PRIMARY KEY, body TEXT NOT NULL)")


def unreadable(db: Database) -> None:
    """What older nodes cannot live with (here nothing changes: the version says so)."""


ADDITIVE = Migration(CURRENT.version + 1, "notes (test)", add_notes, CURRENT.min_compatible)
BREAKING = Migration(CURRENT.version + 2, "unreadable (test)", unreadable, CURRENT.version + 2)


def next_release() -> None:
    kind = os.environ.get("KH_TEST_NEXT_SCHEMA", "additive")
    extra = {"additive": (ADDITIVE,), "breaking": (ADDITIVE, BREAKING)}[kind]
    migrations.MIGRATIONS = (*migrations.MIGRATIONS, *extra)


if __name__ == "__main__":
    next_release()
    sys.exit(main())
