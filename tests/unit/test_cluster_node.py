"""A cluster node's own bookkeeping, on a SQLite store (the SQL is the same on PostgreSQL, whose
tests are in test_store_backends.py): what a node forgets when it comes back after its lease,
what it keeps when it comes back within it, and the memory of where other nodes' sandboxes are
that lets a forward skip the store."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kernelhost.config import Settings
from kernelhost.sandboxes.cluster import Figures, Membership
from kernelhost.sandboxes.context import Context
from kernelhost.sandboxes.registry import Quota, Registry, VmShape, new_record
from kernelhost.sandboxes.states import SandboxState
from kernelhost.sandboxes.store.db import SQLite
from kernelhost.sandboxes.store.sandboxes import Store

pytestmark = pytest.mark.unit

LEASE = 5.0


def _node(tmp_path: Path, name: str = "n1") -> tuple[Membership, Store]:
    store = Store(SQLite(tmp_path / "db.sqlite3"), name)
    settings = Settings(state_dir=tmp_path, node_id=name, node_lease_seconds=LEASE)
    ctx = SimpleNamespace(settings=settings, registry=Registry(store, Quota(10, 1 << 20)), accel="tcg")
    return Membership(cast(Context, ctx), store), store


def _sandbox(store: Store, state: SandboxState, n: int) -> str:
    rec = new_record(
        owner="key_a",
        template="python",
        domain=f"kh-{n}",
        image_key="k",
        shape=VmShape(512, 1, "tcg"),
        idle_timeout=600,
        metadata={},
        network={"mode": "none", "allow": []},
    )
    rec.state = state
    store.insert(rec)
    return rec.id


def _beat(node: Membership, name: str, ago: float = 0.0, draining: bool = False) -> None:
    node.nodes.heartbeat(name, f"http://{name}:8999", Figures(memory_mib=4096), fresh=True)
    node.nodes.db.execute(
        "UPDATE nodes SET heartbeat_at = heartbeat_at - ?, draining = ? WHERE id = ?",
        (ago, int(draining), name),
    )


def test_a_node_back_after_its_lease_forgets_what_the_cluster_gave_up(tmp_path: Path) -> None:
    node, store = _node(tmp_path)
    running = _sandbox(store, SandboxState.RUNNING, 1)
    hibernated = _sandbox(store, SandboxState.HIBERNATED, 2)
    _beat(node, "n1", ago=LEASE * 3)  # its last heartbeat, long before this start
    node.rejoin()
    assert store.get(running) is None, "its VM was given up: the reconcile that follows destroys it"
    assert store.get(hibernated) is not None, "a hibernated sandbox can still wake (here or elsewhere)"


def test_a_node_back_within_its_lease_keeps_its_sandboxes(tmp_path: Path) -> None:
    node, store = _node(tmp_path)
    running = _sandbox(store, SandboxState.RUNNING, 1)
    _beat(node, "n1", ago=LEASE / 2)
    node.rejoin()
    assert store.get(running) is not None


def test_a_new_node_rejoins_nothing(tmp_path: Path) -> None:
    node, store = _node(tmp_path)
    running = _sandbox(store, SandboxState.RUNNING, 1)
    node.rejoin()  # no row of its own yet: a first start
    assert store.get(running) is not None


def _peers_read(node: Membership, ago: float = 0.0) -> None:
    """What the heartbeat loop does after each beat: the node table, read now (or ``ago``)."""
    read: Any = node
    read._peers = {n.id: n for n in node.nodes.all()}
    read._peers_read_at = time.time() - ago


def test_a_located_sandbox_is_forwarded_from_memory_while_its_node_lives(tmp_path: Path) -> None:
    node, store = _node(tmp_path)
    other = Store(store.db, "n2")
    sid = _sandbox(other, SandboxState.RUNNING, 1)
    _beat(node, "n2")
    assert node.peer_of(sid, "key_a") is None, "never located: the store is asked"
    loc = node.locate(sid)
    assert loc is not None and loc.node is not None and loc.node.id == "n2"
    _peers_read(node)
    found = node.peer_of(sid, "key_a")
    assert found is not None and found.id == "n2"
    assert node.peer_of(sid, "key_b") is None, "another key's sandbox is never forwarded from memory"
    _peers_read(node, ago=LEASE)  # the node table is older than half a lease: ask again
    assert node.peer_of(sid, "key_a") is None
    _beat(node, "n2", ago=LEASE * 2)  # its node is past its lease
    _peers_read(node)
    assert node.peer_of(sid, "key_a") is None
    _beat(node, "n2", draining=True)  # a draining node's hibernated sandboxes move
    _peers_read(node)
    assert node.peer_of(sid, "key_a") is None
