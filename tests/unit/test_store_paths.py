"""Issue 35, finding 12: paths a node reads from the shared store resolve inside its own
directories, or are refused (and logged). The cluster tier mounts the checkpoint case through a
real node (tests/cluster/test_between_nodes.py); these are the hibernation file's cases, and the
checkpoint files' checks on their own."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kernelhost.sandboxes.context import Context
from kernelhost.sandboxes.errors import StoreRowRefused
from kernelhost.sandboxes.vm.saves import CheckpointFiles

pytestmark = pytest.mark.unit


def _hibernation_file(directory: Path, sandbox_id: str) -> Path:
    ctx: Any = SimpleNamespace(settings=SimpleNamespace(hibernate_dir=directory))
    return Context.hibernation_file(ctx, SimpleNamespace(id=sandbox_id))  # type: ignore[arg-type]


def test_a_hibernation_file_lies_directly_in_hibernate_dir(tmp_path: Path) -> None:
    assert _hibernation_file(tmp_path, "sbx_0123") == tmp_path / "sbx_0123.state"
    (tmp_path / "sbx_link.state").symlink_to("/etc/passwd")
    for bad in ("../../etc/x", "sbx_1/../../x", "sbx_link"):
        with pytest.raises(StoreRowRefused, match="outside this node's hibernate_dir"):
            _hibernation_file(tmp_path, bad)


def _files(tmp_path: Path) -> CheckpointFiles:
    files = CheckpointFiles.__new__(CheckpointFiles)
    files.dir = tmp_path / "checkpoints"
    files.vms = SimpleNamespace(snapshots=SimpleNamespace(dir=tmp_path / "templates"))
    return files


def test_checkpoint_files_and_bases_must_be_this_nodes(tmp_path: Path) -> None:
    files = _files(tmp_path)
    mine = files.path_for("sbx_1", "cp_1")
    assert files.own(mine, "cp_1") == mine
    assert files.own_base({"path": str(tmp_path / "templates" / "python-x")}, "cp_1") is not None
    assert files.own_base({}, "cp_1") is None
    with pytest.raises(StoreRowRefused, match="outside this node's checkpoint_dir"):
        files.own(tmp_path / "elsewhere.zst", "cp_1")
    with pytest.raises(StoreRowRefused, match="not one of this node's"):
        files.own_base({"path": "/etc"}, "cp_1")


def test_removing_a_foreign_checkpoint_row_deletes_nothing(tmp_path: Path) -> None:
    victim = tmp_path / "precious"
    victim.write_text("x")
    (tmp_path / "pins").mkdir()
    (tmp_path / "pins" / "cp_1").write_text("y")
    _files(tmp_path).remove(victim, "cp_1", {"path": str(tmp_path)})
    assert victim.exists() and (tmp_path / "pins" / "cp_1").exists()
