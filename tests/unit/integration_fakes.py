"""Fake sandboxes for the unit tests of the adapters (``kernelhost.integrations``), no VM needed.

``FakeSandbox`` has ``Sandbox``'s surface: ``run_code`` answers from a script, ``files`` keeps
files in a dict, and the checkpoint methods keep checkpoints in a list, answering like the
service (its errors and codes, undo only with ``auto_checkpoint``). ``AsyncFakeSandbox`` is its
``AsyncSandbox`` twin. ``handle_both`` answers an Anthropic block through both surfaces.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import posixpath
from typing import Any, cast

from kernelhost import (
    AsyncSandbox,
    Checkpoint,
    Execution,
    FileInfo,
    InvalidRequestError,
    NotFoundError,
    Sandbox,
    SandboxInfo,
    SandboxState,
)
from kernelhost.integrations import anthropic as anthropic_adapter

CREATED = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


class FakeFiles:
    """A sandbox filesystem in a dict, answering like the service (errors and codes)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.dirs = {"/", "/home", "/home/user", "/tmp"}

    @staticmethod
    def full(path: str) -> str:
        return posixpath.normpath(posixpath.join("/home/user", path))

    def read(self, path: str) -> bytes:
        full = self.full(path)
        if full in self.dirs:
            raise InvalidRequestError(f"{path!r} is a directory", status=400, code="file_operation_failed")
        if full not in self.data:
            raise NotFoundError(f"no such file: {path!r}", status=404, code="file_not_found")
        return self.data[full]

    def write(self, path: str, data: bytes) -> FileInfo:
        full = self.full(path)
        parent = full.rsplit("/", 1)[0] or "/"
        while parent not in self.dirs:
            self.dirs.add(parent)
            parent = parent.rsplit("/", 1)[0] or "/"
        self.data[full] = bytes(data)
        return FileInfo(name=full.rsplit("/", 1)[1], path=full, size=len(data))

    def list(self, path: str = ".") -> list[FileInfo]:
        full = self.full(path)
        if full not in self.dirs:
            raise NotFoundError(f"no such directory: {path!r}", status=404, code="file_not_found")
        prefix = full.rstrip("/") + "/"
        out = [
            FileInfo(name=p[len(prefix) :], path=p, type="file", size=len(d))
            for p, d in self.data.items()
            if p.startswith(prefix) and "/" not in p[len(prefix) :]
        ]
        out += [
            FileInfo(name=d[len(prefix) :], path=d, type="dir")
            for d in self.dirs
            if d.startswith(prefix) and d != full and "/" not in d[len(prefix) :]
        ]
        return sorted(out, key=lambda e: e.name)


def missing_checkpoint(message: str) -> NotFoundError:
    """The service's ``checkpoint_not_found`` (its REST advice in the message, as over HTTP)."""
    hint = "list them with GET /v1/sandboxes/sbx_fake/checkpoints"
    details = {"code": "checkpoint_not_found", "reason": message, "hint": hint, "remedy": "list_checkpoints"}
    return NotFoundError(f"{message}; {hint}", status=404, code="checkpoint_not_found", details=details)


