"""How a save or load waits for QEMU's migration (hypervisor/migration.py), against a scripted
monitor: QEMU says ``completed`` before the VM has left ``finish-migrate``, and a resume in that
window fails ("Migration is not finalized yet": a checkpoint's 503 in CI)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hypervisor import migration

pytestmark = pytest.mark.unit


class Dom:
    def name(self) -> str:
        return "kh-test"


def _script(monkeypatch: pytest.MonkeyPatch, replies: dict[str, Iterator[dict[str, Any]]]) -> list[str]:
    asked: list[str] = []

    def qmp(dom: Any, command: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(command)
        return next(replies[command])

    monkeypatch.setattr(migration, "qmp", qmp)
    return asked


def test_a_completed_migration_is_over_only_once_the_vm_left_finish_migrate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runstates = iter([{"status": "finish-migrate"}] * 3 + [{"status": "postmigrate"}])
    asked = _script(
        monkeypatch,
        {
            "query-migrate": iter([{"status": "active"}, {"status": "completed", "total-time": 5}]),
            "query-status": runstates,
        },
    )
    info = migration._wait_migration(Dom(), timeout=5)
    assert info["total-time"] == 5
    assert asked == ["query-migrate", "query-migrate"] + ["query-status"] * 4
    assert next(runstates, None) is None  # it waited for postmigrate, not a step less


def test_a_vm_stuck_in_finish_migrate_fails_at_the_deadline_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _script(
        monkeypatch,
        {
            "query-migrate": iter([{"status": "completed"}]),
            "query-status": iter(lambda: {"status": "finish-migrate"}, None),
        },
    )
    with pytest.raises(migration.MigrationFailed, match="completed, the VM still finish-migrate"):
        migration._wait_migration(Dom(), timeout=0.05)


def test_a_failed_migration_names_qemus_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    _script(
        monkeypatch,
        {"query-migrate": iter([{"status": "failed", "error-desc": "No space left on device"}])},
    )
    with pytest.raises(migration.MigrationFailed, match="migration failed: No space left on device"):
        migration._wait_migration(Dom(), timeout=5)
