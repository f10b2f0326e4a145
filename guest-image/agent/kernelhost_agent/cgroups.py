"""cgroup2 groups for bash commands: a memory peak, a pids limit, and a kill that reaches all.

Each bash command runs in a group of its own (when cgroup2 is there), so its figures are its own
(a child's ``ru_maxrss`` starts at the agent's size, copied in by fork), a fork bomb stays a
bounded number of processes, and KILL also reaches what left the process group (``setsid``,
daemons). Without cgroup2 (or with ``cgroup_root=None``) every call here does nothing and
commands run without these.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

from .shared import log

__all__ = ["Cgroups"]

#: Processes one bash call may hold at once (its cgroup's pids.max).
PIDS_MAX = 1024


class Cgroups:
    """Groups under one cgroup2 root (mounted on first use); ``""`` names "no group"."""

    def __init__(self, root: str | None, pids_max: int = PIDS_MAX) -> None:
        self.root = root
        self.pids_max = pids_max
        self._usable: bool | None = None  # decided on first use

    def create(self, name: str) -> str:
        """A fresh group (memory and pids controllers), or "" where that is not possible."""
        if self.root is None or not self._ready(self.root):
            return ""
        path = f"{self.root}/{name}"
        try:
            os.mkdir(path)
        except OSError as exc:
            log("cgroup2: cannot create", path, exc)
            return ""
        # a fork bomb stays a bounded number of processes, so the guest keeps answering and the
        # timeout ladder can kill the whole group
        with contextlib.suppress(OSError):
            with open(f"{path}/pids.max", "w") as f:
                f.write(str(self.pids_max))
        return path

    def _ready(self, root: str) -> bool:
        if self._usable is None:
            ok = os.path.exists(f"{root}/cgroup.controllers")
            if not ok:
                libc = ctypes.CDLL(None, use_errno=True)
                ok = libc.mount(b"cgroup2", root.encode(), b"cgroup2", 0, None) == 0
            if ok:
                for controller in ("memory", "pids"):  # one by one: a missing one spoils no other
                    try:
                        with open(f"{root}/cgroup.subtree_control", "w") as f:
                            f.write(f"+{controller}")
                    except OSError as exc:
                        log(f"cgroup2: cannot enable the {controller} controller:", exc)
            self._usable = ok
        return self._usable

    @staticmethod
    def peak(path: str) -> int | None:
        """The group's peak memory in bytes (memory.peak), if known."""
        if not path:
            return None
        try:
            with open(f"{path}/memory.peak") as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    @staticmethod
    def join(path: str, pid: int) -> None:
        """Move process ``pid`` into the group (one started as a user, who cannot move itself)."""
        if path:
            with contextlib.suppress(OSError):
                with open(f"{path}/cgroup.procs", "w") as f:
                    f.write(str(pid))

    @staticmethod
    def kill(path: str) -> None:
        """SIGKILL every process of the group."""
        if path:
            with contextlib.suppress(OSError):
                with open(f"{path}/cgroup.kill", "w") as f:
                    f.write("1")

    @staticmethod
    def remove(path: str) -> bool:
        """Remove an empty group; False while a process (a background job) still lives in it."""
        try:
            os.rmdir(path)
        except OSError:
            return False
        return True
