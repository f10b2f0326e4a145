"""A template's files on the wire: a tar archive (optionally gzip-compressed). The SDK, the
CLI and the operator's spec files pack local paths into one (``pack_files``, with the
``files`` entries of a TOML spec read by ``local_files``); the service unpacks it into a
staging directory (``unpack_archive``), checked member by member before a byte is written:
regular files and directories only, relative paths that stay inside, a size budget.

Standard library only: the SDK imports it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import shutil
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["ArchiveError", "local_files", "pack_files", "unpack_archive"]


class ArchiveError(ValueError):
    """The archive cannot be a template's files; the message names the member and the fix."""


def unpack_archive(data: bytes, dest: Path, max_bytes: int) -> str:
    """Unpack ``data`` into ``dest`` (created; removed again on failure); its sha256."""
    digest = hashlib.sha256(data).hexdigest()
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ArchiveError(f"files: not a tar archive (plain or gzip-compressed): {exc}") from None
    members = _checked(archive, max_bytes)
    dest.mkdir(parents=True)
    try:
        for member in members:
            target = dest / member.name
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = archive.extractfile(member)
            assert source is not None
            with source, target.open("wb") as out:
                shutil.copyfileobj(source, out)
            target.chmod(0o755 if member.mode & 0o111 else 0o644)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return digest


def _checked(archive: tarfile.TarFile, max_bytes: int) -> list[tarfile.TarInfo]:
    total = 0
    members = []
    for member in archive:
        path = PurePosixPath(member.name)
        if path.is_absolute() or ".." in path.parts or not member.name.strip("./"):
            raise ArchiveError(f"files: member {member.name!r:.200} leaves the archive; use relative paths")
        if not (member.isfile() or member.isdir()):
            raise ArchiveError(
                f"files: member {member.name!r:.200} is a link or a device; only files and directories "
                "are copied (resolve links before packing)"
            )
        total += member.size
        if total > max_bytes:
            raise ArchiveError(f"files: the archive unpacks to more than {max_bytes} bytes (max_file_bytes)")
        member.name = str(path)
        members.append(member)
    return members


def pack_files(entries: list[tuple[Path, str]]) -> bytes:
    """A gzip tar of local paths (files or directories), each at its guest path relative to
    ``/`` (``entries``: ``(local path, absolute guest path)``)."""
    buf = io.BytesIO()
    # the same files pack to the same bytes (no time in the gzip header, directories walked in
    # order), so an unchanged template is a cache hit
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as archive:
        for local, guest in entries:
            if not local.exists():
                raise ArchiveError(f"files: {local} does not exist")
            archive.add(str(local), arcname=guest.lstrip("/"), filter=_plain)
    return buf.getvalue()


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Owner and group are the guest's business (root), not the packer's."""
    if info.issym() or info.islnk():
        raise ArchiveError(f"files: {info.name} is a link; copy what it points to instead")
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def local_files(files: Any, root: Path) -> list[tuple[Path, str]]:
    """The ``files`` of a TOML spec as (local path, guest path): ``"path"`` (relative to
    ``root``; to ``/home/user/<name>``) or ``{src = "path", dest = "/guest/path"}``."""
    if files is None:
        return []
    if not isinstance(files, list):
        raise ArchiveError("files: must be a list of paths or {src, dest} tables")
    entries = []
    for item in files:
        if isinstance(item, str):
            src, dest = item, f"/home/user/{Path(item).name}"
        elif (
            isinstance(item, dict) and isinstance(item.get("src"), str) and isinstance(item.get("dest"), str)
        ):
            src, dest = item["src"], item["dest"]
        else:
            raise ArchiveError(f"files: {item!r:.80} is neither a path nor a {{src, dest}} table")
        if not dest.startswith("/"):
            raise ArchiveError(f"files: dest {dest!r:.80} must be an absolute guest path")
        entries.append(((root / src).expanduser(), dest))
    return entries
