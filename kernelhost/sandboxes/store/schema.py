"""Schema version 1: every table of the store as the releases before versioned migrations made
them (``CREATE TABLE IF NOT EXISTS``, then the columns added since, then the indexes on them).

It is written so that it can run over any database those releases left (``migrations.py``
adopts one: the tables it finds gain the columns they lack, those it lacks are created) and
ends with the same tables, columns and indexes on all of them. It must never change: a change
to the schema is a new migration in ``migrations.py``.
"""

from __future__ import annotations

from .db import Database

SANDBOXES = """
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
    calls INTEGER NOT NULL DEFAULT 0,
    node TEXT NOT NULL DEFAULT '',
    access_tokens TEXT NOT NULL DEFAULT '[]',
    idle_action TEXT NOT NULL DEFAULT '',
    wake_on_call INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS sandboxes_owner ON sandboxes(owner)
"""
# Columns added to a table after its first release, with their definitions: an older table gains
# them (its rows get the default: network mode "none", what they had; no access tokens, so the
# next connect makes one; the service's idle action, and a call wakes them).
SANDBOX_COLUMNS = {
    "network": """TEXT NOT NULL DEFAULT '{"mode": "none", "allow": []}'""",
    "auto_checkpoint": "INTEGER NOT NULL DEFAULT 0",
    "calls": "INTEGER NOT NULL DEFAULT 0",
    "node": "TEXT NOT NULL DEFAULT ''",
    "access_tokens": "TEXT NOT NULL DEFAULT '[]'",
    "idle_action": "TEXT NOT NULL DEFAULT ''",
    "wake_on_call": "INTEGER NOT NULL DEFAULT 1",
}
SANDBOX_INDEXES = "CREATE INDEX IF NOT EXISTS sandboxes_node ON sandboxes(node)"

CHECKPOINTS = """
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
    path TEXT NOT NULL,
    keep INTEGER NOT NULL DEFAULT 0,
    network TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS checkpoints_sandbox ON checkpoints(sandbox_id);
CREATE INDEX IF NOT EXISTS checkpoints_owner ON checkpoints(owner)
"""
CHECKPOINT_COLUMNS = {
    "keep": "INTEGER NOT NULL DEFAULT 0",  # not kept past their sandbox
    "network": "TEXT NOT NULL DEFAULT '{}'",  # a branch takes the sandbox record's network mode
}

TEMPLATES = """
CREATE TABLE IF NOT EXISTS templates (
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    image_key TEXT NOT NULL DEFAULT '',
    build_id TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (owner, name)
);
CREATE TABLE IF NOT EXISTS template_builds (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    key TEXT NOT NULL,
    state TEXT NOT NULL,
    stage TEXT NOT NULL DEFAULT '',
    stages TEXT NOT NULL DEFAULT '[]',
    error TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS template_builds_template ON template_builds(owner, name)
"""
TEMPLATE_BUILD_COLUMNS = {"node": "TEXT NOT NULL DEFAULT ''"}

# The cluster's tables (docs/cluster.md): its nodes and the room reserved on them.
NODES = """
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    started_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL,
    memory_mib INTEGER NOT NULL DEFAULT 0,
    committed_mib INTEGER NOT NULL DEFAULT 0,
    free_mib INTEGER NOT NULL DEFAULT 0,
    sandboxes INTEGER NOT NULL DEFAULT 0,
    templates TEXT NOT NULL DEFAULT '{}',
    accel TEXT NOT NULL DEFAULT '',
    version TEXT NOT NULL DEFAULT '',
    draining INTEGER NOT NULL DEFAULT 0,
    url_mac TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    node TEXT NOT NULL,
    count INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS reservations_owner ON reservations(owner);
CREATE INDEX IF NOT EXISTS reservations_node ON reservations(node)
"""
NODE_COLUMNS = {"url_mac": "TEXT NOT NULL DEFAULT ''"}

#: the tables version 1 makes (a database holding any of them was made by an earlier release)
TABLES = ("sandboxes", "checkpoints", "templates", "template_builds", "nodes", "reservations")


def version_1(db: Database) -> None:
    """Today's tables, columns and indexes, on an empty database or one an earlier release made."""
    db.script(SANDBOXES)
    db.add_columns("sandboxes", SANDBOX_COLUMNS)
    db.script(SANDBOX_INDEXES)  # after the (possibly added) node column
    db.script(CHECKPOINTS)
    db.add_columns("checkpoints", CHECKPOINT_COLUMNS)
    db.script(TEMPLATES)
    db.add_columns("template_builds", TEMPLATE_BUILD_COLUMNS)
    db.script(NODES)
    db.add_columns("nodes", NODE_COLUMNS)


def version_2(db: Database) -> None:
    """``sandboxes.run_as``: the account of the image a sandbox's code runs as ("": root, as
    every sandbox before it; E2B's sandboxes: ``user``). Older nodes ignore it."""
    db.add_columns("sandboxes", {"run_as": "TEXT NOT NULL DEFAULT ''"})
