"""File ops: ``fs_stat``, ``fs_read``, ``fs_write``, ``fs_rename``, ``fs_list``, ``fs_remove``.

Stateless ops on paths; relative ones are under the kernel's working directory (``/home/user``),
absolute ones are taken as they are (the whole guest is the user's). An OSError is answered
``ok=True`` with ``{"oserror": {"errno": "ENOENT", "message", "path"}}`` so the host can map it to
its own error; a field of the wrong type or out of range is refused (``ok=False``).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Mapping
from typing import Any

from .config import AgentConfig
from .dispatch import Handler
from .shared import protocol

__all__ = ["Files"]

PATH_MAX = 4096
CHUNK_MAX = 4 << 20  # bytes of one fs_read or fs_write
LIST_MAX = 10000  # entries of one fs_list
OFFSET_MAX = 1 << 62


class Files:
    """The file area."""

    capability = protocol.Capability.FILES

    def __init__(self, config: AgentConfig) -> None:
        self.base = config.kernel_cwd
        self.identity = config.identity

    def ops(self) -> Mapping[str, Handler]:
        """The fs_* ops."""
        return {
            protocol.Op.FS_STAT: self.op_fs_stat,
            protocol.Op.FS_READ: self.op_fs_read,
            protocol.Op.FS_WRITE: self.op_fs_write,
            protocol.Op.FS_RENAME: self.op_fs_rename,
            protocol.Op.FS_LIST: self.op_fs_list,
            protocol.Op.FS_REMOVE: self.op_fs_remove,
        }

    def _path(self, frame: dict[str, Any], key: str = "path") -> str:
        """The frame's path field, checked, made absolute (relative: under the kernel's cwd)."""
        path = frame.get(key)
        if not isinstance(path, str) or not path or "\0" in path or len(path) > PATH_MAX:
            raise ValueError(
                f"{key} must be a non-empty path of at most {PATH_MAX} characters without NUL, "
                f"got {path!r:.80}"
            )
        return os.path.normpath(os.path.join(self.base, path))

    async def op_fs_stat(self, frame: dict[str, Any]) -> dict[str, Any]:
        """What ``stat`` says of a path (following symlinks)."""
        path = self._path(frame)
        try:
            return {"path": path, "stat": stat_dict(os.stat(path))}
        except OSError as exc:
            return oserror(exc, path)

    async def op_fs_read(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Up to ``length`` bytes of a regular file from ``offset``, and its size."""
        path = self._path(frame)
        offset = _int_field(frame, "offset", 0, OFFSET_MAX)
        length = _int_field(frame, "length", 1, CHUNK_MAX)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.EINVAL, "Not a regular file", path)
                data = os.pread(fd, length, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            return oserror(exc, path)
        return {"path": path, "data": data, "size": st.st_size}

    async def op_fs_write(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Write ``data`` at ``offset``; ``create`` makes the parents and truncates."""
        path = self._path(frame)
        offset = _int_field(frame, "offset", 0, OFFSET_MAX)
        data = frame.get("data")
        if not isinstance(data, bytes) or len(data) > CHUNK_MAX:
            raise ValueError(
                f"data must be bytes, at most {CHUNK_MAX} of them; send larger "
                "files in pieces at increasing offsets"
            )
        create = frame.get("create") is True
        account = self.identity.resolve(frame.get("user"))  # whose what it makes is
        try:
            made = _missing(path) if create and account is not None else []
            if create:
                os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
            flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if create else 0)
            fd = os.open(path, flags, 0o644)
            try:
                view = memoryview(data)
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
            finally:
                os.close(fd)
            if account is not None:
                for made_path in made:
                    account.own(made_path)
        except OSError as exc:
            return oserror(exc, path)
        return {"path": path}

    async def op_fs_rename(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Move ``src`` to ``dst`` (replacing a file, never a directory)."""
        src, dst = self._path(frame, "src"), self._path(frame, "dst")
        try:
            if os.path.isdir(dst) and not os.path.islink(dst):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", dst)
            os.replace(src, dst)
        except OSError as exc:
            return oserror(exc, dst)
        return {"path": dst}

    async def op_fs_list(self, frame: dict[str, Any]) -> dict[str, Any]:
        """A directory's entries (not following symlinks), sorted by name, at most LIST_MAX."""
        path = self._path(frame)
        entries: list[dict[str, Any]] = []
        truncated = False
        try:
            with os.scandir(path) as it:
                for entry in it:
                    if len(entries) >= LIST_MAX:
                        truncated = True
                        break
                    if not _utf8(entry.name):
                        continue  # no name the channel could carry (msgpack strings are UTF-8)
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # vanished while listing
                    entries.append({"name": entry.name, **stat_dict(st)})
        except OSError as exc:
            return oserror(exc, path)
        entries.sort(key=lambda e: e["name"])
        return {"path": path, "entries": entries, "truncated": truncated}

    async def op_fs_remove(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Remove a file, an empty directory, or (``recursive``) a whole tree."""
        path = self._path(frame)
        recursive = frame.get("recursive") is True
        try:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                if recursive:
                    shutil.rmtree(path)
                else:
                    os.rmdir(path)
            else:
                os.unlink(path)
        except OSError as exc:
            return oserror(exc, path)
        return {"path": path}


def _missing(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet (what a write with create makes)."""
    missing: list[str] = []
    while path not in ("", "/") and not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _int_field(frame: dict[str, Any], key: str, low: int, high: int) -> int:
    value = frame.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{key} must be an integer from {low} to {high}, got {value!r:.40}")
    return value


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a name that is not UTF-8 on disk (os.fsdecode's surrogates)
        return False
    return True


def oserror(exc: OSError, path: str) -> dict[str, Any]:
    """The answer for a failed file op: the errno's name, the message, the path it was about."""
    return {
        "oserror": {
            "errno": errno.errorcode.get(exc.errno or 0, "EIO"),
            "message": exc.strerror or str(exc),
            "path": exc.filename if isinstance(exc.filename, str) else path,
        }
    }


def stat_dict(st: os.stat_result) -> dict[str, Any]:
    """What the host is told of one file."""
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        kind = "dir"
    elif stat.S_ISREG(mode):
        kind = "file"
    elif stat.S_ISLNK(mode):
        kind = "symlink"
    else:
        kind = "other"
    return {"type": kind, "size": st.st_size, "mtime": st.st_mtime, "mode": stat.S_IMODE(mode)}
