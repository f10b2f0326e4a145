"""The cluster's queries on the sandboxes table, which the store owns (store/sandboxes.py): a
take-over of a hibernated sandbox (once, by one node) and which records are still a node's."""

from __future__ import annotations

import pytest

from kernelhost.sandboxes.states import SandboxState
from kernelhost.sandboxes.store.db import Database
from kernelhost.sandboxes.store.sandboxes import Store
from tests.unit.test_store_backends import connect_again, make_record

pytestmark = pytest.mark.unit


def test_a_hibernated_sandbox_is_taken_over_once(db: Database) -> None:
    a, b = Store(db, node="a"), Store(db, node="b")
    asleep = make_record("key_a", state=SandboxState.HIBERNATED)
    running = make_record("key_a", state=SandboxState.RUNNING)
    a.insert(asleep)
    a.insert(running)
    assert not b.take_over(running.id, "a", "kh-b-1")  # a running one stays where its VM is
    assert not b.take_over(asleep.id, "c", "kh-b-1")  # not on the node it names
    assert b.take_over(asleep.id, "a", "kh-b-1")
    got = b.get(asleep.id)
    assert got is not None and (got.node, got.domain, got.state) == ("b", "kh-b-1", SandboxState.HIBERNATED)
    other = connect_again(db)
    try:
        assert not Store(other, node="c").take_over(asleep.id, "a", "kh-c-1")  # b has it now
    finally:
        other.close()
    assert a.still_here([asleep.id, running.id, "sbx_gone"]) == {running.id}
    assert b.still_here([asleep.id]) == {asleep.id} and b.still_here([]) == set()
