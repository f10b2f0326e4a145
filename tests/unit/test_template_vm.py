"""The host's side of a template's build VM, without a VM: what it takes from the VM (the
script's output as untrusted lines, its report, the layer as bytes from the scratch disk), and
where the VM's network may go (the host's apt sources and pip indexes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernelhost.sandboxes.network.indexes import apt_source_urls
from kernelhost.sandboxes.templates.build_vm import (
    EROFS_MAGIC,
    INFO_MAX,
    LINE_MAX,
    _Lines,
    _take_layer,
    checked_info,
)
from kernelhost.sandboxes.templates.builds import BuildFailed

pytestmark = pytest.mark.unit

GOOD: dict[str, Any] = {
    "kernel": "kernelhost",
    "language": "python",
    "display_name": "Python 3",
    "resolved": {"apt": {"jq": "1.6"}, "pip": {"tomli-w": "1.2.0"}},
    "layer_bytes": 8192,
    "build_seconds": 12.34,
}


def test_output_lines_become_events_and_anything_else_is_a_log_line() -> None:
    lines = _Lines()
    assert lines.feed('{"stage": "pip", "detail": "x"}\n{"log": "a') == [{"stage": "pip", "detail": "x"}]
    assert lines.feed('b"}\nplain text\n[1, 2]\n{"evil": 1}\n') == [
        {"log": "ab"},
        {"log": "plain text"},
        {"log": "[1, 2]"},
        {"log": '{"evil": 1}'},
    ]
    assert lines.feed('{"done": {"kernel": "k"}, "extra": 1}') == []
    assert lines.flush() == [{"done": {"kernel": "k"}}]
    # a line that never ends is cut, not held
    flood = _Lines().feed("x" * (INFO_MAX + 10))
    assert flood == [{"log": "x" * LINE_MAX}]
    assert len(_Lines().feed(f'{{"log": "{"y" * (LINE_MAX * 2)}"}}\n')[0]["log"]) == LINE_MAX


def test_the_report_keeps_only_checked_fields() -> None:
    info = checked_info({**GOOD, "resolved": {"apt": {"x" * 500: "1"}, "pip": "no"}, "surprise": [1]})
    assert set(info) == {"kernel", "language", "display_name", "resolved", "layer_bytes", "build_seconds"}
    assert info["resolved"] == {"apt": {"x" * 200: "1"}, "pip": {}}
    for bad in (
        {"kernel": ""},
        {"kernel": 3},
        {"layer_bytes": -1},
        {"layer_bytes": True},
        {"language": "l" * 65},
    ):
        with pytest.raises(BuildFailed):
            checked_info({**GOOD, **bad})


def _disk(tmp_path: Path, content: bytes, size: int = 1 << 20) -> Path:
    disk = tmp_path / "layer.disk"
    with disk.open("wb") as f:
        f.truncate(size)
        f.write(content)
    return disk


def test_the_layer_is_the_first_layer_bytes_of_the_disk_with_an_erofs_magic(tmp_path: Path) -> None:
    head = bytearray(8192)
    head[EROFS_MAGIC[0] : EROFS_MAGIC[0] + 4] = EROFS_MAGIC[1]
    layer = _take_layer(_disk(tmp_path, bytes(head)), {"layer_bytes": 8192}, max_mib=1)
    assert layer.name == "layer.erofs" and layer.read_bytes() == bytes(head)
    with pytest.raises(BuildFailed, match="no erofs layer"):
        _take_layer(_disk(tmp_path, b"\0" * 8192), {"layer_bytes": 8192}, max_mib=1)
    with pytest.raises(BuildFailed, match="template_layer_max_mib"):
        _take_layer(_disk(tmp_path, bytes(head)), {"layer_bytes": 2 << 20}, max_mib=1)


def test_the_build_vms_apt_hosts_come_from_the_hosts_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb http://mirror.example/debian bookworm main\n"
        "deb-src [arch=amd64] https://src.example/d x y\ndeb file:///srv/local ./\n"
    )
    (tmp_path / "sources.list.d" / "extra.sources").write_text(
        "Types: deb\nURIs: http://deb.example/debian http://two.example/d\nSuites: bookworm\n"
    )
    (tmp_path / "sources.list.d" / "ignored.txt").write_text("deb http://nope.example/ x\n")
    assert apt_source_urls(tmp_path) == [
        "http://mirror.example/debian",
        "https://src.example/d",
        "http://deb.example/debian",
        "http://two.example/d",
    ]
