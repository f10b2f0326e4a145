"""The nodes of a cluster, in the store they share: who they are, where peers reach them, and
the figures each heartbeats. A node whose heartbeat is older than the lease is dead; ages are
measured on the database's clock, so the nodes' own clocks need not agree.

Each node signs its row's URL (``url_mac``, ``trust.py``): a row whose URL was not written by a
holder of the cluster secret is *refused* (``Node.refused`` says why); no call is forwarded and
nothing placed there."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from ..store.db import Database
from ..store.migrations import ensure_schema, known_columns
from ..trust import node_url_mac, registration_problem

log = structlog.get_logger("kernelhost.cluster")


@dataclass
class Figures:
    """What a node heartbeats: its capacity and what it holds."""

    memory_mib: int  # VM memory this node may commit
    committed_mib: int = 0  # VM memory its running sandboxes hold
    free_mib: int = 0  # the host's available memory
    sandboxes: int = 0
    templates: dict[str, str] = field(default_factory=dict)  # image name -> build key, ready here
    accel: str = ""
    version: str = ""


@dataclass
class Node:
    id: str
    url: str
    started_at: float
    heartbeat_at: float
    memory_mib: int
    committed_mib: int
    free_mib: int
    sandboxes: int
    templates: dict[str, str]
    accel: str
    version: str
    draining: bool
    age: float  # seconds since its last heartbeat, on the database's clock
    alive: bool
    refused: str = ""  # why no call goes to its URL (an unregistered or malformed row); '': none

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["heartbeat_age_seconds"] = round(data.pop("age"), 3)
        data["templates"] = sorted(self.templates)
        return data


class NodeTable:
    def __init__(self, db: Database, lease_seconds: float, secret: str = "") -> None:
        self.db = db
        self.lease = lease_seconds
        self.secret = secret  # the cluster secret: rows' URLs are checked against their MAC
        ensure_schema(db)
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def heartbeat(self, node_id: str, url: str, figures: Figures, *, fresh: bool = False) -> None:
        """Say ``node_id`` is alive now with ``figures`` (``fresh``: it has just started)."""
        mac = node_url_mac(self.secret, node_id, url) if self.secret else ""
        row = {**asdict(figures), "id": node_id, "url": url, "url_mac": mac}
        row["templates"] = json.dumps(figures.templates)
        cols = ", ".join(row)
        marks = ", ".join(f":{k}" for k in row)
        sets = ", ".join(f"{k} = excluded.{k}" for k in row if k != "id")
        started = ", started_at = excluded.started_at, draining = 0" if fresh else ""
        now = self.db.now
        self.db.execute(
            f"INSERT INTO nodes ({cols}, started_at, heartbeat_at) VALUES ({marks}, {now}, {now}) "
            f"ON CONFLICT (id) DO UPDATE SET {sets}, heartbeat_at = excluded.heartbeat_at{started}",
            row,
        )

    def get(self, node_id: str) -> Node | None:
        rows = self._select("WHERE id = ?", (node_id,))
        return rows[0] if rows else None

    def all(self) -> list[Node]:
        return self._select("ORDER BY id", ())

    def live(self) -> list[Node]:
        return [n for n in self.all() if n.alive]

    def set_draining(self, node_id: str, draining: bool) -> bool:
        """Mark a node draining (no new sandboxes) or not; False if there is no such node."""
        if self.get(node_id) is None:
            return False
        self.db.execute("UPDATE nodes SET draining = ? WHERE id = ?", (int(draining), node_id))
        return True

    def forget(self, node_id: str) -> None:
        self.db.execute("DELETE FROM nodes WHERE id = ?", (node_id,))

    def _select(self, where: str, params: tuple[Any, ...]) -> list[Node]:
        rows = self.db.execute(f"SELECT *, {self.db.now} - heartbeat_at AS age FROM nodes {where}", params)
        return [self.node(r) for r in rows]

    def node(self, row: dict[str, Any]) -> Node:
        """A node from its row (with ``age``, seconds since its heartbeat on the database's clock)."""
        data = known_columns(Node, row)
        data["templates"] = json.loads(data["templates"] or "{}")
        data["draining"] = bool(data["draining"])
        data["age"] = float(data["age"])
        data["alive"] = data["age"] <= self.lease
        mac = row.get("url_mac") or ""
        data["refused"] = registration_problem(self.secret, data["id"], data["url"], mac)
        if data["refused"]:
            self._warn(data["id"], data["url"], data["refused"])
        return Node(**data)

    def _warn(self, node_id: str, url: str, why: str) -> None:
        with self._lock:
            if (node_id, url) in self._warned:
                return
            self._warned.add((node_id, url))
        log.warning("cluster.node_refused", node=node_id, url=url[:200], reason=why)
