"""File operations of a sandbox: chunked, windowed transfers over the agent channel.

``FileService``: write (atomic, size-limited, streamed), read (stat first, then windowed chunk
reads), list and remove, with the guest's OS errors mapped to the service's errors (no such
path, named; a full disk). A file call does not queue behind a running execution; it wakes a
hibernated sandbox and waits for a VM replacement in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ...channel import AgentError, ChannelClosed, ChannelTimeout, NotSupportedByAgent
from ...channel.protocol import Op
from ...config import Settings
from ..errors import (
    AgentUnresponsive,
    FileOperationFailed,
    FileTooLarge,
    InvalidRequest,
    NotSupportedByImage,
    PathNotFound,
    Remedy,
    SandboxDiskFull,
    SandboxError,
    SandboxNotRunning,
)
from ..sandbox import Sandbox, ensure_usable, iso_time

#: ``Hibernation.wait_for_vm``: wait for a VM change in flight and wake a hibernated sandbox
WaitForVm = Callable[[Sandbox], Awaitable[None]]


async def agent_request(sbx: Sandbox, op: Op, wait: float, feature: str, **fields: Any) -> dict[str, Any]:
    """``op`` to the sandbox's agent within ``wait`` seconds, the channel's errors as the layer's:
    no live channel or a lost VM (``SandboxNotRunning``), no answer (``AgentUnresponsive``), an
    image without ``feature`` (``NotSupportedByImage``). The agent's refusal (``AgentError``) is
    the caller's to word."""
    agent = sbx.live_agent
    if agent is None:
        raise SandboxNotRunning(
            f"sandbox {sbx.id} is {sbx.record.state}",
            remedy=Remedy.RESTART,
            state=sbx.record.state.value,
            sandbox_id=sbx.id,
        )
    try:
        return await agent.request(op, timeout=wait, **fields)
    except ChannelTimeout:
        raise AgentUnresponsive(
            f"the agent of sandbox {sbx.id} did not answer {op} within {wait:g}s", sandbox_id=sbx.id
        ) from None
    except ChannelClosed as exc:
        raise SandboxNotRunning(
            f"sandbox {sbx.id} lost its VM during {op}: {exc}",
            remedy=Remedy.RESTART,
            state=sbx.record.state.value,
            sandbox_id=sbx.id,
        ) from exc
    except NotSupportedByAgent as exc:
        raise NotSupportedByImage(
            f"sandbox {sbx.id} runs a guest image without {feature}; rebuild the images (make "
            "image) and create a new sandbox"
        ) from exc


