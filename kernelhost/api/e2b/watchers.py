"""envd's watchers polled by id (``filesystem.Filesystem/CreateWatcher``, ``GetWatcherEvents``,
``RemoveWatcher``): what the sync Python SDK's ``files.watch_dir`` uses.

The watcher is ``watch.py``'s script, a background process of the sandbox, told to keep its
events in a directory of the guest (``STORE``) rather than print them. Its id names that
directory and the process (its ``info``), so the host keeps nothing: ``GetWatcherEvents``
reads the events past the last one taken (the ``ack`` file, which it then moves on) with the
agent's file ops, beside the sandbox's calls; ``RemoveWatcher`` kills the process and removes
the directory. A watcher lives until it is removed, the sandbox is paused, or it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from ...sandboxes import PathNotFound, Process, Sandbox, SandboxError
from .common import message_path, runtime, sandbox_of
from .connect import UNARY_CONTENT_TYPE, ConnectError, parse_message
from .process import failure, shorten
from .watch import TYPES, command, lines_of, started

STORE = "/tmp/.kernelhost-watchers"
ID = re.compile(r"w[0-9a-f]{16}")
REMOVE_TIMEOUT = 10.0  # seconds a removed watcher's process may take to end
MAX_EVENTS_BYTES = 16 << 20  # of events read in one poll (a watcher never polled holds more)


def _id(message: dict[str, Any]) -> str:
    watcher_id = message.get("watcherId", message.get("watcher_id"))
    if not isinstance(watcher_id, str) or not ID.fullmatch(watcher_id):
        raise ConnectError("not_found", f"watcher with id {str(watcher_id)[:40]!r} not found")
    return watcher_id


def _process(request: web.Request, sbx: Sandbox, watcher_id: str) -> Process:
    for proc in runtime(request).manager.processes.of(sbx):
        if proc.info.get("watcher") == watcher_id:
            return proc
    raise ConnectError("not_found", f"watcher with id {watcher_id} not found")


async def _create(request: web.Request, sbx: Sandbox, message: dict[str, Any]) -> dict[str, Any]:
    path = message_path(request, message)
    if message.get("includeEntry") or message.get("include_entry"):
        raise ConnectError("unimplemented", "watch events with their entry (include_entry) are not supported")
    watcher_id = "w" + secrets.token_hex(8)
    line = command(path, bool(message.get("recursive")), f"{STORE}/{watcher_id}")
    info = {"watch": shorten(path), "watcher": watcher_id}
    proc = await runtime(request).manager.processes.start(sbx, line, None, info=info, user="root")
    lines = lines_of(proc.listen())
    try:
        async with contextlib.aclosing(lines):
            await started(lines)
    except BaseException:
        with contextlib.suppress(SandboxError, TimeoutError):
            await proc.signal("KILL")
        raise
    return {"watcherId": watcher_id}


async def _read(request: web.Request, sbx: Sandbox, path: str) -> bytes:
    """A file of the watcher's store (empty if it is not there), at most ``MAX_EVENTS_BYTES``."""
    files = runtime(request).manager.files
    try:
        _, chunks = await files.read_file(sbx, path)
    except PathNotFound:
        return b""
    out = bytearray()
    async for chunk in chunks:  # read to its end (the transfer's own), kept up to the cap
        out += chunk[: MAX_EVENTS_BYTES - len(out)]
    return bytes(out)


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _events(request: web.Request, sbx: Sandbox, message: dict[str, Any]) -> dict[str, Any]:
    watcher_id = _id(message)
    _process(request, sbx, watcher_id)
    store = f"{STORE}/{watcher_id}"
    try:
        ack = int((await _read(request, sbx, f"{store}/ack")) or b"0")
    except ValueError:
        ack = 0
    events, last = [], ack
    for raw in (await _read(request, sbx, f"{store}/events")).splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # cut at the read's cap
        seq, kind = line.get("seq") if isinstance(line, dict) else None, TYPES.get(str(line.get("type")))
        if isinstance(seq, int) and seq > ack and kind is not None and isinstance(line.get("name"), str):
            events.append({"name": line["name"], "type": kind})
            last = max(last, seq)
    if last > ack:
        await runtime(request).manager.files.write_file(sbx, f"{store}/ack", _one(str(last).encode()))
    return {"events": events}


async def _remove(request: web.Request, sbx: Sandbox, message: dict[str, Any]) -> dict[str, Any]:
    watcher_id = _id(message)
    proc = _process(request, sbx, watcher_id)
    with contextlib.suppress(SandboxError, TimeoutError):
        await proc.signal("KILL")
        if proc.task is not None:  # gone from the sandbox's processes once this answers
            async with asyncio.timeout(REMOVE_TIMEOUT):
                await asyncio.shield(proc.task)
    with contextlib.suppress(PathNotFound):
        await runtime(request).manager.files.remove_file(sbx, f"{STORE}/{watcher_id}", recursive=True)
    return {}


METHODS = {"CreateWatcher": _create, "GetWatcherEvents": _events, "RemoveWatcher": _remove}


async def watcher_call(request: web.Request) -> web.Response:
    method = METHODS[request.path.rsplit("/", 1)[-1]]
    try:
        message = parse_message(await request.read())
        reply = await method(request, sandbox_of(request), message)
    except ConnectError as exc:
        return web.json_response(exc.wire(), status=exc.status)
    except SandboxError as exc:
        return failure(exc)
    return web.json_response(reply, content_type=UNARY_CONTENT_TYPE)


def add_routes(app: web.Application, prefix: str) -> None:
    for method in METHODS:
        app.router.add_post(f"{prefix}/filesystem.Filesystem/{method}", watcher_call)
