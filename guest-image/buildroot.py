"""A writable root over a built image, for building a template layer: the image's read-only erofs
root, loop-mounted, under an overlay whose upper directory collects every change. The upper
directory, packed as erofs, is the layer; the guest stacks it over the same root (``init``).

``BuildRoot`` mounts what a chroot needs (``/proc``, ``/dev``, the host's resolver, the host's
``file://`` package indexes read-only) and takes all of it down again, in reverse, whatever
happened: ``unmount_all(work)`` also clears what a killed build left mounted. Nothing it adds
for the build (mount points, the resolver file) stays in the layer.

Standard library only, like build.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from types import TracebackType

__all__ = ["BuildRoot", "unmount_all"]


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path``, deepest first."""
    prefix = str(path.resolve())
    found = []
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            point = line.split()[1].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def unmount_all(work: Path) -> None:
    """Unmount everything under ``work`` (idempotent; lazily if something still holds it)."""
    for point in mounts_under(work):
        if subprocess.run(["umount", point], capture_output=True).returncode:
            subprocess.run(["umount", "-l", point], capture_output=True)


class BuildRoot:
    """``with BuildRoot(rootfs, work, binds) as root:`` a writable root over ``rootfs`` at
    ``root.path``; its changes land in ``root.upper``."""

    def __init__(self, rootfs: Path, work: Path, binds: list[str]) -> None:
        self.rootfs = rootfs
        self.work = work
        self.lower = work / "lower"
        self.upper = work / "upper"
        self.path = work / "root"
        self.binds = binds  # host directories made visible at the same path, read-only
        self._created: list[Path] = []  # what was made in the root for the build, to remove

    def __enter__(self) -> BuildRoot:
        for d in (self.lower, self.upper, self.work / "ovl", self.path):
            d.mkdir(parents=True, exist_ok=True)
        try:
            _run(["mount", "-t", "erofs", "-o", "ro,loop", str(self.rootfs), str(self.lower)])
            opts = f"lowerdir={self.lower},upperdir={self.upper},workdir={self.work / 'ovl'}"
            _run(["mount", "-t", "overlay", "-o", opts, "overlay", str(self.path)])
            _run(["mount", "-t", "proc", "proc", str(self.path / "proc")])
            _run(["mount", "--rbind", "/dev", str(self.path / "dev")])
            self._bind_file("/etc/resolv.conf")
            for host_dir in self.binds:
                self._bind_dir(host_dir)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Take down every mount (deepest first) except the overlay and its lower, then remove
        what the build added for itself, then the overlay. Idempotent."""
        for point in mounts_under(self.path):
            if point != str(self.path.resolve()):
                subprocess.run(["umount", "-l", point], capture_output=True)
        for made in reversed(self._created):
            with contextlib.suppress(OSError):
                if made.is_dir() and not made.is_symlink():
                    made.rmdir()
                else:
                    made.unlink()
        self._created.clear()
        unmount_all(self.work)

    def chroot(self, argv: list[str], env: dict[str, str], cwd: str = "/") -> subprocess.Popen[str]:
        """Start ``argv`` in the root, stdout and stderr together, line by line."""
        return subprocess.Popen(
            ["chroot", str(self.path), "/usr/bin/env", "-i", *[f"{k}={v}" for k, v in env.items()], *argv],
            cwd=str(self.path / cwd.lstrip("/"))
            if (self.path / cwd.lstrip("/")).is_dir()
            else str(self.path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=False,
        )

    def _make(self, inside: Path, directory: bool) -> None:
        """Create ``inside`` (and missing parents) for the build, remembering each to remove."""
        missing = []
        p = inside
        while not p.exists() and not p.is_symlink():
            missing.append(p)
            p = p.parent
        for q in reversed(missing):
            if q == inside and not directory:
                q.touch()
            else:
                q.mkdir()
            self._created.append(q)

    def _bind_file(self, host_file: str) -> None:
        if not os.path.isfile(host_file):
            return
        inside = self.path / host_file.lstrip("/")
        if inside.is_symlink():  # e.g. a resolv.conf link into /run: bind over a file of ours
            return
        self._make(inside, directory=False)
        _run(["mount", "--bind", "-o", "ro", host_file, str(inside)])

    def _bind_dir(self, host_dir: str) -> None:
        if not os.path.isdir(host_dir):
            return
        inside = self.path / host_dir.lstrip("/")
        self._make(inside, directory=True)
        _run(["mount", "--bind", host_dir, str(inside)])
        _run(["mount", "-o", "remount,bind,ro", str(inside)])


def remove_build_litter(root: Path) -> None:
    """What a build leaves that no sandbox needs: apt's lists and downloads, caches, logs."""
    for pattern in (
        "var/lib/apt/lists/*",
        "var/cache/apt/*.bin",
        "var/cache/apt/archives/*.deb",
        "root/.cache",
        "var/log/apt",
        "var/log/dpkg.log",
        "tmp/*",
    ):
        for path in root.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