class FakeSandbox:
    """``Sandbox``'s surface: ``run_code`` answers from a script, ``files`` is a ``FakeFiles``,
    checkpoints are kept in ``saved`` (``auto_checkpoint``: undo works, as on the service).

    ``checkpoint_calls`` records each checkpoint method called, with its arguments; an exception
    in ``checkpoint_failure`` is raised by the next one instead.
    """

    def __init__(
        self, *answers: Execution | Exception, auto_checkpoint: bool = False, sandbox_id: str = "sbx_fake"
    ) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, str, float | None]] = []
        self.files = FakeFiles()
        self.id = sandbox_id
        self.auto_checkpoint = auto_checkpoint
        self.saved: list[Checkpoint] = []
        self.checkpoint_calls: list[tuple[str, Any]] = []
        self.checkpoint_failure: Exception | None = None
        self.closed = False

    def _checkpoint_call(self, method: str, arg: Any) -> None:
        self.checkpoint_calls.append((method, arg))
        failure, self.checkpoint_failure = self.checkpoint_failure, None
        if failure is not None:
            raise failure

    def _new(self, label: str, auto: bool = False, before_call: int | None = None) -> Checkpoint:
        cp = Checkpoint(
            id=f"cp_{len(self.saved) + 1}",
            sandbox_id=self.id,
            label=label,
            created_at=CREATED,
            bytes=3_500_000,
            auto=auto,
            before_call=before_call,
        )
        self.saved.append(cp)
        return cp

    def checkpoint(self, label: str | None = None) -> Checkpoint:
        self._checkpoint_call("checkpoint", label)
        return self._new(label or "")

    def checkpoints(self) -> list[Checkpoint]:
        self._checkpoint_call("checkpoints", None)
        return list(self.saved)

    def restore(self, cp: Checkpoint | str) -> Checkpoint:
        cid = cp.id if isinstance(cp, Checkpoint) else cp
        self._checkpoint_call("restore", cid)
        for saved in self.saved:
            if saved.id == cid:
                return saved
        raise missing_checkpoint(f"no checkpoint {cid!r} for this API key")

    def undo(self, n: int = 1) -> Checkpoint:
        self._checkpoint_call("undo", n)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:  # as the SDK does
            raise ValueError(f"n must be a positive int (how many calls to undo), got {n!r}")
        if not self.auto_checkpoint:
            raise InvalidRequestError(
                f"sandbox {self.id} was created without auto_checkpoint, so no state is kept before "
                "its calls; create sandboxes with auto_checkpoint=true to undo calls, or take "
                "checkpoints yourself",
                status=400,
                code="invalid_request",
                details={"code": "invalid_request", "field": "n"},
            )
        before = len(self.calls) - n + 1
        return self._new(f"before call {before}", auto=True, before_call=before)

    def delete_checkpoint(self, cp: Checkpoint | str) -> None:
        cid = cp.id if isinstance(cp, Checkpoint) else cp
        self._checkpoint_call("delete_checkpoint", cid)
        self.saved = [c for c in self.saved if c.id != cid]

    def run_code(self, code: str, language: str = "python", timeout: float | None = None) -> Execution:
        self.calls.append((code, language, timeout))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


class AsyncFakeSandbox:
    """``AsyncSandbox``'s surface over a ``FakeSandbox``."""

    def __init__(self, sync: FakeSandbox) -> None:
        self.sync = sync
        self.files = _AsyncFiles(sync.files)

    @property
    def id(self) -> str:
        return self.sync.id

    async def run_code(self, code: str, language: str = "python", timeout: float | None = None) -> Execution:
        await asyncio.sleep(0)
        return self.sync.run_code(code, language, timeout)

    async def checkpoint(self, label: str | None = None) -> Checkpoint:
        return self.sync.checkpoint(label)

    async def checkpoints(self) -> list[Checkpoint]:
        return self.sync.checkpoints()

    async def restore(self, cp: Checkpoint | str) -> Checkpoint:
        return self.sync.restore(cp)

    async def undo(self, n: int = 1) -> Checkpoint:
        return self.sync.undo(n)

    async def delete_checkpoint(self, cp: Checkpoint | str) -> None:
        self.sync.delete_checkpoint(cp)

    async def info(self) -> SandboxInfo:
        return SandboxInfo(id=self.id, template="python", state=SandboxState.RUNNING, created_at=CREATED)

    async def detach(self) -> None:
        pass

    async def close(self) -> None:
        self.sync.closed = True


class _AsyncFiles:
    def __init__(self, files: FakeFiles) -> None:
        self._files = files

    async def read(self, path: str) -> bytes:
        return self._files.read(path)

    async def write(self, path: str, data: bytes) -> FileInfo:
        return self._files.write(path, data)

    async def list(self, path: str = ".") -> list[FileInfo]:
        return self._files.list(path)


def as_sandbox(fake: FakeSandbox) -> Sandbox:
    """A fake, typed as the sandbox it stands for (the adapters only use its methods)."""
    return cast(Sandbox, fake)


def handle_both(block: dict[str, Any], make: Any, **options: Any) -> dict[str, Any]:
    """Answer ``block`` through the sync and the async surface; both must agree."""
    sync_fake, async_fake = make(), AsyncFakeSandbox(make())
    sync_answer = anthropic_adapter.handle_code_execution_tool_use(block, as_sandbox(sync_fake), **options)
    async_answer = asyncio.run(
        anthropic_adapter.ahandle_code_execution_tool_use(block, cast(AsyncSandbox, async_fake), **options)
    )
    assert sync_answer == async_answer
    return sync_answer
