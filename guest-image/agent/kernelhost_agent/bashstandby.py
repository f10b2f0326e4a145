"""A bash started ahead for the next command (``Bash``'s standby).

Starting bash costs tens of milliseconds under emulation (a fork and an exec, the dynamic loader,
bash's own start-up), and a command waited for all of it. The standby is the ``bash -c PRELUDE``
of the next command, started once the previous one ended (and when the agent starts, so a
template's clones have one), with the environment and directory that command will have, in a
session and cgroup of its own, blocked opening a FIFO (its go). A command that finds it, and
that does not ask for stdin, writes its script and the go; bash reads the script and runs on. A
standby whose environment or directory is no longer the shell's is killed, and the command
starts its own bash as it would without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from . import outpipe

__all__ = [
    "GO_SECONDS",
    "Standby",
    "kill",
    "make_fifo",
    "reap",
    "release",
    "running",
    "wait_process",
    "write_script",
]

#: the longest a command waits for a standby still starting to reach its FIFO
GO_SECONDS = 2.0
_POLL = 0.002


@dataclass
class Standby:
    """A bash waiting for its command, and what it was started with."""

    proc: subprocess.Popen[bytes]
    script: str  # where its command is to be written
    state: str
    go: str  # the FIFO it opens, then reads a line from, before it reads the script
    cgroup: str
    env: dict[str, str]
    cwd: str

    def fits(self, env: dict[str, str], cwd: str) -> bool:
        """Whether it was started with the environment and directory a command has now."""
        return self.cwd == cwd and self.env == env


def running(pid: int) -> bool:
    """Whether the child ``pid`` has not exited (it is not reaped here)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


async def release(standby: Standby, timeout: float = GO_SECONDS) -> bool:
    """Give the standby its go (its command is in its script): True once written; False if it
    exited, or did not open its FIFO within ``timeout`` seconds (it is then the caller's to kill)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(standby.go, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:  # ENXIO: no reader yet, bash is still starting
            if exc.errno != errno.ENXIO or not running(standby.proc.pid) or time.monotonic() > deadline:
                return False
        await asyncio.sleep(_POLL)
    try:
        os.write(fd, b"go\n")
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(standby.go)  # bash has it open; the name is no longer needed
    return True


def kill(standby: Standby) -> None:
    """Kill the standby's session and remove its files; the caller reaps it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(standby.proc.pid, signal.SIGKILL)
    for pipe in (standby.proc.stdout, standby.proc.stderr):
        if pipe is not None:
            pipe.close()
    for path in (standby.script, standby.state, standby.go):
        with contextlib.suppress(OSError):
            os.unlink(path)


async def reap(standby: Standby) -> None:
    """Wait for a killed standby to exit, and reap it."""
    status, _ = await wait_process(standby.proc.pid)
    standby.proc.returncode = os.waitstatus_to_exitcode(status)


def write_script(path: str, command: str) -> None:
    """The file a run's prelude reads its command from."""
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(command)


def make_fifo(path: str) -> None:
    """A standby's go: a FIFO only the agent and that bash use."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.mkfifo(path, 0o600)


async def wait_process(pid: int) -> tuple[int, Any]:
    """Wait for a child without a thread (pidfd), then reap it: (wait status, rusage)."""
    pidfd = os.pidfd_open(pid)
    try:
        await outpipe.readable(pidfd, None)  # a pidfd reads ready once the process has exited
    finally:
        os.close(pidfd)
    _, status, rusage = os.wait4(pid, 0)  # noqa: ASYNC222 (it has exited: returns at once)
    return status, rusage
