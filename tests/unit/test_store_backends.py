"""The stores and the cluster's tables on both databases: SQLite (a file) and PostgreSQL (a
throwaway server from the distribution's packages, tests/pg.py; a database of its own per test).

The concurrency tests give each thread its own connection, as the nodes of a cluster have: only
the database's locks keep two creates from both passing a limit that only one fits.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

from kernelhost.sandboxes.cluster import ClusterQuota, Figures, NodeTable
from kernelhost.sandboxes.errors import CapacityExceeded, NodeFull
from kernelhost.sandboxes.registry import Quota, VmShape, new_record
from kernelhost.sandboxes.states import SandboxState
from kernelhost.sandboxes.store.checkpoints import CheckpointRecord, CheckpointStore, new_checkpoint_id
from kernelhost.sandboxes.store.db import Database, Params, PostgreSQL, SQLite, to_pyformat
from kernelhost.sandboxes.store.sandboxes import SandboxRecord, Store
from kernelhost.sandboxes.store.templates import TemplateRecord, TemplateStore

pytestmark = pytest.mark.unit

T = TypeVar("T")
GIB = 1 << 30
PLENTY = Quota(max_sandboxes=1000, max_memory_mib=1 << 30)


postgresql_only = pytest.mark.parametrize("db", ["postgresql"], indirect=True)


def connect_again(db: Database) -> Database:
    """Another connection to the same database (what another node, or another thread, holds)."""
    if isinstance(db, SQLite):
        return SQLite(db.path)
    assert isinstance(db, PostgreSQL)
    return PostgreSQL(db.url)


def make_record(
    owner: str,
    *,
    memory_mib: int = 512,
    state: SandboxState = SandboxState.RUNNING,
    created_at: float | None = None,
) -> SandboxRecord:
    rec = new_record(
        owner=owner,
        template="python",
        domain="kh-" + secrets.token_hex(6),
        image_key="img_1",
        shape=VmShape(memory_mib=memory_mib, vcpus=1, accel="kvm"),
        idle_timeout=600,
        metadata={"team": "core"},
        network={"mode": "none", "allow": []},
    )
    rec.state = state
    if created_at is not None:
        rec.created_at = rec.last_active_at = created_at
    return rec


def concurrently(calls: Sequence[Callable[[], T]]) -> list[T | BaseException]:
    """Run every call in a thread of its own, all released at once; each result or exception."""
    barrier = threading.Barrier(len(calls), timeout=30)

    def run(fn: Callable[[], T]) -> T:
        barrier.wait()
        return fn()

    out: list[T | BaseException] = []
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(run, fn) for fn in calls]
        for future in futures:
            exc = future.exception(timeout=60)
            out.append(exc if exc is not None else future.result())
    return out


def cluster(db: Database, nodes: dict[str, Figures], lease: float = 30.0) -> NodeTable:
    """The sandboxes and nodes tables, with ``nodes`` alive."""
    Store(db)
    table = NodeTable(db, lease_seconds=lease)
    for node_id, figures in nodes.items():
        table.heartbeat(node_id, f"http://{node_id}:8000", figures, fresh=True)
    return table


# -- the sandbox records ---------------------------------------------------------------------------


def test_store_insert_get_update_touch_delete(db: Database) -> None:
    here, there = Store(db, node="n1"), Store(db, node="n2")
    a = make_record("key_a", created_at=1_700_000_000.25)
    b = make_record("key_a", created_at=1_700_000_001.5)
    c = make_record("key_b", created_at=1_700_000_002.75)
    here.insert(a)
    there.insert(b)
    here.insert(c)
    assert here.get(a.id) == a and a.node == "n1"
    assert there.get(b.id) == b and b.node == "n2"
    assert here.get("sbx_nope") is None

    here.update(a.id, state=SandboxState.HIBERNATED, detail="idle", calls=3, auto_checkpoint=5)
    got = here.get(a.id)
    assert got is not None
    assert (got.state, got.detail, got.calls, got.auto_checkpoint) == (SandboxState.HIBERNATED, "idle", 3, 5)
    assert isinstance(got.state, SandboxState)

    here.touch(a.id, 1_700_000_100.5)
    got = here.get(a.id)
    assert got is not None and got.last_active_at == 1_700_000_100.5
    before = time.time()
    here.touch(c.id)
    got = here.get(c.id)
    assert got is not None and before <= got.last_active_at <= time.time()

    here.delete(c.id)
    assert here.get(c.id) is None
    if db.dialect == "postgresql":  # a shared store: a node's all() is its own records
        assert [r.id for r in here.all()] == [a.id]
        assert [r.id for r in there.all()] == [b.id]
    else:
        assert [r.id for r in here.all()] == [a.id, b.id]
    assert [r.id for r in here.of_owner("key_a")] == [a.id, b.id]  # every node's
    assert [r.id for r in there.of_owner("key_a")] == [a.id, b.id]
    assert here.of_owner("key_b") == []


def test_json_fields_round_trip(db: Database) -> None:
    store = Store(db, node="n1")
    rec = make_record("key_a")
    rec.metadata = {"ünïcode": "☃ snow", "quote": 'it\'s "x"', "pct": "100%", "colon": "a:b"}
    rec.network = {"mode": "allowlist", "allow": ["pypi.org", "*.github.com:443"]}
    store.insert(rec)
    got = store.get(rec.id)
    assert got is not None and (got.metadata, got.network) == (rec.metadata, rec.network)

    store.update(rec.id, network={"mode": "open", "allow": []}, metadata={})
    got = store.get(rec.id)
    assert got is not None and got.network == {"mode": "open", "allow": []} and got.metadata == {}


def test_timestamps_keep_sub_second_precision(db: Database) -> None:
    store = Store(db)
    when = 1_712_345_678.123456
    rec = make_record("key_a", created_at=when)
    store.insert(rec)
    store.touch(rec.id, when + 0.000789)
    got = store.get(rec.id)
    assert got is not None
    assert got.created_at == when
    assert got.last_active_at == when + 0.000789


OLD_SANDBOXES = """
CREATE TABLE sandboxes (
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
    detail TEXT NOT NULL DEFAULT ''
)
"""


def test_an_old_sandboxes_table_gains_the_new_columns(db: Database) -> None:
    db.script(OLD_SANDBOXES)
    added = {"network", "auto_checkpoint", "calls", "node"}
    assert not added & db.columns("sandboxes")
    db.execute(
        "INSERT INTO sandboxes (id, owner, template, domain, state, created_at, last_active_at, "
        "idle_timeout_seconds, memory_mib, vcpus, accel, image_key, metadata) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ("sbx_0", "key_a", "python", "kh-0", "hibernated", 1.5, 2.5, 600, 512, 1, "kvm", "img", '{"a":"b"}'),
    )
    store = Store(db)
    assert added <= db.columns("sandboxes")
    Store(db)  # a second start migrates nothing
    got = store.get("sbx_0")
    assert got is not None
    assert got.network == {"mode": "none", "allow": []}
    assert (got.auto_checkpoint, got.calls, got.node) == (0, 0, "")
    assert (got.state, got.metadata, got.created_at) == (SandboxState.HIBERNATED, {"a": "b"}, 1.5)
    assert [r.id for r in store.all()] == ["sbx_0"]
    store.insert(make_record("key_a"))  # and the new columns take values
    assert len(store.of_owner("key_a")) == 2


# -- templates and checkpoints ---------------------------------------------------------------------


def test_template_store_upserts_templates_and_builds(db: Database) -> None:
    store = TemplateStore(db)
    rec = TemplateRecord(owner="", name="data", spec={"from": "python", "pip": ["pandas"]}, state="building")
    store.put(rec)
    rec.state, rec.image_key, rec.build_id = "ready", "img_2", "bld_1"
    store.put(rec)
    got = store.get("", "data")
    assert got is not None
    assert (got.state, got.image_key, got.build_id, got.spec) == ("ready", "img_2", "bld_1", rec.spec)
    assert got.created_at == rec.created_at
    assert [t.name for t in store.all()] == ["data"]

    build: dict[str, Any] = {
        "id": "bld_1", "owner": "", "name": "data", "key": "img_2", "state": "running",
        "stage": "pip", "stages": ["from", "pip"], "error": None, "created_at": 10.25,
        "started_at": 11.5, "finished_at": None,
    }  # fmt: skip
    store.put_build(build)
    assert [b["id"] for b in store.unfinished_builds()] == ["bld_1"]
    store.put_build({**build, "state": "ready", "stage": "", "finished_at": 12.75})
    got_build = store.build("bld_1")
    assert got_build is not None
    assert (got_build["state"], got_build["stages"], got_build["error"]) == ("ready", ["from", "pip"], "")
    assert (got_build["started_at"], got_build["finished_at"]) == (11.5, 12.75)
    assert len(store.builds("", "data")) == 1 and store.unfinished_builds() == []
    store.delete("", "data")
    assert store.get("", "data") is None and store.build("bld_1") is None


def test_checkpoint_bytes_past_two_gib(db: Database) -> None:
    store = CheckpointStore(db)
    size = 3 * GIB  # past a 32-bit INTEGER: BIGINT on PostgreSQL
    for owner, n in (("key_a", size), ("key_a", size + 1), ("key_b", 7)):
        store.insert(
            CheckpointRecord(
                id=new_checkpoint_id(), sandbox_id="sbx_1", owner=owner, template="python",
                image_key="img_1", path="/cp/x", bytes=n, base={"dir": "/t", "at": 1.5},
            )
        )  # fmt: skip
    assert store.bytes_of("key_a") == 2 * size + 1 > 2**31
    assert store.bytes_of("key_b") == 7 and store.bytes_of("key_c") == 0
    first = store.of_owner("key_a")[0]
    got = store.get(first.id)
    assert got is not None and got.bytes == first.bytes >= size and got.base == {"dir": "/t", "at": 1.5}


def test_percent_and_colon_inside_literals(db: Database) -> None:
    assert to_pyformat("SELECT '5%:x' AS a, ? AS b, 7 % 2 AS c, 1::float8 AS d, 'it''s :n' AS e") == (
        "SELECT '5%%:x' AS a, %s AS b, 7 %% 2 AS c, 1::float8 AS d, 'it''s :n' AS e"
    )
    assert to_pyformat("SELECT :name AS a, '50%' AS b") == "SELECT %(name)s AS a, '50%%' AS b"
    assert db.one("SELECT '5%:x' AS a, ? AS b, 7 % ? AS c", ("y", 4)) == {"a": "5%:x", "b": "y", "c": 3}
    assert db.one("SELECT 'it''s :n 100%' AS a, :v AS b", {"v": 2}) == {"a": "it's :n 100%", "b": 2}
    # without parameters: the text goes to the server as it is
    assert db.one("SELECT '50%' AS a, 'a:b' AS b, 7 % 4 AS c") == {"a": "50%", "b": "a:b", "c": 3}


# -- the cluster's nodes ---------------------------------------------------------------------------


def test_nodes_heartbeat_age_lease_and_draining(db: Database) -> None:
    nodes = NodeTable(db, lease_seconds=2)
    python = {"python": "img_1"}
    figures = Figures(memory_mib=4096, committed_mib=512, sandboxes=1, templates=python, accel="kvm")
    nodes.heartbeat("a", "http://a:8000", figures, fresh=True)
    nodes.heartbeat("b", "http://b:8000", Figures(memory_mib=2048), fresh=True)
    a = nodes.get("a")
    assert a is not None and a.alive and -0.05 <= a.age < 1.0
    assert (a.url, a.memory_mib, a.committed_mib, a.sandboxes) == ("http://a:8000", 4096, 512, 1)
    assert (a.templates, a.accel) == (python, "kvm")
    db_now = float(db.scalar(f"SELECT {db.now} AS t"))
    assert abs(db_now - time.time()) < 5 and abs(a.heartbeat_at - db_now) < 1.0

    # ages are the database's clock minus the stored heartbeat: set it back instead of sleeping
    db.execute("UPDATE nodes SET heartbeat_at = heartbeat_at - 10 WHERE id = ?", ("b",))
    b = nodes.get("b")
    assert b is not None and not b.alive and 10.0 <= b.age < 11.0
    assert [n.id for n in nodes.live()] == ["a"] and [n.id for n in nodes.all()] == ["a", "b"]
    assert nodes.get("b") is not None and b.to_dict()["heartbeat_age_seconds"] >= 10
    nodes.heartbeat("b", "http://b:8001", Figures(memory_mib=8192))  # back: not a restart
    b2 = nodes.get("b")
    assert b2 is not None and b2.alive and b2.memory_mib == 8192 and b2.url == "http://b:8001"
    assert b2.started_at == b.started_at

    assert nodes.set_draining("a", True)
    nodes.heartbeat("a", "http://a:8000", figures)  # a heartbeat keeps it draining
    a = nodes.get("a")
    assert a is not None and a.draining
    nodes.heartbeat("a", "http://a:8000", figures, fresh=True)  # a restarted node takes sandboxes again
    a = nodes.get("a")
    assert a is not None and not a.draining
    assert not nodes.set_draining("nope", True)
    nodes.forget("b")
    assert nodes.get("b") is None


# -- the cluster's limits --------------------------------------------------------------------------


@postgresql_only
def test_concurrent_takes_across_nodes_never_pass_the_key_limit(db: Database) -> None:
    node_ids = ["a", "b", "c"]
    cluster(db, {n: Figures(memory_mib=1 << 20) for n in node_ids})
    conns = [connect_again(db) for _ in range(20)]
    try:
        limit = Quota(max_sandboxes=5, max_memory_mib=1 << 30)
        quotas = [ClusterQuota(c, NodeTable(c, 30), node_ids[i % 3], limit, 60) for i, c in enumerate(conns)]
        results = concurrently(
            [functools.partial(q.take, "key_x", node_ids[i % 3], 1, 256) for i, q in enumerate(quotas)]
        )
    finally:
        for c in conns:
            c.close()
    won = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if not isinstance(r, str)]
    assert len(won) == 5, results
    assert len(refused) == 15
    for exc in refused:
        assert type(exc) is CapacityExceeded, exc
        assert exc.details["limit"] == "max_sandboxes_per_key" and "max_sandboxes_per_key" in str(exc)
    assert int(db.scalar("SELECT COUNT(*) AS n FROM reservations WHERE owner = ?", ("key_x",))) == 5


def test_concurrent_takes_never_overbook_a_node(db: Database) -> None:
    cluster(db, {"a": Figures(memory_mib=2048)})
    conns = [connect_again(db) for _ in range(10)]
    try:
        quotas = [ClusterQuota(c, NodeTable(c, 30), "a", PLENTY, 60) for c in conns]
        takes = [functools.partial(q.take, f"key_{i}", "a", 1, 512) for i, q in enumerate(quotas)]
        results = concurrently(takes)
    finally:
        for c in conns:
            c.close()
    won = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if not isinstance(r, str)]
    assert len(won) == 4, results  # 4 x 512 MiB fill the node; the others wait for its row, then see it full
    for exc in refused:
        assert type(exc) is NodeFull and exc.details["limit"] == "node_memory", exc
    reserved = db.scalar("SELECT COALESCE(SUM(memory_mib), 0) AS m FROM reservations WHERE node = ?", ("a",))
    assert int(reserved) == 2048


class Interleaved(PostgreSQL):
    """A connection that runs ``between`` once, right after its first statement containing
    ``read``: what another create may commit while a take is in the middle of its transaction."""

    def __init__(self, url: str, read: str) -> None:
        super().__init__(url)
        self.read = read
        self.between: Callable[[], None] | None = None

    def _run(self, sql: str, params: Params) -> list[dict[str, Any]]:
        rows = super()._run(sql, params)
        if self.between is not None and self.read in sql:
            between, self.between = self.between, None
            between()
        return rows


@postgresql_only
@pytest.mark.parametrize("limit", ["max_sandboxes_per_key", "node_memory"])
def test_a_record_replacing_its_reservation_during_a_take_counts_once(db: Database, limit: str) -> None:
    """Another create's record() (its record in, its reservation's share out, one commit) lands
    between a take's reads: the take counts that sandbox once, not in neither."""
    assert isinstance(db, PostgreSQL)
    by_key = limit == "max_sandboxes_per_key"
    nodes = cluster(db, {"a": Figures(memory_mib=1 << 20 if by_key else 512)})
    quota = Quota(max_sandboxes=1, max_memory_mib=1 << 20) if by_key else PLENTY
    other = ClusterQuota(db, nodes, "a", quota, 60)
    conn = Interleaved(db.url, "FROM sandboxes WHERE owner" if by_key else "FROM sandboxes WHERE node")
    try:
        take = ClusterQuota(conn, NodeTable(conn, 30), "a", quota, 60).take
        with other.reserve("key_o", 1, 512):
            conn.between = functools.partial(other.record, Store(db, node="a"), make_record("key_o"))
            with pytest.raises(CapacityExceeded) as exc:
                take("key_o" if by_key else "key_p", "a", 1, 512)
            assert conn.between is None  # the other create's record went in meanwhile
    finally:
        conn.close()
    assert exc.value.details["limit"] == limit


