"""Template builds off the request path: a queue with bounded concurrency and a deadline per
build (``BuildQueue.run``: a tenant's layer is built in a build VM, ``sandboxes/templates/build_vm.py``;
``run_script`` runs the operator's own scripts, ``build.py`` for a distribution base, in their
own process group), the JSON-lines progress kept as the build's log (bounded), followed live,
cancellable, and cleaned up whatever ends it (a failure, a cancel, a deadline, the service
stopping).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("kernelhost.templates")

REPO = Path(__file__).resolve().parents[3]
GUEST_IMAGE = REPO / "guest-image"
LOG_LINE_MAX = 4000  # characters of one build log line kept
LOG_BYTES_MAX = 16 << 20  # bytes of one build's log; later log lines are dropped (stages kept)
T = TypeVar("T")
KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL of a cancelled build


class BuildState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    CACHED = "cached"  # an unchanged spec: the image was already built
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self not in (BuildState.QUEUED, BuildState.RUNNING)


class BuildFailed(Exception):
    """The build script failed: ``stage`` is where, the message says what and how to fix it."""

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass
class Build:
    """One build of one template; its log is ``log_path`` (JSON lines)."""

    id: str
    owner: str
    name: str
    key: str
    log_path: Path
    state: BuildState = BuildState.QUEUED
    stage: str = ""
    stages: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    log_bytes: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def row(self) -> dict[str, Any]:
        """What the store keeps of it."""
        return {**self.wire(), "owner": self.owner, "name": self.name, "key": self.key}

    def wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "template": self.name,
            "state": str(self.state),
            "stage": self.stage,
            "stages": self.stages,
            "error": self.error or None,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }

    async def note(self, event: dict[str, Any]) -> None:
        """Append one event to the log, take in a stage, wake the followers."""
        if "log" in event:
            if self.log_bytes > LOG_BYTES_MAX:
                return
            event = {"log": str(event["log"])[:LOG_LINE_MAX]}
        event.setdefault("at", round(time.time(), 3))
        line = json.dumps(event) + "\n"
        self.log_bytes += len(line)
        if "log" in event and self.log_bytes > LOG_BYTES_MAX:
            cut = f"(the log passed {LOG_BYTES_MAX} bytes; later lines are dropped)"
            line = json.dumps({"log": cut, "at": event["at"]}) + "\n"
        with self.log_path.open("a") as f:
            f.write(line)
        if "stage" in event and "error" not in event:
            self.stage = str(event["stage"])
            self.stages.append(
                {"stage": self.stage, "detail": str(event.get("detail", ""))[:300], "at": event["at"]}
            )
        async with self.changed:
            self.changed.notify_all()

    async def finish(self, state: BuildState, error: str = "") -> None:
        self.state, self.error, self.finished_at = state, error, time.time()
        await self.note({"state": str(state), **({"error": error} if error else {})})


def new_build_id() -> str:
    return "bld_" + uuid.uuid4().hex[:12]


class BuildQueue:
    """Runs build scripts, at most ``concurrency`` at once, each under ``timeout`` seconds."""

    def __init__(self, log_dir: Path, concurrency: int, timeout: float) -> None:
        self.log_dir = log_dir
        self.timeout = timeout
        self._slots = asyncio.Semaphore(concurrency)
        self.builds: dict[str, Build] = {}

    def restore(self, row: dict[str, Any]) -> Build:
        """A finished build as the store kept it (its log is still on disk)."""
        build = Build(
            row["id"], row["owner"], row["name"], row["key"], self.log_dir / f"{row['id']}.jsonl",
            state=BuildState(row["state"]), stage=row.get("stage") or "",
            stages=list(row.get("stages") or []), error=row.get("error") or "",
            created_at=row["created_at"], started_at=row.get("started_at"),
            finished_at=row.get("finished_at"),
        )  # fmt: skip
        if not build.log_path.exists():
            self.log_dir.mkdir(parents=True, exist_ok=True)
            build.log_path.touch()
        self.builds[build.id] = build
        return build

    def new(self, owner: str, name: str, key: str) -> Build:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        build_id = new_build_id()
        build = Build(build_id, owner, name, key, self.log_dir / f"{build_id}.jsonl")
        build.log_path.touch()
        self.builds[build_id] = build
        return build

    async def run(self, build: Build, job: Callable[[], Awaitable[T]]) -> T:
        """Run one step of a build once a slot is free, under the build's deadline. Raises
        ``BuildFailed`` at the deadline; cancelling the task cancels the step."""
        try:
            async with self._slots:
                if build.state != BuildState.RUNNING:
                    build.state, build.started_at = BuildState.RUNNING, time.time()
                    await build.note({"state": str(BuildState.RUNNING)})
                async with asyncio.timeout(self.timeout):
                    return await job()
        except TimeoutError:
            raise BuildFailed(
                f"the build took longer than {self.timeout:.0f} s (template_build_timeout)", build.stage
            ) from None

    async def run_script(self, build: Build, argv: list[str], expect_done: bool = True) -> dict[str, Any]:
        """Run one of the operator's build scripts (never a tenant's input) once a slot is
        free; its ``done`` event's data (``{}`` for a script that has none:
        ``expect_done=False``). Raises ``BuildFailed``; cancelling the task stops the script."""
        return await self.run(build, lambda: self._run(build, argv, expect_done))

    async def _run(self, build: Build, argv: list[str], expect_done: bool) -> dict[str, Any]:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            limit=1 << 20,
        )
        done: dict[str, Any] | None = None
        failure: dict[str, Any] | None = None
        try:
            assert proc.stdout is not None
            async for raw in proc.stdout:
                event = _parse(raw)
                if "done" in event:
                    done = event["done"] if isinstance(event["done"], dict) else {}
                    continue
                if "error" in event:
                    failure = event
                await build.note(event)
            code = await proc.wait()
        except BaseException:
            await asyncio.shield(_stop(proc))
            raise
        if done is None and not expect_done and failure is None and code == 0:
            return {}
        if failure is not None or code != 0 or done is None:
            message = str(failure["error"]) if failure else f"the build script exited with code {code}"
            raise BuildFailed(message, str((failure or {}).get("stage", build.stage)))
        return done

    async def follow(self, build: Build, follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        """Every event of the build's log, then (``follow``) the new ones until it finishes."""
        offset = 0
        while True:
            async with build.changed:
                finished = build.state.finished or not follow
                with build.log_path.open() as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
                if not chunk and not finished:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(15.0):
                            await build.changed.wait()
                    continue
            for line in chunk.splitlines():
                with contextlib.suppress(ValueError):
                    yield json.loads(line)
            if finished and not chunk:
                return


def _parse(raw: bytes) -> dict[str, Any]:
    text = raw.decode(errors="replace").rstrip("\n")
    try:
        event = json.loads(text)
    except ValueError:
        return {"log": text}
    return event if isinstance(event, dict) else {"log": text}


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the script's process group, SIGKILL it after the grace, reap it."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        async with asyncio.timeout(KILL_GRACE):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def clean_work(work: Path) -> None:
    """Remove a build's scratch directory (idempotent; nothing of a build is ever mounted on
    the host)."""
    shutil.rmtree(work, ignore_errors=True)
