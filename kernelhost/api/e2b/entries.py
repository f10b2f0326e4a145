"""envd's file entries (``EntryInfo``) as E2B gives them, for ``ListDir``, ``Stat`` and
``Move``: name, type, path, size, mode, permissions, owner, group, modified time and, for a
symlink, its target.

The guest agent's file ops do not say who owns a file or where a link points, so a small
script (``LISTER``) reads them in the sandbox, as a process of the service's beside the
sandbox's calls (``kernelhost/sandboxes/processes.py``), and prints one JSON line per entry.
The host only parses those lines (capped in number and length) into envd's shape: a listing
walks depth first, each directory's entries by name (Go's ``filepath.WalkDir``, which envd
uses); a symlink is not followed into, and carries ``isSymlink``, its resolved target, the
target's type and mode and the link's own permissions string (envd's ``GetEntryInfo``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import shlex
import stat
from typing import Any

from ...sandboxes import End, InvalidRequest, PathNotFound, Sandbox, Stream
from .common import runtime
from .connect import ConnectError

HOME = "/home/user"
MAX_LINE = 16384  # characters of one entry's line (a path is at most 4096 bytes)
LISTER_TIMEOUT = 60.0  # seconds the script may take
KIND = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
# argv: stat|list, the path, the depth, the most entries; one JSON line per entry, then
# {"end": true, "truncated": bool}, or {"error", "code"} alone
LISTER = r"""
import grp, json, os, pwd, stat, sys
what, path, depth, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def say(**o):
    sys.stdout.write(json.dumps(o) + "\n")
def owner(table, num):
    try:
        return table(num)[0]
    except (KeyError, OverflowError):
        return str(num)
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
def walk(root, level, left):
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
            left = walk(full, level + 1, left)
    return left
try:
    if what == "stat":
        say(**entry(path))
        say(end=True, truncated=False)
        sys.exit(0)
    root = os.path.realpath(path, strict=True)
    if not os.path.isdir(root):
        say(error=f"path is not a directory: {path}", code="invalid_argument")
        sys.exit(0)
except FileNotFoundError:
    say(error=f"path not found: {path}", code="not_found")
    sys.exit(0)
except OSError as exc:
    say(error=f"{path}: {exc.strerror}", code="invalid_argument")
    sys.exit(0)
left = walk(root, 1, cap)
say(end=True, truncated=left <= 0)
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


async def read_entries(
    request: Any, sbx: Sandbox, what: str, path: str, depth: int = 1
) -> tuple[list[dict[str, Any]], bool]:
    """The entries of ``path`` (``stat``: the path itself; ``list``: the tree under it,
    ``depth`` levels), at most ``max_list_entries``, and whether the listing stopped there.
    ``ConnectError`` for a path that is missing or not a directory."""
    manager = runtime(request).manager
    cap = manager.settings.max_list_entries
    argv = ["python3", "-c", LISTER, what, path, str(depth), str(cap)]
    proc = await manager.processes.start(
        sbx, f"cd {HOME} && exec {shlex.join(argv)}", LISTER_TIMEOUT, info={"entries": what}, own=True
    )
    entries: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(LISTER_TIMEOUT + 5):
            ended = await _collect(proc.listen(), entries, cap)
    except TimeoutError:
        raise ConnectError("deadline_exceeded", f"listing {path!r} took over {LISTER_TIMEOUT:g}s") from None
    finally:
        if proc.end is None:
            with contextlib.suppress(Exception):
                await proc.signal("KILL")
    if "error" in ended:
        code = str(ended.get("code"))
        if code == "not_found":
            raise PathNotFound(str(ended["error"]))
        raise InvalidRequest(str(ended["error"]))
    if not ended.get("end"):
        raise ConnectError("internal", f"the sandbox did not list {path!r}")
    return entries, ended.get("truncated") is True


async def _collect(events: Any, entries: list[dict[str, Any]], cap: int) -> dict[str, Any]:
    """The script's entries into ``entries``; its last line (``end`` or ``error``)."""
    pending = ""
    async with contextlib.aclosing(events):
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
                    if "end" in line or "error" in line:
                        return line
                    if len(entries) < cap:
                        entries.append(wire_entry(line))
                except ValueError:
                    raise ConnectError("internal", "the sandbox's listing is not readable") from None
    return {}