def test_a_dead_nodes_running_sandboxes_stop_counting(db: Database) -> None:
    nodes = cluster(db, {"a": Figures(memory_mib=8192), "b": Figures(memory_mib=8192)}, lease=2)
    on_b = Store(db, node="b")
    on_b.insert(make_record("key_d", state=SandboxState.RUNNING))
    on_b.insert(make_record("key_d", state=SandboxState.HIBERNATED))
    quota = ClusterQuota(db, nodes, "a", Quota(max_sandboxes=2, max_memory_mib=1 << 20), 60)
    assert quota.usage("key_d") == {"sandboxes": 2}
    with pytest.raises(CapacityExceeded) as exc:
        quota.take("key_d", "a", 1, 512)
    assert exc.value.details["limit"] == "max_sandboxes_per_key"

    db.execute("UPDATE nodes SET heartbeat_at = heartbeat_at - 10 WHERE id = ?", ("b",))  # b died
    assert quota.usage("key_d") == {"sandboxes": 1}  # its hibernated sandbox can wake elsewhere
    quota.take("key_d", "a", 1, 512)
    with pytest.raises(CapacityExceeded):
        quota.take("key_d", "a", 1, 512)  # the hibernated one and the reservation: 2


def test_records_under_a_reservation_take_their_share_out_of_it(db: Database) -> None:
    nodes = cluster(db, {"a": Figures(memory_mib=8192)})
    store = Store(db, node="a")
    quota = ClusterQuota(db, nodes, "a", Quota(max_sandboxes=3, max_memory_mib=1 << 20), 60)
    with quota.reserve("key_r", 2, 256):
        for _ in range(2):
            quota.record(store, make_record("key_r", memory_mib=256))
        row = db.one("SELECT count, memory_mib FROM reservations WHERE owner = ?", ("key_r",))
        assert row is not None and (int(row["count"]), int(row["memory_mib"])) == (0, 0)
        outcomes: list[str] = []
        for _ in range(3):
            try:
                quota.take("key_r", "a", 1, 256)
                outcomes.append("taken")
            except CapacityExceeded as exc:
                assert exc.details["limit"] == "max_sandboxes_per_key"
                outcomes.append("refused")
        assert outcomes == ["taken", "refused", "refused"]  # 2 records + 1 reservation = the limit
    assert int(db.scalar("SELECT COUNT(*) AS n FROM reservations")) == 1  # reserve() released its own
    assert [r.node for r in store.of_owner("key_r")] == ["a", "a"]


