"""One service per state directory and domain prefix: an exclusive lock taken before the service
touches any domain.

A second ``kernelhost serve`` started by mistake with the same state (or the same domain prefix
on the same host) would otherwise reconcile first, destroying the running service's VMs as
"unknown domains", and only then fail to bind its port. ``ServiceLock`` takes a ``flock`` on
``<state_dir>/service.lock`` and on ``<run_dir>/.lock-<prefix>`` (the same prefix on one host is
the same VMs) and writes its pid into each; a start that cannot take one refuses, naming the
process that holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class ServiceLocked(RuntimeError):
    """Another running service holds this state directory or domain prefix."""


class ServiceLock:
    def __init__(self, state_dir: Path, run_dir: Path, prefix: str) -> None:
        self.paths = [state_dir / "service.lock", run_dir / f".lock-{prefix.rstrip('-')}"]
        self._fds: list[int] = []

    def acquire(self) -> None:
        """Take every lock, or none: ``ServiceLocked`` names the holder and the way out."""
        try:
            for path in self.paths:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise ServiceLocked(
                        f"another kernelhost service (pid {holder}) holds {path}; it runs with the "
                        "same state directory or domain prefix, and starting this one would "
                        "destroy its VMs. Stop it first, or give this one its own state_dir and "
                        "domain_prefix (KERNELHOST_STATE_DIR, KERNELHOST_DOMAIN_PREFIX)"
                    ) from None
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._fds.append(fd)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Let go of every lock held (idempotent)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the descriptor drops its flock
