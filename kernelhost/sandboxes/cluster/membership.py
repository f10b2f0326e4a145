"""This service as a node of a cluster: it registers and heartbeats its figures, places creates
on the node with room, finds the node of any sandbox, takes over hibernated sandboxes of nodes
that died or drain, and drains itself.

At start, a node whose last heartbeat is older than the lease finds that the cluster gave its
running sandboxes up (they answered 410 meanwhile and left their key's quota): it forgets their
records, so the reconcile that follows destroys their VMs. One that comes back within the lease
keeps them, as a single host does after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

import structlog

from ..context import Context
from ..registry import Quota
from ..sandbox import Sandbox
from ..states import SandboxState
from ..store.db import open_database
from ..store.sandboxes import SandboxRecord, Store
from .node_table import Figures, Node, NodeTable
from .quota import ClusterQuota, Placement

log = structlog.get_logger("kernelhost.cluster")

try:
    __version__ = metadata.version("kernelhost")
except metadata.PackageNotFoundError:  # run from a tree that was never installed
    __version__ = "0"

T = TypeVar("T")

WHERE_CACHE = 100_000  # sandbox locations kept in memory (oldest dropped first)

HOST_FAILED = "the host of this sandbox failed; its state is lost; create a new sandbox"


@dataclass(frozen=True)
class Location:
    """Where a sandbox's VM is: ``node`` None when its node is unknown to the cluster."""

    record: SandboxRecord
    node: Node | None

    @property
    def lost(self) -> bool:
        """Its node died and took its VM along (a hibernated one can wake elsewhere)."""
        return (self.node is None or not self.node.alive) and self.record.state != SandboxState.HIBERNATED

    @property
    def movable(self) -> bool:
        """Hibernated on a node that died or drains: another node may wake it."""
        return self.record.state == SandboxState.HIBERNATED and (
            self.node is None or not self.node.alive or self.node.draining
        )


