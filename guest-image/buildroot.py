"""A writable root over a built image, for building a template layer inside the build VM: the
image's read-only erofs root (the VM's own root disk, or a loop-mounted file) under an overlay
whose upper directory collects every change. The upper directory, packed as erofs, is the
layer; the guest stacks it over the same root (``init``).

``BuildRoot`` mounts what a chroot needs (the VM's ``/proc`` and ``/dev``) and takes all of it
down again, in reverse, whatever happened: ``unmount_all(work)`` also clears what a killed build
left mounted. Nothing it adds for the build (mount points) stays in the layer. It runs inside
the throwaway build VM (``layer.py``), never on the host: what a tenant's spec names runs in
that VM's chroot. ``unmount_all`` also serves the host's own image build (``build.py``).

Standard library only, like build.py (the guest has no ``mount`` binary: busybox's is used).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["BuildRoot", "unmount_all"]


def _tool(name: str) -> list[str]:
    """``mount``/``umount`` where installed, else busybox's (the guest image has no util-linux
    mount)."""
    return [name] if shutil.which(name) else ["busybox", name]


def _run(cmd: list[str]) -> None:
    if cmd[0] in ("mount", "umount"):
        cmd = [*_tool(cmd[0]), *cmd[1:]]
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
    umount = _tool("umount")
    for point in mounts_under(work):
        if subprocess.run([*umount, point], capture_output=True).returncode:
            subprocess.run([*umount, "-l", point], capture_output=True)


class BuildRoot:
    """``with BuildRoot(rootfs, work) as root:`` a writable root over ``rootfs`` (an erofs file
    or block device) at ``root.path``; its changes land in ``root.upper``."""

    def __init__(self, rootfs: Path, work: Path) -> None:
        self.rootfs = rootfs
        self.work = work
        self.lower = work / "lower"
        self.upper = work / "upper"
        self.path = work / "root"

    def __enter__(self) -> BuildRoot:
        for d in (self.lower, self.upper, self.work / "ovl", self.path):
            d.mkdir(parents=True, exist_ok=True)
        try:
            loop = "" if self.rootfs.is_block_device() else ",loop"
            _run(["mount", "-t", "erofs", "-o", "ro" + loop, str(self.rootfs), str(self.lower)])
            opts = f"lowerdir={self.lower},upperdir={self.upper},workdir={self.work / 'ovl'}"
            _run(["mount", "-t", "overlay", "-o", opts, "overlay", str(self.path)])
            _run(["mount", "-t", "proc", "proc", str(self.path / "proc")])
            _run(["mount", "-o", "rbind", "/dev", str(self.path / "dev")])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Take down every mount (deepest first) except the overlay and its lower, then the
        overlay. Idempotent."""
        for point in mounts_under(self.path):
            if point != str(self.path.resolve()):
                subprocess.run([*_tool("umount"), "-l", point], capture_output=True)
        unmount_all(self.work)

    def chroot(
        self, argv: list[str], env: dict[str, str], cwd: str = "/", stdin: Path | None = None
    ) -> subprocess.Popen[str]:
        """Start ``argv`` in the root, stdout and stderr together, line by line; ``stdin``: a
        file (of the VM, outside the root) it reads."""
        with open(stdin or os.devnull, "rb") as source:
            return self._popen(argv, env, cwd, source)

    def _popen(self, argv: list[str], env: dict[str, str], cwd: str, source: Any) -> subprocess.Popen[str]:
        # chroot(1) starts its command in the new root's "/": env's --chdir moves it to ``cwd``
        chdir = ["--chdir", cwd] if (self.path / cwd.lstrip("/")).is_dir() else []
        variables = [f"{k}={v}" for k, v in env.items()]
        return subprocess.Popen(
            ["chroot", str(self.path), "/usr/bin/env", "-i", *chdir, *variables, *argv],
            cwd=str(self.path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=source,
            text=True,
            errors="replace",
            start_new_session=False,
        )


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
