"""Adapter logic written once as sans-IO *plans*, driven by an async or a sync sandbox.

A plan is a generator that yields ``Call`` requests (a method of the sandbox, such as
``run_code`` or ``files.read``, with its arguments) and receives each call's return value (or
has the SDK's exception thrown into it), and finally returns its answer::

    def plan() -> Plan[str]:
        execution = yield run_code("1 + 1")
        return execution.text

    await drive_async(plan(), async_sandbox)    # AsyncSandbox: each call is awaited
    drive_sync(plan(), sandbox)                 # Sandbox: the same calls, blocking

``AsyncSandbox`` and ``Sandbox`` have the same method names (``Sandbox`` is derived from
``AsyncSandbox``), so every adapter has one implementation for both surfaces, and unit tests
can drive plans with scripted answers, no sandbox needed.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from kernelhost.client import (
    APIError,
    AsyncSandbox,
    AuthenticationError,
    Execution,
    KernelHostError,
    NotFoundError,
    Sandbox,
)

from .output import Image, OutputBudget, shape_execution

__all__ = [
    "LANGUAGES",
    "Call",
    "PathStat",
    "Plan",
    "ToolOutput",
    "drive",
    "drive_async",
    "drive_sync",
    "files_list",
    "files_read",
    "files_write",
    "run_code",
    "run_for_model",
    "service_failure",
    "stat_path",
]

T = TypeVar("T")

#: The languages adapters offer: Python runs in the kernel, bash runs as a shell command.
LANGUAGES = ("python", "bash")


@dataclass(frozen=True)
class Call:
    """A request to call ``method`` (a dotted attribute path) of the sandbox."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


Plan = Generator[Call, Any, T]

#: Any sandbox handle a plan can be driven with.
AnySandbox = AsyncSandbox | Sandbox


def run_code(code: str, language: str = "python", timeout: float | None = None) -> Call:
    """``sbx.run_code(...)``, answered with an ``Execution``."""
    return Call("run_code", (code,), {"language": language, "timeout": timeout})


def files_read(path: str) -> Call:
    """``sbx.files.read(path)``, answered with the file's bytes."""
    return Call("files.read", (path,))


def files_write(path: str, data: bytes) -> Call:
    """``sbx.files.write(path, data)``, answered with its ``FileInfo``."""
    return Call("files.write", (path, data))


def files_list(path: str) -> Call:
    """``sbx.files.list(path)``, answered with a list of ``FileInfo``."""
    return Call("files.list", (path,))


def _bound(sbx: object, method: str) -> Any:
    target: Any = sbx
    for name in method.split("."):
        target = getattr(target, name)
    return target


async def drive_async(plan: Plan[T], sbx: AsyncSandbox) -> T:
    """Run ``plan`` against an ``AsyncSandbox`` and return its answer."""
    try:
        request = next(plan)
        while True:
            try:
                value = _bound(sbx, request.method)(*request.args, **request.kwargs)
                if inspect.isawaitable(value):
                    value = await value
            except KernelHostError as exc:
                request = plan.throw(exc)
            else:
                request = plan.send(value)
    except StopIteration as done:
        return cast(T, done.value)
    finally:
        plan.close()


def drive_sync(plan: Plan[T], sbx: Sandbox) -> T:
    """Run ``plan`` against a blocking ``Sandbox`` and return its answer."""
    try:
        request = next(plan)
        while True:
            try:
                value = _bound(sbx, request.method)(*request.args, **request.kwargs)
            except KernelHostError as exc:
                request = plan.throw(exc)
            else:
                request = plan.send(value)
    except StopIteration as done:
        return cast(T, done.value)
    finally:
        plan.close()


async def drive(plan: Plan[T], sbx: AnySandbox) -> T:
    """Run ``plan`` from async code with either kind of sandbox.

    A blocking ``Sandbox`` is driven in a worker thread, so the event loop keeps running.
    """
    if isinstance(sbx, Sandbox):
        return await asyncio.to_thread(drive_sync, plan, sbx)
    return await drive_async(plan, sbx)


# -- shared plans --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolOutput:
    """What a text-and-images tool hands a model: its text (within budget), images, failure."""

    text: str
    images: list[Image]
    is_error: bool


def service_failure(exc: KernelHostError) -> None:
    """Re-raise errors the developer must fix; return for failures a model should be told of.

    A bad API key (``AuthenticationError``) or misuse of a handle (a plain ``KernelHostError``,
    e.g. a closed sandbox) raises; the service being unreachable, busy or having lost the
    sandbox is reported to the model as a failed tool call.
    """
    if isinstance(exc, AuthenticationError) or type(exc) is KernelHostError:
        raise exc


def run_for_model(
    source: str, language: str, timeout: float | None, budget: OutputBudget
) -> Plan[ToolOutput]:
    """Run Python code or a bash command and shape what it produced for a model."""
    if language not in LANGUAGES:
        return ToolOutput(f"Unknown language {language!r}: use one of {', '.join(LANGUAGES)}.", [], True)
    try:
        execution: Execution = yield run_code(source, language, timeout)
    except KernelHostError as exc:
        service_failure(exc)
        return ToolOutput(f"The sandbox service failed, so the code did not run: {exc}", [], True)
    shaped = shape_execution(execution, budget)
    return ToolOutput(shaped.to_text(), shaped.images, shaped.is_error)


@dataclass(frozen=True)
class PathStat:
    """What is at a path of the sandbox: ``kind`` is ``file``, ``dir``, ``other`` or ``missing``.

    ``missing`` means "not in its directory's listing": a listing is capped, so in a directory
    of many thousand entries a file can exist and still be reported missing; callers that must
    be sure try the operation itself.
    """

    path: str
    kind: str
    size: int = 0


def stat_path(path: str) -> Plan[PathStat]:
    """Look ``path`` up in its parent directory's listing."""
    stripped = path.rstrip("/")
    if not stripped:
        return PathStat("/", "dir")
    parent, _, name = stripped.rpartition("/")
    if not parent:
        parent = "/" if stripped.startswith("/") else "."
    try:
        entries = yield files_list(parent)
    except NotFoundError:
        return PathStat(path, "missing")
    except APIError as exc:
        if exc.code == "file_operation_failed":  # the parent is not a directory
            return PathStat(path, "missing")
        raise
    for entry in entries:
        if entry.name == name:
            kind = entry.type if entry.type in ("file", "dir") else "other"
            return PathStat(entry.path, kind, entry.size)
    return PathStat(path, "missing")
