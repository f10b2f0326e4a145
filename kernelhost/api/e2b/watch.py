"""envd's ``filesystem.Filesystem/WatchDir`` (``files.watch_dir`` in E2B's SDKs): changes under a
directory of the sandbox, streamed as filesystem events.

The watcher is a background process of the sandbox (``kernelhost/sandboxes/inside/processes.py``) that
polls the directory every ``POLL_SECONDS`` and prints one JSON line per change: create, write
(a file's size or mtime changed), remove and chmod; a rename shows as a remove and a create, as
polling cannot pair them. It runs beside the sandbox's code, and ends with the stream (the
client's ``stop()``, its timeout, or a hang-up). A change and its undo between two polls is not
seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from aiohttp import web

from ...sandboxes import End, Process, SandboxError, Stream
from .common import HOME, message_path, runtime, sandbox_of, with_keepalives
from .connect import STREAM_CONTENT_TYPE, ConnectError, end_stream, envelope, parse_stream_request
from .process import deadline, failure, keepalive_interval, shorten

POLL_SECONDS = 0.2
STARTUP_TIMEOUT = 60.0
TYPES = {
    "create": "EVENT_TYPE_CREATE",
    "write": "EVENT_TYPE_WRITE",
    "remove": "EVENT_TYPE_REMOVE",
    "chmod": "EVENT_TYPE_CHMOD",
}
# argv: the directory, 1 for recursive, the poll period, and (a watcher polled by id) the
# directory that keeps its events; first line {"ready": true} or {"error", "code"}. Polled by
# id, each event is a line {"seq", "name", "type"} of STORE/events; the host writes the last
# seq it took to STORE/ack, and the watcher drops the lines up to it (only it writes events)
WATCHER = r"""
import json, os, stat, sys, time
root, recursive = sys.argv[1], sys.argv[2] == "1"
store = sys.argv[4] if len(sys.argv) > 4 else ""
seq = 0
def say(**event):
    global seq
    if store and "name" in event:
        seq += 1
        with open(os.path.join(store, "events"), "a") as f:
            f.write(json.dumps({"seq": seq, **event}) + "\n")
        return
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()
def trim():
    try:
        with open(os.path.join(store, "ack")) as f:
            ack = int(f.read() or 0)
        with open(os.path.join(store, "events")) as f:
            lines = f.readlines()
    except (OSError, ValueError):
        return
    keep = [line for line in lines if json.loads(line)["seq"] > ack]
    if len(keep) < len(lines):
        with open(os.path.join(store, "events.new"), "w") as f:
            f.writelines(keep)
        os.replace(os.path.join(store, "events.new"), os.path.join(store, "events"))
if store:
    os.makedirs(store, exist_ok=True)
if not os.path.isdir(root):
    code = "invalid_argument" if os.path.exists(root) else "not_found"
    say(error=f"{root} is not a directory", code=code)
    sys.exit(0)
def scan():
    seen = {}
    todo = [""]
    while todo:
        rel = todo.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel)))
        except OSError:
            continue
        for e in entries:
            name = os.path.join(rel, e.name)
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            seen[name] = (st.st_mtime_ns, st.st_size, st.st_mode)
            if recursive and stat.S_ISDIR(st.st_mode):
                todo.append(name)
    return seen
old = scan()
say(ready=True)
while True:
    time.sleep(float(sys.argv[3]))
    if store:
        trim()
    new = scan()
    for name in sorted(new.keys() - old.keys()):
        say(name=name, type="create")
        if not stat.S_ISDIR(new[name][2]) and new[name][1] > 0:
            say(name=name, type="write")
    for name in sorted(old.keys() - new.keys()):
        say(name=name, type="remove")
    for name in sorted(new.keys() & old.keys()):
        (m0, s0, mode0), (m1, s1, mode1) = old[name], new[name]
        if mode0 != mode1:
            say(name=name, type="chmod")
        if (m0, s0) != (m1, s1) and not stat.S_ISDIR(mode1):
            say(name=name, type="write")
    old = new
"""


def command(path: str, recursive: bool, store: str = "") -> str:
    argv = ["python3", "-u", "-c", WATCHER, path, "1" if recursive else "0", str(POLL_SECONDS)]
    return f"cd {HOME} && exec {shlex.join(argv + ([store] if store else []))}"


async def lines_of(events: AsyncIterator[Any]) -> AsyncGenerator[dict[str, Any], None]:
    """The watcher's JSON lines; ends with the process."""
    pending = ""
    async for event in events:
        if isinstance(event, Stream) and event.name == "stdout":
            pending += event.text
            *lines, pending = pending.split("\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    yield json.loads(line)
        elif isinstance(event, End):
            return


async def watch_dir(request: web.Request) -> web.StreamResponse:
    try:
        message = parse_stream_request(await request.read())
        path = message_path(request, message)
        sbx = sandbox_of(request)
        processes = runtime(request).manager.processes
        line = command(path, bool(message.get("recursive")))
        # as root, as envd's watches: any directory the call may name
        proc = await processes.start(sbx, line, deadline(request), info={"watch": shorten(path)}, user="root")
    except ConnectError as exc:
        return web.json_response(exc.wire(), status=exc.status)
    except SandboxError as exc:
        return failure(exc)
    try:
        return await _stream(request, proc)
    finally:
        with contextlib.suppress(SandboxError, TimeoutError):
            await proc.signal("KILL")


async def started(lines: AsyncIterator[dict[str, Any]]) -> None:
    """The watcher's first line: ``ConnectError`` unless it says it is ready."""
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT):
            first = await anext(lines, None)
    except TimeoutError:
        first = {"error": f"the watcher did not start within {STARTUP_TIMEOUT:g}s", "code": "unavailable"}
    if first is None or "error" in first:
        why = (first or {}).get("error", "the watcher ended before it started")
        raise ConnectError(str((first or {}).get("code", "internal")), str(why))


async def _stream(request: web.Request, proc: Process) -> web.StreamResponse:
    lines = lines_of(proc.listen())
    async with contextlib.aclosing(lines):
        try:
            await started(lines)
        except ConnectError as err:
            return web.json_response(err.wire(), status=err.status)
        resp = web.StreamResponse(headers={"Content-Type": STREAM_CONTENT_TYPE})
        await resp.prepare(request)
        await resp.write(envelope({"start": {}}))
        await _relay(resp, lines, keepalive_interval(request))
        await resp.write_eof()
        return resp


async def _relay(resp: web.StreamResponse, lines: AsyncIterator[dict[str, Any]], keepalive: float) -> None:
    """Events as they come, a keepalive when there are none; an end once the watcher ends."""
    async with contextlib.aclosing(with_keepalives(lines, keepalive)) as items:
        async for line in items:
            if line is None:
                await resp.write(envelope({"keepalive": {}}))
                continue
            kind = TYPES.get(str(line.get("type")))
            if kind is not None and isinstance(line.get("name"), str):
                await resp.write(envelope({"filesystem": {"name": line["name"], "type": kind}}))
    await resp.write(end_stream(ConnectError("unavailable", "the watch ended")))


def add_routes(app: web.Application, prefix: str) -> None:
    app.router.add_post(f"{prefix}/filesystem.Filesystem/WatchDir", watch_dir)
