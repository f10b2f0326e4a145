"""File ops, confined to the agent's kernel directory (a temporary one here)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kernelhost.channel import protocol

from .conftest import Running
from .host import HostEnd

pytestmark = pytest.mark.unit


@pytest.fixture
def home(running: Running) -> Path:
    return Path(running.config.kernel_cwd)


async def test_write_read_stat_list_rename_remove(host: HostEnd, home: Path) -> None:
    written = await host.ok(protocol.Op.FS_WRITE, path="d/a.txt", offset=0, data=b"hello", create=True)
    assert written["path"] == str(home / "d" / "a.txt")  # relative: under the kernel's cwd
    await host.ok(protocol.Op.FS_WRITE, path="d/a.txt", offset=5, data=b" world")
    read = await host.ok(protocol.Op.FS_READ, path="d/a.txt", offset=0, length=100)
    assert read["data"] == b"hello world" and read["size"] == 11
    part = await host.ok(protocol.Op.FS_READ, path=str(home / "d/a.txt"), offset=6, length=3)
    assert part["data"] == b"wor"
    st = (await host.ok(protocol.Op.FS_STAT, path="d/a.txt"))["stat"]
    assert st["type"] == "file" and st["size"] == 11 and st["mode"] == 0o644
    await host.ok(protocol.Op.FS_WRITE, path="d/b.bin", offset=0, data=b"", create=True)
    listing = await host.ok(protocol.Op.FS_LIST, path="d")
    assert [e["name"] for e in listing["entries"]] == ["a.txt", "b.bin"]
    assert listing["truncated"] is False and listing["path"] == str(home / "d")
    renamed = await host.ok(protocol.Op.FS_RENAME, src="d/a.txt", dst="d/c.txt")
    assert renamed["path"] == str(home / "d" / "c.txt")
    assert (home / "d" / "c.txt").read_bytes() == b"hello world"
    await host.ok(protocol.Op.FS_REMOVE, path="d/c.txt")
    assert not (home / "d" / "c.txt").exists()
    not_empty = await host.ok(protocol.Op.FS_REMOVE, path="d")
    assert not_empty["oserror"]["errno"] == "ENOTEMPTY"
    await host.ok(protocol.Op.FS_REMOVE, path="d", recursive=True)
    assert not (home / "d").exists()


async def test_create_truncates(host: HostEnd, home: Path) -> None:
    await host.ok(protocol.Op.FS_WRITE, path="t.txt", offset=0, data=b"long text", create=True)
    await host.ok(protocol.Op.FS_WRITE, path="t.txt", offset=0, data=b"ab", create=True)
    assert (home / "t.txt").read_bytes() == b"ab"


@pytest.mark.parametrize(
    ("op", "fields", "errno_name"),
    [
        (protocol.Op.FS_READ, {"path": "missing", "offset": 0, "length": 1}, "ENOENT"),
        (protocol.Op.FS_STAT, {"path": "missing"}, "ENOENT"),
        (protocol.Op.FS_LIST, {"path": "missing"}, "ENOENT"),
        (protocol.Op.FS_REMOVE, {"path": "missing"}, "ENOENT"),
        (protocol.Op.FS_WRITE, {"path": "missing", "offset": 0, "data": b"x"}, "ENOENT"),
        (protocol.Op.FS_RENAME, {"src": "missing", "dst": "other"}, "ENOENT"),
        (protocol.Op.FS_READ, {"path": ".", "offset": 0, "length": 1}, "EISDIR"),
        (protocol.Op.FS_RENAME, {"src": "missing", "dst": "."}, "EISDIR"),
    ],
)
async def test_os_errors_are_answered_by_name(
    host: HostEnd, home: Path, op: str, fields: dict[str, Any], errno_name: str
) -> None:
    reply = await host.ok(op, **fields)
    err = reply["oserror"]
    assert err["errno"] == errno_name
    assert err["message"] and err["path"].startswith(str(home))


async def test_a_name_that_is_not_utf8_is_left_out_of_a_listing(host: HostEnd, home: Path) -> None:
    """msgpack strings are UTF-8: such a name would make the whole reply unsendable."""
    (home / "odd").mkdir()
    (home / "odd" / "fine").write_bytes(b"")
    os.close(os.open(os.path.join(os.fsencode(home / "odd"), b"bad\xff"), os.O_CREAT | os.O_WRONLY))
    listing = await host.ok(protocol.Op.FS_LIST, path="odd")
    assert [e["name"] for e in listing["entries"]] == ["fine"]