class FileService:
    """The files API of the sandboxes."""

    def __init__(self, settings: Settings, wait_for_vm: WaitForVm) -> None:
        self.settings = settings
        self._wait_for_vm = wait_for_vm

    def _path(self, path: Any, field: str = "path") -> str:
        if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096:
            raise InvalidRequest(
                f"{field}={path!r:.100} is not a usable path: give a non-empty path of at most "
                "4096 characters without NUL; relative paths are under /home/user",
                field=field,
            )
        return path

    async def _fs(self, sbx: Sandbox, op: Op, **fields: Any) -> dict[str, Any]:
        await self._wait_for_vm(sbx)
        ensure_usable(sbx)
        try:
            reply = await agent_request(sbx, op, self.settings.timeouts.file_op, "file operations", **fields)
        except AgentError as exc:
            raise FileOperationFailed(f"{op} was refused: {exc}") from exc
        if "oserror" in reply:
            raise _fs_error(sbx, reply["oserror"], fields)
        sbx.record.last_active_at = time.time()
        return reply

    async def write_file(
        self,
        sbx: Sandbox,
        path: str,
        chunks: AsyncIterator[bytes],
        length: int | None = None,
        user: str | None = None,
    ) -> dict[str, Any]:
        """Stream ``chunks`` into ``path`` (parents created); atomic: a failed upload leaves
        nothing. The size limit is checked up front when ``length`` is known, and as bytes come.
        What it makes belongs to ``user`` (None: the sandbox's user, root unless one was set)."""
        owner = {} if user is None else {"user": user}
        self._path(path)
        limit = self.settings.max_file_bytes
        if length is not None and length > limit:
            raise _too_large(path, length, limit)
        head, _, name = path.rpartition("/")
        tmp = (
            f"{head}/.{name}.kh-upload-{secrets.token_hex(4)}"
            if head or path.startswith("/")
            else f".{name}.kh-upload-{secrets.token_hex(4)}"
        )
        written = 0
        created = False
        inflight: set[asyncio.Future[dict[str, Any]]] = set()
        try:
            async for piece in _rechunk(chunks, FILE_CHUNK):
                if written + len(piece) > limit:
                    raise _too_large(path, written + len(piece), limit)
                if not created:
                    await self._fs(sbx, Op.FS_WRITE, path=tmp, offset=0, data=piece, create=True, **owner)
                    created = True
                else:
                    if len(inflight) >= FILE_WINDOW:
                        done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                        for task in done:
                            task.result()
                    inflight.add(
                        asyncio.ensure_future(
                            self._fs(sbx, Op.FS_WRITE, path=tmp, offset=written, data=piece)
                        )
                    )
                written += len(piece)
            if not created:
                await self._fs(sbx, Op.FS_WRITE, path=tmp, offset=0, data=b"", create=True, **owner)
                created = True
            for task in asyncio.as_completed(inflight):
                await task
            inflight = set()
            reply = await self._fs(sbx, Op.FS_RENAME, src=tmp, dst=path)
        except BaseException:
            for task in inflight:
                task.cancel()
            if created:
                with contextlib.suppress(SandboxError):  # the upload's own error is what matters
                    await asyncio.shield(self._fs(sbx, Op.FS_REMOVE, path=tmp))
            raise
        final = reply.get("path")
        return {"path": final if isinstance(final, str) else path, "size": written}

    async def read_file(self, sbx: Sandbox, path: str) -> tuple[int, AsyncIterator[bytes]]:
        """The file's size, and its bytes in chunks (errors before the first byte raise here)."""
        self._path(path)
        reply = await self._fs(sbx, Op.FS_STAT, path=path)
        stat = reply.get("stat")
        if (
            not isinstance(stat, dict)
            or not isinstance(stat.get("size"), int)
            or isinstance(stat.get("size"), bool)
            or stat["size"] < 0
        ):
            raise FileOperationFailed(f"the sandbox answered a stat of {path!r} with nonsense")
        if stat.get("type") == "dir":
            raise FileOperationFailed(
                f"{path!r} is a directory",
                remedy=Remedy.LIST_DIRECTORY,
                path=path,
                errno="EISDIR",
                sandbox_id=sbx.id,
            )
        if stat.get("type") != "file":
            raise FileOperationFailed(f"{path!r} is not a regular file ({stat.get('type')})", path=path)
        size = int(stat["size"])
        if size > self.settings.max_file_bytes:
            raise _too_large(path, size, self.settings.max_file_bytes)
        return size, self._read_chunks(sbx, path, size)

    async def _read_chunks(self, sbx: Sandbox, path: str, size: int) -> AsyncIterator[bytes]:
        offsets = iter(range(0, size, FILE_CHUNK))
        inflight: list[tuple[int, asyncio.Future[dict[str, Any]]]] = []

        def more() -> None:
            while len(inflight) < FILE_WINDOW:
                offset = next(offsets, None)
                if offset is None:
                    return
                length = min(FILE_CHUNK, size - offset)
                inflight.append(
                    (
                        length,
                        asyncio.ensure_future(
                            self._fs(sbx, Op.FS_READ, path=path, offset=offset, length=length)
                        ),
                    )
                )

        try:
            more()
            while inflight:
                length, task = inflight.pop(0)
                data = (await task).get("data")
                if not isinstance(data, bytes) or len(data) > length:
                    raise FileOperationFailed(
                        f"the sandbox answered a read of {path!r} with {type(data).__name__} instead of bytes"
                    )
                if len(data) < length:
                    raise FileOperationFailed(f"{path!r} shrank while it was being read")
                more()
                yield data
        finally:
            for _, task in inflight:
                task.cancel()

    async def list_files(self, sbx: Sandbox, path: str = ".") -> dict[str, Any]:
        self._path(path)
        reply = await self._fs(sbx, Op.FS_LIST, path=path)
        where = str(reply["path"]) if isinstance(reply.get("path"), str) else path
        entries = []
        raw_entries = reply.get("entries")
        for raw in raw_entries if isinstance(raw_entries, list) else []:
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
                continue
            size, mtime = raw.get("size"), raw.get("mtime")
            entries.append(
                {
                    "name": raw["name"],
                    "path": f"{where.rstrip('/')}/{raw['name']}",
                    "type": raw.get("type") if raw.get("type") in ("file", "dir", "symlink") else "other",
                    "size": size if isinstance(size, int) and not isinstance(size, bool) else 0,
                    "modified_at": iso_time(float(mtime))
                    if isinstance(mtime, (int, float)) and not isinstance(mtime, bool) and 0 <= mtime < 1e11
                    else None,
                }
            )
        return {"path": where, "entries": entries, "truncated": reply.get("truncated") is True}

    async def stat_file(self, sbx: Sandbox, path: str) -> dict[str, Any]:
        """``{path, type, size, mode, modified_at}`` of a path (symlinks followed)."""
        self._path(path)
        reply = await self._fs(sbx, Op.FS_STAT, path=path)
        raw = reply.get("stat")
        st: dict[str, Any] = raw if isinstance(raw, dict) else {}
        size, mtime, mode = st.get("size"), st.get("mtime"), st.get("mode")
        return {
            "path": str(reply["path"]) if isinstance(reply.get("path"), str) else path,
            "type": st.get("type") if st.get("type") in ("file", "dir", "symlink") else "other",
            "size": size if isinstance(size, int) and not isinstance(size, bool) else 0,
            "mode": mode if isinstance(mode, int) and not isinstance(mode, bool) else 0,
            "modified_at": iso_time(float(mtime))
            if isinstance(mtime, (int, float)) and not isinstance(mtime, bool) and 0 <= mtime < 1e11
            else None,
        }

    async def move_file(self, sbx: Sandbox, src: str, dst: str) -> str:
        """Move ``src`` to ``dst`` (a file there is replaced, a directory never); the new path."""
        self._path(src, "source")
        self._path(dst, "destination")
        reply = await self._fs(sbx, Op.FS_RENAME, src=src, dst=dst)
        return str(reply["path"]) if isinstance(reply.get("path"), str) else dst

    async def remove_file(self, sbx: Sandbox, path: str, recursive: bool = False) -> None:
        self._path(path)
        await self._fs(sbx, Op.FS_REMOVE, path=path, recursive=recursive)


