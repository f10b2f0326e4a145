"""envd's files (port 49983 of an E2B sandbox): ``/health``, ``GET``/``POST /files`` (download,
multipart or octet-stream upload) and the ``filesystem.Filesystem`` Connect service (ListDir,
Stat, MakeDir, Move, Remove), over the sandbox manager's file operations.

Every call is for the SDK's ``user`` (``?username=`` or ``Authorization: Basic``: ``user`` by
default, or ``root``). Paths are the guest's, resolved as envd does: ``~`` and relative paths
are under that user's home (``/home/user``, ``/root``). An upload's files, and the directories
``MakeDir`` makes, belong to that user; reads, lists, moves and removes act as root, as envd's.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import structlog
from aiohttp import BodyPartReader, web

from ...sandboxes import (
    End,
    FileTooLarge,
    InvalidRequest,
    PathNotFound,
    Sandbox,
    SandboxDiskFull,
    SandboxError,
    SandboxState,
)
from ..errors import status_for
from .common import (
    HOME,
    body_too_slow,
    envd_path,
    envd_user,
    message_path,
    not_running,
    runtime,
    sandbox_of,
)
from .connect import UNARY_CONTENT_TYPE, ConnectError, parse_message
from .entries import read_entries

log = structlog.get_logger("kernelhost.api.e2b")

CHUNK = 1 << 16
T = TypeVar("T")


async def health(request: web.Request) -> web.Response:
    """204 while the sandbox runs; 502 once it does not (paused, killed, timed out), as E2B's
    proxy answers: the SDKs' ``is_running()``. ``identify`` answered already for a sandbox
    the call may not use."""
    sbx = sandbox_of(request)
    if sbx.record.state not in (SandboxState.RUNNING, SandboxState.REPLACING):
        return not_running(request)
    return web.Response(status=204)


def _http_error(exc: SandboxError) -> web.Response:
    status = status_for(exc)
    if isinstance(exc, SandboxDiskFull):
        status = 507
    return web.json_response({"code": status, "message": exc.message}, status=status)


async def download(request: web.Request) -> web.StreamResponse:
    sbx = sandbox_of(request)
    path = request.query.get("path", "")
    if not path:
        return web.json_response({"code": 400, "message": "path is required (?path=...)"}, status=400)
    try:
        path = envd_path(path, envd_user(request))
        size, chunks = await runtime(request).manager.files.read_file(sbx, path)
    except SandboxError as exc:
        return _http_error(exc)
    resp = web.StreamResponse(
        headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}
    )
    await resp.prepare(request)
    async for chunk in chunks:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


class _BodyTooSlow(Exception):
    """An upload's next bytes did not come within ``body_timeout``."""


async def _in_time(step: Awaitable[T], wait: float) -> T:
    try:
        async with asyncio.timeout(wait):
            return await step
    except TimeoutError:
        raise _BodyTooSlow from None


async def _part_chunks(part: BodyPartReader, wait: float) -> AsyncIterator[bytes]:
    while chunk := await _in_time(part.read_chunk(CHUNK), wait):
        yield chunk


async def _body_chunks(request: web.Request, wait: float) -> AsyncIterator[bytes]:
    while chunk := await _in_time(request.content.read(CHUNK), wait):
        yield chunk


async def upload(request: web.Request) -> web.Response:
    """Each piece of the body (a part's head, a chunk) must come within ``body_timeout``."""
    sbx = sandbox_of(request)
    manager = runtime(request).manager
    files, wait = manager.files, manager.settings.body_timeout
    query_path = request.query.get("path")
    written: list[dict[str, Any]] = []
    try:
        user = envd_user(request)
        if request.content_type.startswith("multipart/"):
            reader = await request.multipart()
            while (part := await _in_time(reader.next(), wait)) is not None:
                if not isinstance(part, BodyPartReader) or part.name != "file":
                    continue
                path = query_path or part.filename
                if not path:
                    raise InvalidRequest("a file part names no path: send ?path= or the part's filename")
                path = envd_path(path, user)
                written.append(await files.write_file(sbx, path, _part_chunks(part, wait), user=user))
        else:
            if not query_path:
                raise InvalidRequest("path is required (?path=...) for an octet-stream upload")
            chunks, path = _body_chunks(request, wait), envd_path(query_path, user)
            written.append(await files.write_file(sbx, path, chunks, request.content_length, user))
    except SandboxError as exc:
        return _http_error(exc)
    except _BodyTooSlow:
        return body_too_slow(request, wait)
    if not written:
        return web.json_response(
            {"code": 400, "message": "no file part named 'file' in the upload"}, status=400
        )
    return web.json_response(
        [{"name": w["path"].rsplit("/", 1)[-1], "type": "file", "path": w["path"]} for w in written]
    )


# -- the filesystem.Filesystem Connect service --------------------------------------------------


def _connect_error(exc: SandboxError) -> ConnectError:
    if isinstance(exc, PathNotFound):
        return ConnectError("not_found", exc.message)
    if isinstance(exc, FileTooLarge | SandboxDiskFull):
        return ConnectError("resource_exhausted", exc.message)
    if isinstance(exc, InvalidRequest):
        return ConnectError("invalid_argument", exc.message)
    if exc.details.get("errno") == "EEXIST":
        return ConnectError("already_exists", exc.message)
    status = status_for(exc)
    return ConnectError({404: "not_found", 409: "failed_precondition", 429: "resource_exhausted",
                         503: "unavailable"}.get(status, "invalid_argument" if status == 400 else "internal"),
                        exc.message)  # fmt: skip