def test_place_spreads_over_live_undrained_nodes_with_the_template(db: Database) -> None:
    python = {"python": "img_1"}
    nodes = cluster(
        db,
        {
            "a": Figures(memory_mib=4096, templates=python),
            "b": Figures(memory_mib=4096, templates=python),
            "c": Figures(memory_mib=4096, templates=python),
            "d": Figures(memory_mib=65536, templates={"r": "img_9"}),  # the most room, not the template
            "e": Figures(memory_mib=65536, templates=python),  # draining
            "f": Figures(memory_mib=65536, templates=python),  # dead
        },
        lease=2,
    )
    nodes.set_draining("e", True)
    db.execute("UPDATE nodes SET heartbeat_at = heartbeat_at - 10 WHERE id = ?", ("f",))
    quota = ClusterQuota(db, nodes, "a", PLENTY, 60)
    assert [n.id for n, _ in quota.candidates("python")] == ["a", "b", "c"]
    assert quota.candidates("python", key="img_other") == []

    first = [quota.place(f"key_{i}", "python", 1, 512).node.id for i in range(3)]
    assert sorted(first) == ["a", "b", "c"]  # each placement sees the others' reservations
    more = [quota.place(f"key_{i}", "python", 1, 512).node.id for i in range(6)]
    assert sorted(more) == ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(NodeFull) as exc:
        quota.place("key_z", "python", 1, 4096)  # no candidate has 4 GiB left
    assert exc.value.details["limit"] == "cluster_capacity"
    assert quota.place("key_z", "r", 1, 512).node.id == "d"  # the one node with that template


@postgresql_only
def test_concurrent_placements_spread_instead_of_giving_up(db: Database) -> None:
    """Ten creates read the same candidates (thirty nodes, each with room for one more): they do
    not all try the same three nodes and give up while the cluster has room."""
    node_ids = [f"n{i:02d}" for i in range(30)]
    cluster(db, {n: Figures(memory_mib=512, templates={"python": "img_1"}) for n in node_ids})
    conns = [connect_again(db) for _ in range(10)]
    try:
        quotas = [ClusterQuota(c, NodeTable(c, 30), "n00", PLENTY, 60) for c in conns]
        places = [functools.partial(q.place, f"key_{i}", "python", 1, 512) for i, q in enumerate(quotas)]
        results = concurrently(places)
    finally:
        for c in conns:
            c.close()
    placed = [r.node.id for r in results if not isinstance(r, BaseException)]
    assert len(placed) >= 7, results  # in the most-room order alone, three would (a refusal is ~3%)
    assert len(set(placed)) == len(placed)  # and never two on a node with room for one
