"""envd's file entries (``EntryInfo``) as E2B gives them, for ``ListDir``, ``Stat`` and
``Move``: name, type, path, size, mode, permissions, owner, group, modified time and, for a
symlink, its target.

The guest agent's file ops do not say who owns a file or where a link points, so a small
script (``LISTER``) reads them in the sandbox: one process of the service's per sandbox
(``kernelhost/sandboxes/inside/processes.py``: beside the sandbox's calls, not counted against its
limits, not keeping it from idling), started at the first listing and then asked over its
stdin, one JSON request a line, answering with one JSON line per entry tagged with the
request's id (so a listing costs a round trip, not a process start). The host only parses
those lines (capped in number and length) into envd's shape: a listing walks depth first,
each directory's entries by name (Go's ``filepath.WalkDir``, which envd uses); a symlink is
not followed into, and carries ``isSymlink``, its resolved target, the target's type and mode
and the link's own permissions string (envd's ``GetEntryInfo``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import secrets
import shlex
import stat
from typing import Any

from ...sandboxes import End, InvalidRequest, PathNotFound, Process, Sandbox, Stream
from .common import HOME, runtime
from .connect import ConnectError

MAX_LINE = 16384  # characters of one entry's line (a path is at most 4096 bytes)
LISTER_TIMEOUT = 60.0  # seconds the script may take
KIND = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
# stdin: one request a line, {"id", "what": "stat" | "list", "path", "depth", "cap"}; for each,
# one JSON line per entry, then {"id", "end": true, "truncated": bool}, or {"id", "error", "code"}
LISTER = r"""
import grp, json, os, pwd, stat, sys
names = {}
def owner(table, num):
    if (table, num) not in names:
        try:
            names[table, num] = table(num)[0]
        except (KeyError, OverflowError):
            names[table, num] = str(num)
    return names[table, num]
def kind(mode):
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
def entry(full):
    st = os.lstat(full)
    out = {"path": full, "size": st.st_size, "st_mode": st.st_mode, "mtime_ns": st.st_mtime_ns,
           "owner": owner(pwd.getpwuid, st.st_uid), "group": owner(grp.getgrgid, st.st_gid),
           "type": kind(st.st_mode), "perm": stat.S_IMODE(st.st_mode) & 0o777}
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.path.realpath(full, strict=True)
        except (OSError, RuntimeError):
            target = full
        out["target"], out["type"], out["perm"] = target, "other", 0
        try:
            t = os.stat(full)
            out["type"], out["perm"] = kind(t.st_mode), stat.S_IMODE(t.st_mode) & 0o777
        except OSError:
            pass
    return out
def walk(say, root, level, depth, left):
    try:
        names = sorted(e.name for e in os.scandir(root))
    except OSError:
        return left
    for name in names:
        if left <= 0:
            return 0
        full = os.path.join(root, name)
        try:
            e = entry(full)
        except OSError:
            continue
        say(**e)
        left -= 1
        if level < depth and stat.S_ISDIR(e["st_mode"]):
            left = walk(say, full, level + 1, depth, left)
    return left
def answer(req, say):
    path = req["path"]
    try:
        if req["what"] == "stat":
            say(**entry(path))
            return say(end=True, truncated=False)
        root = os.path.realpath(path, strict=True)
        if not os.path.isdir(root):
            return say(error=f"path is not a directory: {path}", code="invalid_argument")
    except FileNotFoundError:
        return say(error=f"path not found: {path}", code="not_found")
    except OSError as exc:
        return say(error=f"{path}: {exc.strerror}", code="invalid_argument")
    left = walk(say, root, 1, int(req["depth"]), int(req["cap"]))
    say(end=True, truncated=left <= 0)
for raw in sys.stdin:
    names.clear()  # the user and group names as they are now, cached for one request
    try:
        req = json.loads(raw)
        rid = req["id"]
    except (ValueError, KeyError, TypeError):
        continue
    out = []
    def say(**o):
        out.append(json.dumps({"id": rid, **o}) + "\n")
    try:
        answer(req, say)
    except Exception as exc:
        say(error=f"{type(exc).__name__}: {exc}", code="internal")
    sys.stdout.write("".join(out))  # one write: the answer crosses the channel in few frames
    sys.stdout.flush()
