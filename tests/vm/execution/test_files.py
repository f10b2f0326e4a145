"""Files through a real VM: 100 MB byte for byte, small text, errors and limits, the sync SDK."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kernelhost import AsyncSandbox, Sandbox
from kernelhost.client import InvalidRequestError, NotFoundError

from ...harness import Service
from .common import MAX_FILE

pytestmark = pytest.mark.vm


async def test_100_mb_file_round_trips_byte_for_byte(py: AsyncSandbox, tmp_path: Path) -> None:
    size = 100 * 1000 * 1000
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(size))
    want = hashlib.sha256(source.read_bytes()).hexdigest()
    with source.open("rb") as f:
        info = await py.files.write("data/big.bin", f)
    assert info.path == "/home/user/data/big.bin" and info.size == size
    seen = await py.run_code(
        "import hashlib\nhashlib.sha256(open('data/big.bin', 'rb').read()).hexdigest()", timeout=300
    )
    assert seen.text == repr(want)
    target = tmp_path / "back.bin"
    assert await py.files.download("data/big.bin", target) == size
    assert hashlib.sha256(target.read_bytes()).hexdigest() == want
    listing = await py.files.list("data")
    assert [(e.name, e.type, e.size) for e in listing] == [("big.bin", "file", size)]
    await py.files.remove("data", recursive=True)


async def test_files_small_text_errors_and_limits(py: AsyncSandbox, execution_service: Service) -> None:
    await py.files.write("notes/a.txt", "héllo\n")
    assert await py.files.read_text("notes/a.txt") == "héllo\n"
    assert (await py.run_code("open('notes/a.txt').read()")).text == "'héllo\\n'"
    produced = await py.run_code("open('made_by_code.csv', 'w').write('a,b\\n1,2\\n')")
    assert produced.error is None
    assert await py.files.read("made_by_code.csv") == b"a,b\n1,2\n"
    with pytest.raises(NotFoundError) as missing:
        await py.files.read("no/such/file.txt")
    assert "no/such/file.txt" in str(missing.value)
    with pytest.raises(NotFoundError):
        await py.files.remove("no/such/file.txt")
    with pytest.raises(InvalidRequestError) as not_empty:
        await py.files.remove("notes")
    assert "recursive" in str(not_empty.value)
    with pytest.raises(InvalidRequestError) as is_dir:
        await py.files.read("notes")
    assert "directory" in str(is_dir.value)
    await py.files.remove("notes", recursive=True)
    assert "notes" not in [e.name for e in await py.files.list()]
    # over max_file_bytes: a sparse file is refused before a byte moves, naming the limit
    await py.run_code(f"open('/tmp/huge', 'wb').truncate({MAX_FILE + 1})")
    with pytest.raises(Exception) as too_big:
        await py.files.read("/tmp/huge")
    assert getattr(too_big.value, "status", None) == 413 and "max_file_bytes" in str(too_big.value)

    async def endless() -> AsyncIterator[bytes]:
        yield b"\0" * 1024
        await asyncio.sleep(60)  # the answer must come before the body does

    auth = {"Authorization": f"Bearer {execution_service.api_key}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        r = await asyncio.wait_for(
            http.put(
                f"{execution_service.url}/v1/sandboxes/{py.id}/files",
                params={"path": "x.bin"},
                data=endless(),
                headers={"Content-Length": str(MAX_FILE + 1)},
            ),
            30,
        )
        assert r.status == 413, await r.text()
        assert "max_file_bytes" in (await r.json())["error"]["message"]
        r = await http.get(f"{execution_service.url}/v1/sandboxes/{py.id}/files")
        assert r.status == 400 and "path" in (await r.json())["error"]["message"]
    await py.files.write("plain.txt", b"a file")
    with pytest.raises(InvalidRequestError) as not_dir:  # a parent is a file
        await py.files.write("plain.txt/child.txt", b"nope")
    assert any(code in str(not_dir.value) for code in ("ENOTDIR", "EEXIST"))
    assert [e.name for e in await py.files.list() if e.name.startswith(".")] == []


def test_sync_files_and_bash(execution_service: Service) -> None:
    with Sandbox(url=execution_service.url, api_key=execution_service.api_key) as sbx:
        sbx.files.write("hello.txt", b"from sync")
        assert sbx.files.read("hello.txt") == b"from sync"
        assert [e.name for e in sbx.files.list()] == ["hello.txt"]
        assert sbx.run_code("cat hello.txt", language="bash").stdout == "from sync"
