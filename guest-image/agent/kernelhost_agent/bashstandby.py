"""A bash started ahead for the next command (``Bash``'s standby).

Starting bash costs tens of milliseconds under emulation (a fork and an exec, the dynamic loader,
bash's own start-up), and a command waited for all of it. The standby is the ``bash -c PRELUDE``
of the next command, started once the previous one ended (and when the agent starts, so a
template's clones have one), with the environment and directory that command will have, in a
session and cgroup of its own, blocked reading a FIFO (its go). A command that finds it, and
that does not ask for stdin, writes its script and the go; bash reads the script and runs on
(at once, or once it has started: the command never waits for it to get there). A
standby whose environment or directory is no longer the shell's is killed, and the command
starts its own bash as it would without one.

Every bash here is the image's statically linked build (Debian's bash-static, the same bash)
where there is one: under emulation the dynamic loader's relocations were most of a bash's start
(in a guest, 20 `bash -c true` took 2.45 s, 20 of bash-static 0.46 s), which a command that
follows another at once waited for. It is still called /bin/bash (its argv[0]), so $BASH and ps
say bash.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import outpipe

__all__ = [
    "BASH",
    "Standby",
    "close",
    "executable",
    "kill",
    "make_fifo",
    "reap",
    "release",
    "running",
    "start",
    "wait_process",
    "write_script",
]


BASH = "/bin/bash"  # what a command sees as its shell
BASH_STATIC = "/bin/bash-static"


@functools.cache
def executable() -> str:
    """The bash binary commands run in: the static build if the image has it."""
    return BASH_STATIC if os.access(BASH_STATIC, os.X_OK) else BASH


@dataclass
class Standby:
    """A bash waiting for its command, and what it was started with."""

    proc: subprocess.Popen[bytes]
    script: str  # where its command is to be written
    state: str
    go: str  # the FIFO it reads a line from before it reads the script
    go_fd: int  # the agent's end of it, open both ways until the run ends (so nothing blocks)
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


def release(standby: Standby) -> bool:
    """Give the standby its go (its command is in its script): bash reads it when it gets to
    its FIFO, now or once it has started. False if it has exited (the caller kills and reaps)."""
    if not running(standby.proc.pid):
        return False
    try:
        os.write(standby.go_fd, b"go\n")
    except OSError:
        return False
    return True


def kill(standby: Standby) -> None:
    """Kill the standby's session and remove its files; the caller reaps it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(standby.proc.pid, signal.SIGKILL)
    close(standby)
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


def start(
    spawn: Callable[[list[str], dict[str, str], str], subprocess.Popen[bytes]],
    script: str,
    state: str,
    go: str,
    cgroup: str,
    env: dict[str, str],
    cwd: str,
) -> Standby:
    """Make the go FIFO ``go`` and start the standby's bash with ``spawn`` (the prelude's $1 to
    $4, the environment, the directory); on failure the FIFO is gone again."""
    fd = make_fifo(go)
    try:
        proc = spawn([state, script, cgroup, go], env, cwd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(go)
        raise
    return Standby(proc, script, state, go, fd, cgroup, env, cwd)


def make_fifo(path: str) -> int:
    """A standby's go: a FIFO only the agent and that bash use, and the agent's end of it. Open
    for reading and writing, it never blocks the agent, nor bash opening it for reading."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.mkfifo(path, 0o600)
    return os.open(path, os.O_RDWR | os.O_CLOEXEC)


def close(standby: Standby) -> None:
    """Close the agent's end of the go and remove the FIFO (idempotent)."""
    if standby.go_fd >= 0:
        os.close(standby.go_fd)
        standby.go_fd = -1
    with contextlib.suppress(OSError):
        os.unlink(standby.go)


async def wait_process(pid: int) -> tuple[int, Any]:
    """Wait for a child without a thread (pidfd), then reap it: (wait status, rusage)."""
    pidfd = os.pidfd_open(pid)
    try:
        await outpipe.readable(pidfd, None)  # a pidfd reads ready once the process has exited
    finally:
        os.close(pidfd)
    _, status, rusage = os.wait4(pid, 0)  # noqa: ASYNC222 (it has exited: returns at once)
    return status, rusage
