"""A template's files on the wire: a gzip-compressed tar archive. The SDK, the CLI and the
operator's spec files pack local paths into one (``pack_files``, with the ``files`` entries of
a TOML spec read by ``local_files``). The service never opens it: the template's build VM
checks it member by member as it unpacks (``guest-image/layer.py``: regular files and
directories only, relative paths, a member count and a size budget).

Standard library only: the SDK imports it.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path
from typing import Any

__all__ = ["ArchiveError", "local_files", "pack_files"]


class ArchiveError(ValueError):
    """The archive cannot be a template's files; the message names the member and the fix."""


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