"""


def permissions(st_mode: int) -> str:
    """A mode as Go's ``FileMode.String`` writes it (what envd sends): ``-rw-r--r--``,
    ``drwxr-xr-x``, ``Lrwxrwxrwx``, ``dtrwxrwxrwx`` (sticky), ``-urwxr-xr-x`` (setuid)."""
    letters = ""
    for test, letter in (
        (stat.S_ISDIR, "d"),
        (stat.S_ISLNK, "L"),
        (lambda m: stat.S_ISBLK(m) or stat.S_ISCHR(m), "D"),
        (stat.S_ISFIFO, "p"),
        (stat.S_ISSOCK, "S"),
        (lambda m: bool(m & stat.S_ISUID), "u"),
        (lambda m: bool(m & stat.S_ISGID), "g"),
        (stat.S_ISCHR, "c"),
        (lambda m: bool(m & stat.S_ISVTX), "t"),
    ):
        if test(st_mode):
            letters += letter
    rwx = "".join(c if st_mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (letters or "-") + rwx


def _timestamp(ns: int) -> str:
    when = datetime.datetime.fromtimestamp(ns // 1_000_000_000, datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S") + f".{ns % 1_000_000_000:09d}Z"


def wire_entry(line: dict[str, Any]) -> dict[str, Any]:
    """One of the script's lines as envd's ``EntryInfo`` JSON; ``ValueError`` for a line of
    the wrong shape (the guest is not trusted)."""
    path, st_mode, size, mtime = line.get("path"), line.get("st_mode"), line.get("size"), line.get("mtime_ns")
    if not isinstance(path, str) or not all(isinstance(v, int) for v in (st_mode, size, mtime)):
        raise ValueError("an entry without path, st_mode, size or mtime_ns")
    assert isinstance(st_mode, int) and isinstance(mtime, int)
    entry: dict[str, Any] = {
        "name": path.rstrip("/").rsplit("/", 1)[-1] or "/",
        "type": KIND.get(str(line.get("type")), "FILE_TYPE_UNSPECIFIED"),
        "path": path,
        "size": str(size),
        "mode": line.get("perm") if isinstance(line.get("perm"), int) else stat.S_IMODE(st_mode) & 0o777,
        "permissions": permissions(st_mode),
        "owner": str(line.get("owner", "")),
        "group": str(line.get("group", "")),
    }
    if 0 <= mtime < 10**20:
        entry["modifiedTime"] = _timestamp(mtime)
    if stat.S_ISLNK(st_mode):  # newer envd: the type is the target's, the link is marked
        entry["isSymlink"] = True
        if isinstance(line.get("target"), str):
            entry["symlinkTarget"] = line["target"]
    return entry


async def _lister(request: Any, sbx: Sandbox) -> Process:
    """The sandbox's lister, started if it has none (a second one started meanwhile by a
    concurrent call ends with its first request's answer: the lowest pid is the one used)."""
    processes = runtime(request).manager.processes
    running = [p for p in processes.of(sbx) if p.info.get("lister") and p.end is None]
    if running:
        return running[0]
    argv = ["python3", "-c", LISTER]
    line = f"cd {HOME} && exec {shlex.join(argv)}"
    # as root, as envd reads: a listing of /root, or of a directory only root may read, works
    return await processes.start(sbx, line, None, stdin=True, info={"lister": True}, own=True, user="root")


async def read_entries(
    request: Any, sbx: Sandbox, what: str, path: str, depth: int = 1
) -> tuple[list[dict[str, Any]], bool]:
    """The entries of ``path`` (``stat``: the path itself; ``list``: the tree under it,
    ``depth`` levels), at most ``max_list_entries``, and whether the listing stopped there.
    ``PathNotFound``/``InvalidRequest`` for a path that is missing or not a directory."""
    cap = runtime(request).manager.settings.max_list_entries
    proc = await _lister(request, sbx)
    rid = secrets.token_hex(8)
    entries: list[dict[str, Any]] = []
    events = proc.listen()  # its output from now: this request's answer comes after
    try:
        async with asyncio.timeout(LISTER_TIMEOUT):
            ask = {"id": rid, "what": what, "path": path, "depth": depth, "cap": cap}
            await proc.send_input((json.dumps(ask) + "\n").encode())
            ended = await _collect(events, rid, entries, cap)
    except TimeoutError:
        with contextlib.suppress(Exception):
            await proc.signal("KILL")  # a lister stuck on a path: the next call starts another
        raise ConnectError("deadline_exceeded", f"listing {path!r} took over {LISTER_TIMEOUT:g}s") from None
    finally:
        await events.aclose()
    if "error" in ended:
        if ended.get("code") == "not_found":
            raise PathNotFound(str(ended["error"]))
        raise InvalidRequest(str(ended["error"]))
    if not ended.get("end"):
        raise ConnectError("unavailable", f"the sandbox's lister ended before it listed {path!r}; retry")
    return entries, ended.get("truncated") is True


async def _collect(events: Any, rid: str, entries: list[dict[str, Any]], cap: int) -> dict[str, Any]:
    """Request ``rid``'s entries into ``entries``; its last line (``end`` or ``error``), or {}
    if the lister ended first. Other requests' lines are skipped."""
    pending = ""
    async for event in events:
        if isinstance(event, End):
            break
        if not isinstance(event, Stream) or event.name != "stdout":
            continue
        pending += event.text
        *lines, pending = pending.split("\n")
        if len(pending) > MAX_LINE:
            raise ConnectError("internal", "the sandbox's listing has a line over its limit")
        for text in lines:
            try:
                line = json.loads(text)
                if not isinstance(line, dict):
                    raise ValueError("not an object")
                if line.get("id") != rid:
                    continue
                if "end" in line or "error" in line:
                    return line
                if len(entries) < cap:
                    entries.append(wire_entry(line))
            except ValueError:
                raise ConnectError("internal", "the sandbox's listing is not readable") from None
    return {}
