"""The SDK's execution-depth surface against a fake server: ``files``, the figures and verdicts on
``Execution``, ``interrupt()``/``restart()`` answers, and the sync twin ``Sandbox.files``."""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kernelhost import AsyncSandbox, FileInfo, Files, NotFoundError, Sandbox, TransportError
from kernelhost.client import AsyncFiles

from .offline import serving, serving_in_thread

pytestmark = pytest.mark.unit

KEY = "test-key"


class FakeFiles:
    """Sandboxes, each with an in-memory filesystem, behind the API's routes."""

    def __init__(self) -> None:
        self.url = ""
        self.files: dict[str, bytes] = {}
        self.puts: list[tuple[dict[str, str], str | None]] = []  # (query, Transfer-Encoding)
        self.end: dict[str, Any] = {"type": "end", "status": "ok"}
        self.cut_download = False
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/sandboxes", self._create)
        app.router.add_delete("/v1/sandboxes/{id}", self._delete)
        app.router.add_put("/v1/sandboxes/{id}/files", self._write)
        app.router.add_get("/v1/sandboxes/{id}/files", self._read)
        app.router.add_get("/v1/sandboxes/{id}/files/list", self._list)
        app.router.add_delete("/v1/sandboxes/{id}/files", self._remove)
        app.router.add_post("/v1/sandboxes/{id}/execute", self._execute)
        app.router.add_post("/v1/sandboxes/{id}/interrupt", self._interrupt)
        app.router.add_post("/v1/sandboxes/{id}/restart", self._restart)
        self.app = app

    @staticmethod
    def _abs(path: str) -> str:
        return path if path.startswith("/") else f"/home/user/{path}"

    async def _create(self, request: web.Request) -> web.Response:
        return web.json_response({"id": "sbx_1", "template": "python", "state": "running"}, status=201)

    async def _delete(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def _write(self, request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == f"Bearer {KEY}"
        self.puts.append((dict(request.query), request.headers.get("Transfer-Encoding")))
        path = self._abs(request.query["path"])
        self.files[path] = await request.read()
        return web.json_response({"path": path, "size": len(self.files[path])}, status=201)

    async def _read(self, request: web.Request) -> web.StreamResponse:
        path = self._abs(request.query["path"])
        if path not in self.files:
            return web.json_response(
                {"error": {"code": "file_not_found", "message": f"no such file or directory: {path!r}"}},
                status=404,
            )
        data = self.files[path]
        resp = web.StreamResponse(headers={"Content-Length": str(len(data))})
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2] if self.cut_download else data)
        if self.cut_download:
            assert request.transport is not None
            request.transport.close()  # what the service does when the guest fails mid-file
            return resp
        await resp.write_eof()
        return resp

    async def _list(self, request: web.Request) -> web.Response:
        where = self._abs(request.query["path"]).rstrip("/") if request.query["path"] != "." else "/home/user"
        entries = [
            {
                "name": p.rsplit("/", 1)[1],
                "path": p,
                "type": "file",
                "size": len(d),
                "modified_at": "2026-01-02T03:04:05.000Z",
            }
            for p, d in sorted(self.files.items())
            if p.rsplit("/", 1)[0] == where
        ]
        return web.json_response({"path": where, "entries": entries, "truncated": False})

    async def _remove(self, request: web.Request) -> web.Response:
        path = self._abs(request.query["path"])
        assert request.query["recursive"] in ("true", "false")
        if self.files.pop(path, None) is None:
            return web.json_response({"error": {"code": "file_not_found", "message": path}}, status=404)
        return web.Response(status=204)

    async def _execute(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await resp.write(json.dumps({"type": "stdout", "text": "x"}).encode() + b"\n")
        await resp.write(json.dumps(self.end).encode() + b"\n")
        await resp.write_eof()
        return resp

    async def _interrupt(self, request: web.Request) -> web.Response:
        return web.json_response({"interrupted": True})

    async def _restart(self, request: web.Request) -> web.Response:
        return web.json_response({"recovery": "vm_replaced", "sandbox": {"id": "sbx_1"}})


@pytest.fixture
async def fake() -> AsyncIterator[FakeFiles]:
    server = FakeFiles()
    async with serving(server):
        yield server


@pytest.fixture
async def sbx(fake: FakeFiles) -> AsyncIterator[AsyncSandbox]:
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sandbox:
        yield sandbox


async def test_write_accepts_bytes_text_files_and_async_iterables(sbx, fake, tmp_path):
    info = await sbx.files.write("a.bin", b"\x00\x01")
    assert info == FileInfo(name="a.bin", path="/home/user/a.bin", type="file", size=2)
    await sbx.files.write("t.txt", "héllo")
    assert fake.files["/home/user/t.txt"] == "héllo".encode()
    source = tmp_path / "src.bin"
    source.write_bytes(b"y" * 300_000)
    with source.open("rb") as f:
        await sbx.files.write("/tmp/from_file.bin", f)
    assert fake.files["/tmp/from_file.bin"] == b"y" * 300_000

    async def produce() -> AsyncIterator[bytes]:
        for i in range(3):
            yield bytes([i]) * 10

    await sbx.files.write("gen.bin", produce())
    assert fake.files["/home/user/gen.bin"] == b"\0" * 10 + b"\1" * 10 + b"\2" * 10
    assert fake.puts[-1][1] == "chunked"  # streamed, not buffered first
    assert [q["path"] for q, _ in fake.puts] == ["a.bin", "t.txt", "/tmp/from_file.bin", "gen.bin"]


async def test_large_bytes_and_bytearrays_are_streamed_without_a_warning(sbx, fake):
    big = bytes(range(256)) * 12_000  # 3 MB: aiohttp warns (an error here) about raw bodies
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await sbx.files.write("big.bin", big)
        await sbx.files.write("big2.bin", bytearray(big))
        await sbx.files.write("big3.bin", memoryview(big))
    for name in ("big.bin", "big2.bin", "big3.bin"):
        assert fake.files[f"/home/user/{name}"] == big


async def test_read_download_list_remove(sbx, fake, tmp_path):
    fake.files["/home/user/data.csv"] = b"a,b\n1,2\n"
    fake.files["/home/user/notes.txt"] = "ünïcode".encode()
    assert await sbx.files.read("data.csv") == b"a,b\n1,2\n"
    assert await sbx.files.read_text("notes.txt") == "ünïcode"
    target = tmp_path / "out.csv"
    assert await sbx.files.download("data.csv", target) == 8
    assert target.read_bytes() == b"a,b\n1,2\n"
    buf = io.BytesIO()
    assert await sbx.files.download("notes.txt", buf) == len("ünïcode".encode())
    listing = await sbx.files.list()
    assert [(e.name, e.size, e.type) for e in listing] == [("data.csv", 8, "file"), ("notes.txt", 9, "file")]
    assert listing[0].modified_at is not None and listing[0].modified_at.year == 2026
    await sbx.files.remove("data.csv")
    with pytest.raises(NotFoundError) as err:
        await sbx.files.read("data.csv")
    assert "data.csv" in str(err.value)
    with pytest.raises(NotFoundError):
        await sbx.files.remove("data.csv", recursive=True)


async def test_a_download_cut_short_raises_instead_of_returning_less(sbx, fake):
    fake.files["/home/user/big.bin"] = b"z" * 200_000
    fake.cut_download = True
    with pytest.raises(TransportError):
        await sbx.files.read("big.bin")


async def test_bad_arguments_are_refused_before_any_request(sbx, fake):
    with pytest.raises(ValueError, match="path"):
        await sbx.files.read("")
    with pytest.raises(TypeError, match="data must be"):
        await sbx.files.write("x", 42)
    assert fake.puts == []
    assert isinstance(sbx.files, AsyncFiles)


async def test_execution_carries_figures_verdict_and_recovery(sbx, fake):
    fake.end = {
        "type": "end",
        "status": "timeout",
        "execution_count": 3,
        "duration_ms": 2500.5,
        "cpu_ms": 2400.0,
        "peak_memory_bytes": 123456,
        "recovery": "kernel_restarted",
        "output_truncated": True,
        "exit_code": None,
    }
    execution = await sbx.run_code("while True: pass", timeout=2)
    assert (execution.status, execution.recovery, execution.output_truncated) == (
        "timeout",
        "kernel_restarted",
        True,
    )
    assert execution.wall_time_ms == execution.duration_ms == 2500.5
    assert execution.cpu_time_ms == 2400.0 and execution.peak_memory_bytes == 123456
    assert execution.exit_code is None
    fake.end = {"type": "end", "status": "error", "exit_code": 2, "duration_ms": 1.0}
    bash = await sbx.run_code("false", language="bash")
    assert bash.exit_code == 2 and bash.cpu_time_ms is None and bash.recovery is None


async def test_interrupt_and_restart_answers(sbx):
    assert await sbx.interrupt() is True
    assert await sbx.restart() == "vm_replaced"


@pytest.fixture
def threaded_fake() -> Iterator[FakeFiles]:
    server = FakeFiles()
    with serving_in_thread(server):
        yield server


def test_sync_files_are_derived_from_the_async_ones(threaded_fake: FakeFiles, tmp_path: Path) -> None:
    with Sandbox(url=threaded_fake.url, api_key=KEY) as sbx:
        assert isinstance(sbx.files, Files)
        sbx.files.write("s.txt", "sync")
        assert sbx.files.read("s.txt") == b"sync"
        assert [e.name for e in sbx.files.list()] == ["s.txt"]
        sbx.files.remove("s.txt")
        assert sbx.files.list() == []
        assert sbx.restart() == "vm_replaced"
    assert Files.write.__doc__ == AsyncFiles.write.__doc__
    assert Files.list.__qualname__ == "Files.list"