async def _list_dir(request: web.Request, sbx: Sandbox, message: dict[str, Any]) -> dict[str, Any]:
    """The tree under a path, depth first, ``depth`` levels deep (``entries.py``), stopped at
    ``max_list_entries`` entries: then the answer carries ``"truncated": true``, a field E2B's
    SDKs ignore (they parse envd's JSON leniently) and the service log notes."""
    depth = message.get("depth") or 1
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 16:
        raise ConnectError("invalid_argument", f"depth={depth!r} must be 1 to 16")
    found, truncated = await read_entries(request, sbx, "list", message_path(request, message), depth)
    if not truncated:
        return {"entries": found}
    log.info("e2b.list_truncated", sandbox_id=sbx.id, entries=len(found))
    return {"entries": found, "truncated": True}


async def _stat(request: web.Request, sbx: Sandbox, message: dict[str, Any]) -> dict[str, Any]:
    found, _ = await read_entries(request, sbx, "stat", message_path(request, message))
    return {"entry": found[0]}


def make_dir_script(path: str, user: str | None) -> str:
    """The shell's ``MakeDir``, in a subshell (its cwd stays): as envd, it makes the directory
    anywhere (through sudo, which every image has, as the sandbox's user may not write there)
    and gives what it made to the caller's ``user`` (None: the sandbox's, who runs the shell),
    so ``make_dir("/workspace")`` is the user's to fill (the OpenAI Agents SDK's workspace)."""
    quoted = shlex.quote(path)
    owner = shlex.quote(user) if user else '"$(id -un)"'
    return (
        f"( cd {HOME} && if [ -e {quoted} ]; then exit 17; fi; p={quoted}; set --; "
        'while [ ! -e "$p" ]; do set -- "$p" "$@"; p=$(dirname -- "$p"); done; '
        f'sudo -n mkdir -p -- {quoted} && sudo -n chown -h -- {owner}: "$@" )'
    )


async def _shell(request: web.Request, sbx: Sandbox, code: str) -> int | None:
    """Run ``code`` in the sandbox's shell (no guest op makes a directory); its exit code."""
    events = await runtime(request).manager.execute(sbx, code, "bash")
    exit_code = None
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, End):
                exit_code = event.exit_code
    return exit_code


async def _make_dir(request: web.Request, sbx: Sandbox, message: dict[str, Any]) -> dict[str, Any]:
    path, user = message_path(request, message), envd_user(request)
    exit_code = await _shell(request, sbx, make_dir_script(path, user))
    if exit_code == 17:
        raise ConnectError("already_exists", f"{path!r} already exists")
    if exit_code != 0:
        raise ConnectError(
            "invalid_argument", f"cannot make the directory {path!r} (mkdir exit code {exit_code})"
        )
    return {}


async def _move(request: web.Request, sbx: Sandbox, message: dict[str, Any]) -> dict[str, Any]:
    """Rename; as envd, the destination's missing parents are made first, the caller's user's
    (only when the rename finds them missing: a shell round trip on that path alone)."""
    files = runtime(request).manager.files
    source = message_path(request, message, "source")
    destination = message_path(request, message, "destination")
    try:
        dst = await files.move_file(sbx, source, destination)
    except PathNotFound:
        parent = posixpath.dirname(destination)
        # exit 0 only if the source is there and the parents were missing and are made now (in
        # a subshell: an exit must not end the sandbox's shell)
        make = make_dir_script(parent, envd_user(request))
        if await _shell(request, sbx, f"( sudo -n test -e {shlex.quote(source)} || exit 2; {make} )") != 0:
            raise
        dst = await files.move_file(sbx, source, destination)
    return await _stat(request, sbx, {"path": dst})


async def _remove(request: web.Request, sbx: Sandbox, message: dict[str, Any]) -> dict[str, Any]:
    """Remove a file or a directory and all it holds; a path that is not there is already
    removed (envd answers success, as ``os.RemoveAll`` does)."""
    with contextlib.suppress(PathNotFound):
        await runtime(request).manager.files.remove_file(sbx, message_path(request, message), recursive=True)
    return {}


Method = Callable[[web.Request, Sandbox, dict[str, Any]], Awaitable[dict[str, Any]]]
METHODS: dict[str, Method] = {
    "ListDir": _list_dir,
    "Stat": _stat,
    "MakeDir": _make_dir,
    "Move": _move,
    "Remove": _remove,
}


async def filesystem(request: web.Request) -> web.Response:
    method = request.match_info["method"]
    try:
        handler = METHODS.get(method)
        if handler is None:
            raise ConnectError(
                "unimplemented",
                f"filesystem.{method} is not supported by kernelhost; supported: {', '.join(METHODS)}, "
                "WatchDir, CreateWatcher, GetWatcherEvents, RemoveWatcher",
            )
        message = parse_message(await request.read())
        sbx = sandbox_of(request)
        try:
            reply = await handler(request, sbx, message)
        except SandboxError as exc:
            raise _connect_error(exc) from None
    except ConnectError as exc:
        return web.json_response(exc.wire(), status=exc.status)
    return web.json_response(reply, content_type=UNARY_CONTENT_TYPE)


def add_routes(app: web.Application, prefix: str) -> None:
    r = app.router
    r.add_get(f"{prefix}/health", health)
    r.add_get(f"{prefix}/files", download)
    r.add_post(f"{prefix}/files", upload)
    r.add_post(f"{prefix}/filesystem.Filesystem/{{method}}", filesystem)
