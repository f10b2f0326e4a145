"""``AsyncFiles``: the files of one sandbox (``sandbox.files``), over the HTTP API.

The sandbox's filesystem is the one its code sees: a file written here can be opened by the
next ``run_code``, and a file the code wrote can be read here. Relative paths are under
``/home/user``, the kernel's working directory. Transfers are streamed in both directions, so
large files (hundreds of MB, up to the server's ``max_file_bytes``) do not need to fit in one
request. The synchronous ``Sandbox.files`` is derived from this class.
"""

from __future__ import annotations

import asyncio
import builtins
import io
import os
from collections.abc import AsyncIterable
from typing import IO, Any, Protocol

from kernelhost.client._exceptions import TransportError
from kernelhost.client._http import REQUEST_TIMEOUT, HTTPClient, sandbox_path
from kernelhost.client._models import FileInfo


class _FilesOwner(Protocol):
    """What ``AsyncFiles`` uses of its ``AsyncSandbox``."""

    _http: HTTPClient

    @property
    def id(self) -> str: ...

    def _ensure_open(self) -> None: ...


__all__ = ["FILE_TIMEOUT", "AsyncFiles", "FileData"]

#: Deadline for one file transfer (the whole body), in seconds.
FILE_TIMEOUT = 600.0
BYTES_IN_ONE_WRITE = 1 << 20  # larger bytes bodies are streamed from a BytesIO

#: What ``files.write`` accepts: bytes, text (written as UTF-8), a binary file object, or an
#: async iterable of bytes (streamed as it is produced).
FileData = bytes | bytearray | memoryview | str | IO[bytes] | AsyncIterable[bytes]


def _check_path(path: Any) -> str:
    if not isinstance(path, str) or not path:
        raise ValueError(
            f"path must be a non-empty string such as 'data.csv' or '/tmp/out.png', got {path!r}"
        )
    return path


class AsyncFiles:
    """Read, write, list and remove files in a sandbox; ``sandbox.files``."""

    def __init__(self, sandbox: _FilesOwner) -> None:
        self._sandbox = sandbox

    def _path(self, action: str = "") -> str:
        self._sandbox._ensure_open()
        return sandbox_path(self._sandbox.id, "files" + (f"/{action}" if action else ""))

    async def write(self, path: str, data: FileData, timeout: float = FILE_TIMEOUT) -> FileInfo:
        """Write ``data`` to ``path`` in the sandbox, replacing any file there (atomically:
        a failed upload leaves the old file, or none). Missing parent directories are made.

        ``data`` may be bytes, a str (written as UTF-8), a binary file object opened for
        reading, or an async iterable of bytes. Returns the written file's info.
        """
        url = self._path()
        _check_path(path)
        body: Any
        if isinstance(data, (str, bytes, bytearray, memoryview)):
            raw = (
                data.encode("utf-8")
                if isinstance(data, str)
                else data
                if isinstance(data, bytes)
                else bytes(data)
            )
            # a file object, so aiohttp streams it instead of warning about a large raw body
            body = io.BytesIO(raw) if len(raw) > BYTES_IN_ONE_WRITE else raw
        elif hasattr(data, "read") or hasattr(data, "__aiter__"):
            body = data
        else:
            raise TypeError(
                f"data must be bytes, str, a binary file object or an async iterable of bytes, "
                f"got {type(data).__name__}"
            )
        reply = await self._sandbox._http.request(
            "PUT", url, params={"path": path}, data=body, timeout=timeout
        )
        if not isinstance(reply, dict) or not isinstance(reply.get("path"), str):
            raise TransportError(f"PUT {url} answered without the written path: {reply!r:.300}")
        written = str(reply["path"])
        return FileInfo(
            name=written.rsplit("/", 1)[-1], path=written, type="file", size=int(reply.get("size") or 0)
        )

    async def read(self, path: str, timeout: float = FILE_TIMEOUT, max_bytes: int | None = None) -> bytes:
        """The bytes of the file at ``path``; ``NotFoundError`` (naming the path) if none.
        ``max_bytes``: refuse a larger file (``FileTooLargeError``) before reading any of it."""
        url = self._path()
        chunks: builtins.list[bytes] = []
        await self._sandbox._http.download(
            url, params={"path": _check_path(path)}, sink=chunks.append, timeout=timeout, max_bytes=max_bytes
        )
        return b"".join(chunks)

    async def read_text(self, path: str, encoding: str = "utf-8", timeout: float = FILE_TIMEOUT) -> str:
        """The file at ``path`` decoded as text (UTF-8 unless ``encoding`` says otherwise)."""
        return (await self.read(path, timeout=timeout)).decode(encoding)

    async def download(
        self, path: str, destination: str | os.PathLike[str] | IO[bytes], timeout: float = FILE_TIMEOUT
    ) -> int:
        """Stream the file at ``path`` into a local file (a path, or a binary file object)
        without holding it in memory; returns its size in bytes."""
        url = self._path()
        params = {"path": _check_path(path)}
        if hasattr(destination, "write"):
            out: IO[bytes] = destination  # type: ignore[assignment]
            return await self._sandbox._http.download(url, params=params, sink=out.write, timeout=timeout)
        f = await asyncio.to_thread(open, destination, "wb")
        try:
            return await self._sandbox._http.download(
                url, params=params, sink=lambda chunk: asyncio.to_thread(f.write, chunk), timeout=timeout
            )
        finally:
            await asyncio.to_thread(f.close)

    async def list(self, path: str = ".", timeout: float = REQUEST_TIMEOUT) -> builtins.list[FileInfo]:
        """The entries of the directory ``path`` (default: ``/home/user``), sorted by name."""
        url = self._path("list")
        reply = await self._sandbox._http.request(
            "GET", url, params={"path": _check_path(path)}, timeout=timeout
        )
        entries = reply.get("entries") if isinstance(reply, dict) else None
        if not isinstance(entries, builtins.list):
            raise TransportError(f"GET {url} answered without an 'entries' list: {reply!r:.300}")
        return [FileInfo.from_wire(entry) for entry in entries]

    async def remove(self, path: str, recursive: bool = False, timeout: float = REQUEST_TIMEOUT) -> None:
        """Remove the file (or empty directory; with ``recursive=True``, any directory) at
        ``path``; ``NotFoundError`` if there is nothing there."""
        url = self._path()
        await self._sandbox._http.request(
            "DELETE",
            url,
            params={"path": _check_path(path), "recursive": "true" if recursive else "false"},
            timeout=timeout,
        )