class Membership:
    """This service's part in the cluster (``Node`` is a row of the nodes table: any node)."""

    def __init__(self, ctx: Context, store: Store) -> None:
        s = ctx.settings
        self.ctx, self.store = ctx, store
        self.id, self.url = s.node_id, s.peer_url
        self.nodes = NodeTable(store.db, s.node_lease_seconds, s.cluster_secret)
        quota = Quota(s.max_sandboxes_per_key, s.max_memory_mib_per_key)
        self.quota = ClusterQuota(store.db, self.nodes, self.id, quota, s.boot_timeout + 60)
        ctx.registry.cluster = self.quota
        self.draining = False
        self._task: asyncio.Task[None] | None = None
        # heartbeats on a thread and a connection of their own: a burst of creates (each holding
        # the shared connection for its transaction, and the default executor's threads) must
        # never make this node look dead
        self._beat_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cluster-heartbeat")
        self._beat_table: NodeTable | None = None
        # where other nodes' sandboxes are, and the node table as the last heartbeat read it:
        # a forwarded call asks the store nothing (a node that dies or drains is read anew)
        self._where: dict[str, tuple[str, str]] = {}
        self._peers: dict[str, Node] = {}
        self._peers_read_at = 0.0

    # -- start, heartbeat, stop ------------------------------------------------------------------

    def rejoin(self) -> None:
        """Before the reconcile: forget what the cluster gave up while this node was away."""
        me = self.nodes.get(self.id)
        if me is None or me.alive:
            return
        lost = [r for r in self.store.all() if r.state != SandboxState.HIBERNATED]
        for rec in lost:
            self.store.delete(rec.id)
        log.warning("cluster.rejoined_late", node=self.id, away_seconds=round(me.age), gave_up=len(lost))

    async def start(self) -> None:
        await asyncio.to_thread(self.rejoin)
        s = self.ctx.settings
        db = await self._on_beat_thread(open_database, s.store_url, s.db_path)
        self._beat_table = NodeTable(db, self.nodes.lease, self.nodes.secret)
        await self._on_beat_thread(self._beat_table.heartbeat, self.id, self.url, self.figures(), fresh=True)
        self._task = self.ctx.tasks.spawn(self._beat(), name="cluster-heartbeat")
        log.info("cluster.joined", node=self.id, url=self.url, nodes=len(self.nodes.live()))

    async def _on_beat_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._beat_thread, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """After the heartbeat task was cancelled: its thread and connection go (idempotent)."""
        self._beat_thread.shutdown(wait=False, cancel_futures=True)
        if self._beat_table is not None:
            with contextlib.suppress(Exception):
                self._beat_table.db.close()
            self._beat_table = None

    async def _beat(self) -> None:
        interval = max(0.5, self.nodes.lease / 3)
        table = self._beat_table
        assert table is not None
        while True:
            await asyncio.sleep(interval)
            try:
                beat = self._on_beat_thread(table.heartbeat, self.id, self.url, self.figures())
                async with asyncio.timeout(interval * 2):
                    await beat
                read_at = time.time()
                async with asyncio.timeout(interval * 2):
                    peers = await self._on_beat_thread(table.all)
                self._peers, self._peers_read_at = {n.id: n for n in peers}, read_at
            except Exception as exc:  # the store is away: the next beat tries again
                log.warning("cluster.heartbeat_failed", node=self.id, error=str(exc))
                continue
            with contextlib.suppress(Exception):
                await self._drop_moved()

    async def _drop_moved(self) -> None:
        """Forget hibernated sandboxes that another node took over (after a drain)."""
        mine = [s for s in self.ctx.registry if s.record.state == SandboxState.HIBERNATED]
        if not mine:
            return
        still = await asyncio.to_thread(self.store.still_here, [s.id for s in mine])
        for sbx in mine:
            if sbx.id not in still and sbx.record.state == SandboxState.HIBERNATED:
                self.ctx.registry.pop(sbx)
                log.info("cluster.moved_away", sandbox_id=sbx.id)

    def figures(self) -> Figures:
        sandboxes = list(self.ctx.registry)
        images = self.ctx.images
        ready: dict[str, str] = {}
        for name in images.templates():
            with contextlib.suppress(Exception):
                ready[name] = images.get(name).key
        running = [s for s in sandboxes if s.record.state != SandboxState.HIBERNATED]
        total, free = _meminfo()
        return Figures(
            memory_mib=max(0, total - 1024),
            committed_mib=sum(s.record.memory_mib for s in running),
            free_mib=free,
            sandboxes=len(sandboxes),
            templates=ready,
            accel=self.ctx.accel,
            version=__version__,
        )

    # -- where sandboxes are, and where new ones go ----------------------------------------------

    def locate(self, sandbox_id: str) -> Location | None:
        rec = self.store.get(sandbox_id)
        if rec is None:
            return None
        loc = Location(rec, self.nodes.get(rec.node))
        if loc.node is not None and loc.node.alive and not loc.node.draining and not loc.movable:
            self._where[sandbox_id] = (rec.owner, loc.node.id)
            while len(self._where) > WHERE_CACHE:
                self._where.pop(next(iter(self._where)))
        return loc

    def peer_of(self, sandbox_id: str, owner: str) -> Node | None:
        """The live, undrained node that holds ``owner``'s sandbox, from memory: what was located
        before and the node table the heartbeat last read (None: ask the store)."""
        where = self._where.get(sandbox_id)
        if where is None or where[0] != owner:
            return None
        node = self._peers.get(where[1])
        since = time.time() - self._peers_read_at  # the read's age, on this node's clock
        lease = self.nodes.lease
        if node is None or node.draining or node.refused or since > lease / 2 or node.age + since > lease:
            return None
        return node

    def release(self, placement: Placement) -> None:
        """Give back the room ``place`` reserved (idempotent)."""
        self.quota.release(placement.reservation)

    def all_nodes(self) -> list[Node]:
        """Every node of the cluster, as the store has them."""
        return self.nodes.all()

    def records_of(self, owner: str) -> list[SandboxRecord]:
        """``owner``'s sandboxes on every node, as the store has them."""
        return self.store.of_owner(owner)

    def node(self, node_id: str) -> Node | None:
        """A node of the cluster by id, as the store has it (None: no such node)."""
        return self.nodes.get(node_id)

    def place(self, owner: str, image: str, count: int, memory_mib: int) -> Placement:
        return self.quota.place(owner, image, count, memory_mib)

    def take_over(self, loc: Location) -> Sandbox | None:
        """Make a hibernated sandbox of a dead or draining node this node's; None if another
        node took it first, or this node lacks its image build."""
        rec = loc.record
        if not self._has_build(rec):  # builds are content-addressed: the same key, the same image
            return None
        domain = self.ctx.vms.new_name()
        if not self.store.take_over(rec.id, rec.node, domain):
            return None
        rec.node, rec.domain = self.id, domain
        sbx = Sandbox(rec)
        self.ctx.registry.add(sbx)
        log.info("cluster.took_over", sandbox_id=rec.id, from_node=loc.node.id if loc.node else None)
        return sbx

    def wake_node(self, loc: Location) -> Node | None:
        """Where a movable sandbox should wake: the live, undrained node with its exact build and
        the most room (None: no node has both)."""
        rec = loc.record
        for node, room in self.quota.candidates(rec.template, rec.image_key):
            if room >= rec.memory_mib:
                return node
        return None

    def _has_build(self, rec: SandboxRecord) -> bool:
        try:
            self.ctx.images.get_by_key(rec.template, rec.image_key)
        except Exception:
            return False
        return True

    def set_draining(self, node_id: str, draining: bool) -> bool:
        if node_id == self.id:
            self.draining = draining
        return self.nodes.set_draining(node_id, draining)


def _meminfo() -> tuple[int, int]:
    """The host's total and available memory, in MiB."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                found[name] = int(rest.split()[0]) // 1024
    return found.get("MemTotal", 0), found.get("MemAvailable", 0)
