"""Shell commands for ``language="bash"``: ops ``bash``, ``bash_signal``, ``bash_reset`` and
``bash_input``.

Each command runs as its own ``bash -c`` in a new session (process group), stdin /dev/null (or a
pipe the host writes with ``bash_input``, for ``stdin: true``); the exported environment and the
working directory are saved by an EXIT trap and handed to the next command, so they persist
between calls (unless ``keep_state: false``: a background process must not bring back, when it
ends, the state it started from). Output and the end come back as Jupyter-shaped messages
whose parent msg_id is the host's run_id: iopub "stream", then shell "bash_reply" {exit_code,
signal, failure, cpu_ms, peak_memory_bytes}. A command started with ``raw_output`` (capability
``raw_output``) sends its output as ``bash_out`` frames instead, each the next bytes of its
stdout or stderr spliced from the pipe to the port (``rawout``, ``Port.write_spliced``): the agent never
copies, decodes or encodes them, and the host turns them into the same stream messages.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from . import bashprocess, bashstandby, outpipe, rawout
from .accounts import Account
from .cgroups import Cgroups
from .config import AgentConfig
from .dispatch import Handler
from .shared import codec, log, log_exception, protocol
from .tasks import TaskSet

__all__ = ["Bash"]

Send = Callable[[dict[str, Any]], bool]
#: (the head of the frame, the pipe, how many of its bytes) -> written: ``Port.write_spliced``,
#: which blocks until the frame is written (a relay thread calls it)
WriteSpliced = Callable[[codec.FrameHead, int, int], bool]

DRAIN_SECONDS = 0.5
STATE_MAX = 1 << 20
STATE_END = b"__kh_end"  # the last entry of a whole saved state
RUN_ID_MAX = 64
STDIN_BUFFER_MAX = 4 << 20  # input written but not yet read by the command
SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "KILL": signal.SIGKILL}


@dataclass
class _Run:
    """One running command and what is cleaned up after it."""

    run_id: str
    proc: subprocess.Popen[bytes]
    script: str
    state: str
    cgroup: str  # "" without cgroup2
    generation: int  # of the shell state it started from (bash_reset starts a new one)
    keep_state: bool = True  # the state its EXIT trap saves becomes the shell's
    stdin: asyncio.WriteTransport | None = None  # its stdin pipe, until closed
    task: asyncio.Task[Any] | None = None  # the relay that waits for it and reports its end
    standby: bashstandby.Standby | None = None  # the standby it runs on, if it does


class Bash:
    """The shell area: commands in flight and the state they hand to the next one."""

    capability = protocol.Capability.BASH

    def __init__(
        self,
        config: AgentConfig,
        send: Send,
        tasks: TaskSet,
        cgroups: Cgroups,
        write_spliced: WriteSpliced | None = None,
    ) -> None:
        self.config = config
        self._send = send
        self._write_spliced = write_spliced
        self._tasks = tasks
        self._cgroups = cgroups
        self.runs: dict[str, _Run] = {}
        self.env: dict[str, str] | None = None  # None: the agent's own environment
        self.cwd = config.kernel_cwd
        self._stale_cgroups: list[str] = []  # cgroups still holding background jobs
        self._generation = 0
        self._standby: bashstandby.Standby | None = None
        self._standbys = 0  # standbys started: their names
        self._stopping = False

    def ops(self) -> Mapping[str, Handler]:
        """bash, bash_signal and bash_reset."""
        return {
            protocol.Op.BASH: self.op_bash,
            protocol.Op.BASH_SIGNAL: self.op_bash_signal,
            protocol.Op.BASH_RESET: self.op_bash_reset,
        }

    def set_proxy_env(self, env: Mapping[str, str]) -> None:
        """The network mode's proxy variables, for the saved environment of later commands."""
        if self.env is not None:
            for key in protocol.NET_ENV_KEYS:
                self.env.pop(key, None)
            self.env.update(env)

    # -- ops ---------------------------------------------------------------------------------

    async def op_bash(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Start one command; answered at once with its pid, its output and end come as messages."""
        run_id, command = frame.get("run_id"), frame.get("command")
        cap = frame.get("max_output_bytes")
        if not isinstance(run_id, str) or not run_id.isalnum() or len(run_id) > RUN_ID_MAX:
            raise ValueError(
                f"run_id must be an alphanumeric string of at most {RUN_ID_MAX} characters, "
                f"got {run_id!r:.80}"
            )
        if not isinstance(command, str):
            raise ValueError(f"command must be a string, got {type(command).__name__}")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ValueError(f"max_output_bytes must be a non-negative integer or null, got {cap!r:.80}")
        if run_id in self.runs:
            raise ValueError(f"bash run {run_id} is already running; pick a new run_id")
        stdin, keep_state = frame.get("stdin", False), frame.get("keep_state", True)
        raw = frame.get("raw_output", False)
        if not all(isinstance(flag, bool) for flag in (stdin, keep_state, raw)):
            raise ValueError(
                "stdin, keep_state and raw_output must be booleans, got "
                f"{stdin!r:.20}, {keep_state!r:.20}, {raw!r:.20}"
            )
        account = self.config.identity.resolve(frame.get("user"))  # None: root
        own = account == self.config.identity.account  # the sandbox's user: the standby is theirs
        run = None if stdin or not own else self._take_standby(run_id, command)
        if run is None:
            run = self._start(run_id, command, stdin, account)
        run.keep_state = keep_state
        self.runs[run_id] = run
        if stdin:
            loop = asyncio.get_running_loop()
            run.stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, run.proc.stdin)
        budget = None if cap is None else cap + 1  # one more: the host sees the cut
        raw = raw and self._write_spliced is not None
        run.task = self._tasks.spawn(self._relay(run, budget, raw), name=f"bash-{run_id}")
        return {"pid": run.proc.pid}

    async def op_bash_signal(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Signal one command's process group (or every command's, for run_id null)."""
        run_id, name = frame.get("run_id"), frame.get("signal")
        if not isinstance(name, str) or name not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}, got {name!r:.80}")
        if run_id is not None and not isinstance(run_id, str):
            raise ValueError(f"run_id must be a string or null, got {type(run_id).__name__}")
        if run_id is None:
            targets = list(self.runs.values())
        else:
            targets = [self.runs[run_id]] if run_id in self.runs else []
        for run in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run.proc.pid, SIGNALS[name])
            if name == "KILL":  # also what left the process group (setsid, daemons)
                self._cgroups.kill(run.cgroup)
        return {"signalled": len(targets)}

    async def op_bash_input(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Write to a command's stdin; ``eof`` closes it. Never blocks: the pipe buffers up to
        STDIN_BUFFER_MAX bytes the command has not read yet, and refuses more."""
        run_id, data, eof = frame.get("run_id"), frame.get("data", b""), frame.get("eof", False)
        if not isinstance(data, bytes) or not isinstance(eof, bool):
            raise ValueError("data must be bytes and eof a boolean")
        run = self.runs.get(run_id) if isinstance(run_id, str) else None
        if run is None:
            raise ValueError(f"no bash run {run_id!r:.80} is running (it ended, or never started)")
        if run.stdin is None:
            raise ValueError(f"bash run {run_id} has no stdin open (started without it, or closed)")
        buffered = run.stdin.get_write_buffer_size()
        if data and buffered + len(data) > STDIN_BUFFER_MAX:
            raise ValueError(
                f"bash run {run_id} has {buffered} bytes of input it has not read yet; "
                "wait for it to read them before sending more"
            )
        if data:
            run.stdin.write(data)
        if eof:
            run.stdin.close()
            run.stdin = None
        return {"buffered": buffered + len(data)}

    async def op_bash_reset(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Kill every running command and forget the saved environment and directory."""
        for run in list(self.runs.values()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(run.proc.pid, signal.SIGKILL)
            self._cgroups.kill(run.cgroup)
        for path in self._stale_cgroups:  # background jobs of earlier commands
            self._cgroups.kill(path)
        self.env = None
        self.cwd = self.config.kernel_cwd
        # A command that ends after this must not bring back the state it started from.
        self._generation += 1
        return {}

    # -- one run -----------------------------------------------------------------------------

    def _start(self, run_id: str, command: str, stdin: bool = False, account: Account | None = None) -> _Run:
        """Write the command's script and start bash on it, in its own session and cgroup."""
        script, state = self._paths(run_id)
        bashstandby.write_script(script, command)
        self._prune_cgroups()
        cgroup = self._cgroups.create(f"kh-bash-{run_id}")
        env, cwd = self._environment()
        try:
            proc = self._spawn([state, script, cgroup, ""], env, cwd, stdin, account)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(script)
            if cgroup:
                self._cgroups.remove(cgroup)
            raise
        return _Run(run_id, proc, script, state, cgroup, self._generation)

    def _paths(self, name: str) -> tuple[str, str]:
        """The script and state files of a run (or standby) called ``name``."""
        bash_dir = self.config.bash_dir
        os.makedirs(bash_dir, mode=0o700, exist_ok=True)
        return os.path.join(bash_dir, name + ".sh"), os.path.join(bash_dir, name + ".state")

    def _environment(self) -> tuple[dict[str, str], str]:
        """The environment and directory the next command starts with."""
        env = dict(self.config.environ) if self.env is None else dict(self.env)
        return env, self.cwd if os.path.isdir(self.cwd) else self.config.kernel_cwd

    def _spawn(
        self, args: list[str], env: dict[str, str], cwd: str, stdin: bool, account: Account | None = None
    ) -> subprocess.Popen[bytes]:
        """bash on the prelude (``args``: its $1 to $4) as ``account`` (None: root)."""
        return bashprocess.spawn(args, env, cwd, stdin, account, self.config.identity, self._cgroups)

    # -- the standby (bashstandby) -----------------------------------------------------------

    def prepare_standby(self) -> None:
        """Start a standby for the next command, unless one waits already."""
        if self._standby is not None or self._stopping:
            return
        self._standbys += 1
        name = f"sb{os.getpid()}-{self._standbys}"  # an agent started again reuses no name
        script, state = self._paths(name)
        go = os.path.join(self.config.bash_dir, name + ".go")
        env, cwd = self._environment()
        self._prune_cgroups()
        cgroup = self._cgroups.create(f"kh-bash-{name}")
        try:
            spawn = functools.partial(self._spawn, stdin=False, account=self.config.identity.account)
            self._standby = bashstandby.start(spawn, script, state, go, cgroup, env, cwd)
        except Exception:
            log_exception("bash: cannot start a standby (commands start their own bash):")
            if cgroup:
                self._cgroups.remove(cgroup)

    def renew_standby(self) -> None:
        """Kill the waiting standby (started for the shell's user as it was) and start the next."""
        standby, self._standby = self._standby, None
        if standby is not None:
            self._drop_standby(standby)
        self.prepare_standby()

    def _take_standby(self, run_id: str, command: str) -> _Run | None:
        """The standby, given ``command``; None (and the standby killed) if there is none or it
        does not fit the shell's environment and directory now."""
        standby, self._standby = self._standby, None
        if standby is None:
            return None
        if standby.fits(*self._environment()):
            bashstandby.write_script(standby.script, command)
            if bashstandby.release(standby):
                proc, script, state, cgroup = standby.proc, standby.script, standby.state, standby.cgroup
                return _Run(run_id, proc, script, state, cgroup, self._generation, standby=standby)
        self._drop_standby(standby)
        return None

    def _drop_standby(self, standby: bashstandby.Standby) -> asyncio.Task[None]:
        """Kill a standby; the task that reaps it."""
        bashstandby.kill(standby)
        if standby.cgroup:
            self._stale_cgroups.append(standby.cgroup)
        return self._tasks.spawn(bashstandby.reap(standby), name="bash-standby-reap")

    async def _relay(self, run: _Run, cap: int | None, raw: bool = False) -> None:
        """Relay one run's output, then report its end (bash_reply), whatever happens."""
        if raw:
            budget = rawout.Budget(cap)
            outputs = [self._pump_raw(run.run_id, pipe, name, budget) for pipe, name in _pipes(run)]
        else:
            left = [cap]
            outputs = [self._pump(run.run_id, pipe, name, left) for pipe, name in _pipes(run)]
        pumps = [asyncio.ensure_future(output) for output in outputs]
        reply: dict[str, Any] = {"exit_code": None, "signal": None, "failure": None}
        try:
            reply.update(await self._wait(run))
            # A background job (`server &`) keeps the pipes open: take what is there, not wait.
            await asyncio.wait(pumps, timeout=DRAIN_SECONDS)
            if run.generation == self._generation and run.keep_state:
                self._load_state(run.state)
        except Exception as exc:  # the host must still hear that the run ended
            reply["failure"] = f"{type(exc).__name__}: {exc}"
            log_exception(f"bash run {run.run_id} failed:")
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._finish(run)
        self._emit(run.run_id, "shell", protocol.BashFrame.REPLY, reply)
        self.prepare_standby()  # for the next command, with the state this one left

    async def _wait(self, run: _Run) -> dict[str, Any]:
        """Wait for bash to exit and reap it: exit code, signal and usage figures."""
        status, rusage = await bashstandby.wait_process(run.proc.pid)
        run.proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        sig: int | None = None
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            exit_code = 128 + sig
        else:
            exit_code = os.WEXITSTATUS(status)
        # CPU from rusage (bash and the children it waited for); memory from the run's cgroup:
        # a child's ru_maxrss starts at the agent's own size, copied in by fork.
        return {
            "exit_code": exit_code,
            "signal": sig,
            "cpu_ms": round((rusage.ru_utime + rusage.ru_stime) * 1000, 1),
            "peak_memory_bytes": self._cgroups.peak(run.cgroup),
        }

    def _finish(self, run: _Run) -> None:
        """Forget a run and remove its files; its cgroup goes once its last process does."""
        self.runs.pop(run.run_id, None)
        if run.standby is not None:
            bashstandby.close(run.standby)
        if run.stdin is not None:
            run.stdin.close()
            run.stdin = None
        if run.cgroup:
            self._stale_cgroups.append(run.cgroup)
        self._prune_cgroups()
        for path in (run.script, run.state, run.state + ".names", run.state + ".funcs"):
            with contextlib.suppress(OSError):
                os.unlink(path)

    async def _pump(self, run_id: str, pipe: IO[bytes] | None, name: str, left: list[int | None]) -> None:
        """Relay one of bash's pipes as stream messages, at most ``left[0]`` bytes of both."""
        if pipe is None:
            return
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        try:
            async for data in outpipe.chunks(pipe.fileno()):
                budget = left[0]
                if budget is not None:  # past the cap: keep draining so bash never blocks
                    data = data[: max(0, budget)]
                    left[0] = max(0, budget) - len(data)
                    if not data:
                        continue
                text = decoder.decode(data)
                if text:
                    self._emit(run_id, "iopub", "stream", {"name": name, "text": text})
            text = decoder.decode(b"", final=True)
            if text:
                self._emit(run_id, "iopub", "stream", {"name": name, "text": text})
        finally:
            pipe.close()

    async def _pump_raw(self, run_id: str, pipe: IO[bytes] | None, name: str, budget: rawout.Budget) -> None:
        """Splice one of bash's pipes to the port as bash_out frames (``rawout``), within the
        run's budget; past it the pipe is drained into /dev/null, so bash never blocks."""
        if pipe is None:
            return
        assert self._write_spliced is not None
        message = {"op": protocol.Frame.BASH_OUT, "run_id": run_id, "name": name}
        head = codec.FrameHead(message, "data", self.config.max_frame_bytes)
        write = functools.partial(self._write_spliced, head)
        await rawout.run(pipe, write, budget, protocol.BASH_OUT_MAX, f"bash-{run_id}-{name}")

    def _emit(self, run_id: str, channel: str, msg_type: str, content: dict[str, Any]) -> None:
        """One Jupyter-shaped message of a run, its parent being the run_id."""
        parent = {"msg_id": run_id, "msg_type": protocol.BashFrame.REQUEST}
        msg = protocol.jupyter_message(msg_type, content, "bash", parent=parent)
        self._send({"op": protocol.Frame.JUPYTER, "channel": channel, "msg": msg})

    def _load_state(self, path: str) -> None:
        """Take the directory and exported environment the run's EXIT trap saved."""
        try:
            with open(path, "rb") as f:
                raw = f.read(STATE_MAX + 1)
        except OSError:
            return  # killed before its EXIT trap ran: the previous state stays
        if len(raw) > STATE_MAX:
            log("bash state over", STATE_MAX, "bytes; keeping the previous one")
            return
        cwd, *entries = raw.split(b"\0")
        if entries[-2:] != [STATE_END, b""]:
            log("bash state cut short (its EXIT trap was killed); keeping the previous one")
            return
        env: dict[str, str] = {}
        for entry in entries:
            key, sep, value = entry.partition(b"=")
            name = os.fsdecode(key)
            if sep and name and name not in ("_", "SHLVL") and not name.startswith("__kh"):
                env[name] = os.fsdecode(value)
        self.env = env
        self.cwd = os.fsdecode(cwd) or self.config.kernel_cwd

    def _prune_cgroups(self) -> None:
        for path in list(self._stale_cgroups):
            if self._cgroups.remove(path):  # fails while a background job of that run still lives
                self._stale_cgroups.remove(path)

    def processes(self) -> ProcessOps:
        """The ops of background processes (their own capability)."""
        return ProcessOps(self)

    def raw_output(self) -> RawOutput | None:
        """``raw_output`` of ``bash`` (its own capability), where output can be spliced."""
        return RawOutput() if self._write_spliced is not None else None

    async def stop(self, timeout: float = 2.0) -> None:
        """Kill what still runs and let the relays reap it (the agent is stopping)."""
        relays = [run.task for run in self.runs.values() if run.task is not None]
        self._stopping = True
        if self._standby is not None:
            relays.append(self._drop_standby(self._standby))
            self._standby = None
        await self.op_bash_reset({})
        if relays:
            await asyncio.wait(relays, timeout=timeout)


class ProcessOps:
    """``bash_input``, with ``stdin``/``keep_state`` of ``bash``: capability ``processes``."""

    capability = protocol.Capability.PROCESSES

    def __init__(self, bash: Bash) -> None:
        self.bash = bash

    def ops(self) -> Mapping[str, Handler]:
        return {protocol.Op.BASH_INPUT: self.bash.op_bash_input}


class RawOutput:
    """``bash`` with ``raw_output``: output as bash_out frames (capability ``raw_output``)."""

    capability = protocol.Capability.RAW_OUTPUT

    def ops(self) -> Mapping[str, Handler]:
        return {}


def _pipes(run: _Run) -> list[tuple[IO[bytes] | None, str]]:
    return [(run.proc.stdout, "stdout"), (run.proc.stderr, "stderr")]