FILE_CHUNK = 1 << 20  # bytes per channel frame of a file transfer
FILE_WINDOW = 4  # chunk requests in flight per transfer


async def _rechunk(chunks: AsyncIterator[bytes], size: int) -> AsyncIterator[bytes]:
    """Pieces of exactly ``size`` bytes (the last may be shorter) from any chunking."""
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


def _too_large(path: str, size: int, limit: int) -> FileTooLarge:
    return FileTooLarge(
        f"{path!r} is {size} bytes, over the limit of {limit} bytes; the server's "
        "max_file_bytes setting raises it (the sandbox's disk is half its VM memory)",
        path=path,
        limit=limit,
    )


def _fs_error(sbx: Sandbox, err: Any, fields: dict[str, Any]) -> Exception:
    err = err if isinstance(err, dict) else {}
    code = str(err.get("errno", "EIO"))[:32]
    message = str(err.get("message", "error"))[:200]
    asked = fields.get("dst") or fields.get("path") or ""
    path = err.get("path") if isinstance(err.get("path"), str) else asked
    if code == "ENOENT":
        return PathNotFound(f"no such file or directory in sandbox {sbx.id}: {path!r}", path=path)
    if code in ("ENOSPC", "EDQUOT"):
        return SandboxDiskFull(
            f"the disk of sandbox {sbx.id} is full writing {path!r}: files live in the VM's "
            f"memory ({sbx.record.memory_mib} MiB, half of it for files); remove files, or "
            "raise vm_memory_mib on the server",
            path=path,
        )
    hint = {
        "EISDIR": "; it is a directory",
        "ENOTDIR": "; a parent is not a directory",
        "ENOTEMPTY": "; pass recursive=true to remove a directory and its contents",
        "EEXIST": "; something else is already there",
    }.get(code, "")
    return FileOperationFailed(f"{message}: {path!r} ({code}){hint}", path=path, errno=code)
