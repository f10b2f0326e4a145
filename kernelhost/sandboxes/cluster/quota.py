"""Per-key limits and node capacity across a cluster, taken in one transaction of the shared store.

A *reservation* holds room for sandboxes being made: a count and VM memory, for a key on a node,
until it is released or expires. Taking one locks the key (an advisory lock) and then the node's
row, counts what the key holds on live nodes and what its reservations hold, and what the node
has committed, and inserts it only if both fit: two creates on different nodes can never pass a
limit only one fits, nor overbook a node. Each record inserted under a reservation takes its
share out of it in the same transaction, so nothing is counted twice.

A dead node's sandboxes no longer count (their VMs are lost), except hibernated ones, which can
wake elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import random
import secrets
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ..errors import CapacityExceeded, NodeFull
from ..registry import Quota
from ..store.db import Database
from ..store.sandboxes import COMMITTED_BY_NODE, COMMITTED_ON_NODE, SandboxRecord, Store, held_by_owner
from .node_table import Node, NodeTable

# Set by the API for a create forwarded from the node that placed it: the reservation it took.
FORWARDED_RESERVATION: ContextVar[str | None] = ContextVar("kernelhost_forwarded_reservation", default=None)
_HELD: ContextVar[str | None] = ContextVar("kernelhost_held_reservation", default=None)


@dataclass(frozen=True)
class Placement:
    node: Node
    reservation: str


class ClusterQuota:
    def __init__(
        self, db: Database, nodes: NodeTable, node_id: str, quota: Quota, hold_seconds: float
    ) -> None:
        self.db, self.nodes, self.node_id = db, nodes, node_id
        self.quota = quota
        self.hold = hold_seconds  # a reservation's life: a create that takes longer has failed
        self._pg = db.dialect == "postgresql"

    def _live(self) -> str:
        return f"SELECT id FROM nodes WHERE heartbeat_at > {self.db.now} - {float(self.nodes.lease)}"

    # -- placement -------------------------------------------------------------------------------

    def candidates(self, image: str, key: str | None = None) -> list[tuple[Node, int]]:
        """Live, undrained nodes that have ``image`` (its build ``key`` if given), most room first."""
        now = self.db.now
        # the templates' JSON holds the name as a key: LIKE narrows the rows, the check is exact
        pattern = "%" + json.dumps(image) + ": %"
        rows = self.db.execute(
            f"SELECT n.*, {now} - n.heartbeat_at AS age, "
            "n.memory_mib - COALESCE(s.mib, 0) - COALESCE(r.mib, 0) AS room FROM nodes n "
            f"LEFT JOIN ({COMMITTED_BY_NODE}) s ON s.node = n.id "
            f"LEFT JOIN (SELECT node, SUM(memory_mib) AS mib FROM reservations WHERE expires_at > {now} "
            "GROUP BY node) r ON r.node = n.id "
            f"WHERE n.heartbeat_at > {now} - {float(self.nodes.lease)} AND n.draining = 0 "
            "AND n.templates LIKE ? ORDER BY room DESC, n.id",
            (pattern,),
        )
        found = []
        for row in rows:
            room = int(row.pop("room"))
            node = self.nodes.node(row)
            have = node.templates.get(image)
            if have is not None and (key is None or have == key) and not node.refused:
                found.append((node, room))
        return found

    def place(self, owner: str, image: str, count: int, memory_mib: int, key: str | None = None) -> Placement:
        """Choose a node for ``count`` sandboxes of ``image`` and reserve room there."""
        want = max(count, 1) * memory_mib
        found = [(node, room) for node, room in self.candidates(image, key) if room >= want]
        # Concurrent creates read the same candidates: each tries first one of the nodes within one
        # placement of the most room (as even a spread), then two others that fit, at random, so
        # they do not all queue for the same few nodes and give up while the cluster has room.
        fits = [node for node, _ in found]
        near = sum(1 for _, room in found if room > found[0][1] - want)  # a prefix: most room first
        order = [fits.pop(random.randrange(near))] if fits else []
        for node in order + random.sample(fits, min(2, len(fits))):
            try:
                return Placement(node, self.take(owner, node.id, count, memory_mib))
            except NodeFull:
                continue  # another create took it meanwhile: the next
        raise NodeFull(
            f"no live node of the cluster has template {image!r} and room for {want} MiB of VM "
            "memory; add a node, build the template on more nodes, or close sandboxes first",
            limit="cluster_capacity",
            value=want,
        )

    # -- reservations ----------------------------------------------------------------------------

    def take(self, owner: str, node_id: str, count: int, memory_mib: int) -> str:
        """Reserve room for ``count`` sandboxes (``count=0``: one waking) of ``owner`` on
        ``node_id``, or raise ``CapacityExceeded`` (naming the limit) / ``NodeFull``."""
        want = max(count, 1) * memory_mib
        with self.db.transaction() as db:
            if self._pg:  # one key's creates queue here, whichever node runs them
                db.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (owner,))
            lock = " FOR UPDATE" if self._pg else ""
            node = db.one(f"SELECT memory_mib, draining FROM nodes WHERE id = ?{lock}", (node_id,))
            if node is None:
                raise NodeFull(f"node {node_id!r} is not part of the cluster", limit="node", value=0)
            if node["draining"] and count > 0:
                raise NodeFull(
                    f"node {node_id} is draining and takes no new sandboxes; create through "
                    "another node, or undrain this one",
                    limit="draining",
                    value=0,
                )
            self._check_key(db, owner, count, want)
            committed = self._committed(db, node_id)
            if committed + want > int(node["memory_mib"]):
                raise NodeFull(
                    f"node {node_id} has {int(node['memory_mib']) - committed} MiB of VM memory left "
                    f"and {want} MiB were asked for; another node, or fewer sandboxes",
                    limit="node_memory",
                    value=int(node["memory_mib"]),
                )
            rid = "rsv_" + secrets.token_hex(8)
            db.execute(
                "INSERT INTO reservations (id, owner, node, count, memory_mib, expires_at) "
                f"VALUES (?, ?, ?, ?, ?, {self.db.now} + ?)",
                (rid, owner, node_id, count, want, self.hold),
            )
        return rid

    def _check_key(self, db: Database, owner: str, count: int, want: int) -> None:
        # One statement, so one snapshot: a record that replaces its reservation meanwhile (record(),
        # on another connection) counts once, never in neither the records nor the reservations.
        row = db.one(
            "SELECT h.n + r.n AS n, h.mib + r.mib AS mib FROM "
            f"({held_by_owner(self._live())}) h, "
            "(SELECT COALESCE(SUM(count), 0) AS n, COALESCE(SUM(memory_mib), 0) AS mib FROM "
            f"reservations WHERE owner = ? AND expires_at > {self.db.now}) r",
            (owner, owner),
        )
        assert row is not None
        n = int(row["n"])
        if n + count > self.quota.max_sandboxes:
            raise CapacityExceeded(
                f"this API key holds {n} sandboxes and asked for {count} more, over its limit of "
                f"{self.quota.max_sandboxes} (max_sandboxes_per_key); close some first",
                limit="max_sandboxes_per_key",
                value=self.quota.max_sandboxes,
            )
        used = int(row["mib"])
        if used + want > self.quota.max_memory_mib:
            raise CapacityExceeded(
                f"this API key's running sandboxes use {used} MiB of VM memory; {want} MiB more "
                f"would pass its limit of {self.quota.max_memory_mib} MiB (max_memory_mib_per_key); "
                "close or hibernate some first",
                limit="max_memory_mib_per_key",
                value=self.quota.max_memory_mib,
            )

    def _committed(self, db: Database, node_id: str) -> int:
        mib = db.scalar(  # one statement, one snapshot (see _check_key)
            f"SELECT ({COMMITTED_ON_NODE}) + (SELECT COALESCE(SUM(memory_mib), 0) "
            f"FROM reservations WHERE node = ? AND expires_at > {self.db.now}) AS mib",
            (node_id, node_id),
        )
        return int(mib)

    def release(self, reservation: str) -> None:
        self.db.execute("DELETE FROM reservations WHERE id = ?", (reservation,))

    def _adopt(self, owner: str, count: int) -> str | None:
        """The reservation a forwarded create carries, if it is this node's and ``owner``'s."""
        rid = FORWARDED_RESERVATION.get()
        if rid is None or count < 1:
            return None
        FORWARDED_RESERVATION.set(None)  # it pays for one create
        row = self.db.one(
            "SELECT count FROM reservations WHERE id = ? AND owner = ? AND node = ? "
            f"AND expires_at > {self.db.now}",
            (rid, owner, self.node_id),
        )
        return rid if row is not None and int(row["count"]) >= count else None

    @contextlib.contextmanager
    def reserve(self, owner: str, count: int, memory_mib: int) -> Iterator[None]:
        """``Registry.reserve`` for a node of a cluster: room on this node, the key's limits
        cluster-wide."""
        rid = self._adopt(owner, count) or self.take(owner, self.node_id, count, memory_mib)
        token = _HELD.set(rid)
        try:
            yield
        finally:
            _HELD.reset(token)
            self.release(rid)

    def record(self, store: Store, rec: SandboxRecord) -> None:
        """Insert a new sandbox's record; it takes its share out of the held reservation."""
        rid = _HELD.get()
        with self.db.transaction() as db:
            store.insert(rec)
            if rid is not None:
                db.execute(
                    "UPDATE reservations SET count = count - 1, memory_mib = memory_mib - ? "
                    "WHERE id = ? AND count > 0",
                    (rec.memory_mib, rid),
                )

    def usage(self, owner: str) -> dict[str, Any]:
        """What ``owner`` holds across the cluster (for views and tests)."""
        row = self.db.one(f"SELECT n FROM ({held_by_owner(self._live())}) h", (owner,))
        return {"sandboxes": int(row["n"]) if row else 0}
