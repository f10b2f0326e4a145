"""kernelhost guest agent.

Runs inside the VM (started by /sbin/kernelhost-init under tini). It opens the virtio-serial port
``org.kernelhost.0``, starts ipykernel with jupyter_client, and relays:

- host frames ``{"op": "jupyter", "channel": "shell"|"control"|"stdin", "msg": {...}}`` to the
  kernel's sockets, signed with the kernel's session key (the host never sees the key);
- every message of the kernel's iopub, shell, control and stdin sockets back to the host as
  ``{"op": "jupyter", "channel": ..., "msg": {...}}``.

It also answers requests ``{"op": NAME, "id": N, ...}`` with ``{"op": "reply", "id": N, "ok": ...}``:
``hello`` (answered once the kernel is ready), ``ping``, ``interrupt`` and ``restart``; the ops of
the "execution depth" section (``bash*``, ``fs_*``; see there); and it reports
``{"op": "event", "event": "kernel_died" | "kernel_restarted"}``.

Only what the guest image has is used: Python 3, jupyter_client, pyzmq, msgpack (distribution
packages) and ``codec.py``, the host's own frame codec copied in by the image build.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import datetime
import errno
import glob
import os
import queue
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.manager import AsyncKernelManager

import codec

AGENT_VERSION = 1
PORT_NAME = "org.kernelhost.0"
KERNEL_NAME = "kernelhost"
KERNEL_CWD = "/home/user"
READY_TIMEOUT = 120.0
MONITOR_INTERVAL = 0.5


def log(*parts: Any) -> None:
    print("kernelhost-agent:", *parts, file=sys.stderr, flush=True)


def find_port(name: str, timeout: float = 30.0) -> str:
    """Return the device path of the virtio-serial port called ``name`` (there is no udev)."""
    deadline = time.monotonic() + timeout
    while True:
        link = f"/dev/virtio-ports/{name}"
        if os.path.exists(link):
            return link
        for name_file in glob.glob("/sys/class/virtio-ports/*/name"):
            with open(name_file) as f:
                if f.read().strip() == name:
                    return "/dev/" + os.path.basename(os.path.dirname(name_file))
        if time.monotonic() > deadline:
            raise RuntimeError(f"virtio-serial port {name!r} did not appear within {timeout}s")
        time.sleep(0.05)


class Port:
    """The virtio-serial port, driven by one reader and one writer thread.

    While no host is connected the port reports POLLHUP and writes block; the reader then sleeps
    and retries, and the writer simply waits, so output produced meanwhile reaches the next host.
    """

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop, on_frame: Any) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.loop = loop
        self.on_frame = on_frame
        self.outbox: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read_loop, name="port-reader", daemon=True).start()
        threading.Thread(target=self._write_loop, name="port-writer", daemon=True).start()

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.outbox.put(codec.encode_frame(message))
        except codec.FrameError as exc:
            log("dropping unsendable message:", exc)

    def _read_loop(self) -> None:
        decoder = codec.FrameDecoder()
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        connected = False
        while True:
            events = poller.poll(None if connected else 1000)
            if not events:
                continue
            revents = events[0][1]
            if revents & select.POLLHUP:
                if connected:
                    log("host disconnected")
                    connected = False
                decoder = codec.FrameDecoder()
                time.sleep(0.1)
                continue
            data = os.read(self.fd, 1 << 16)
            if not data:
                time.sleep(0.1)
                continue
            if not connected:
                log("host connected")
                connected = True
            try:
                frames = decoder.feed(data)
            except codec.FrameError as exc:
                log("bad frame from host, resetting decoder:", exc)
                decoder = codec.FrameDecoder()
                continue
            for frame in frames:
                self.loop.call_soon_threadsafe(self.on_frame, frame)

    def _write_loop(self) -> None:
        while True:
            view = memoryview(self.outbox.get())
            while view:
                try:
                    n = os.write(self.fd, view)
                except BlockingIOError:
                    time.sleep(0.01)
                    continue
                except OSError as exc:  # host gone mid-write: wait for the next one
                    log("write failed, retrying:", exc)
                    time.sleep(0.1)
                    continue
                view = view[n:]


def _plain(value: Any) -> Any:
    """Make a deserialized Jupyter message msgpack-safe (dates become ISO strings)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, (memoryview, bytearray)):
        return bytes(value)
    if hasattr(value, "bytes") and not isinstance(value, (bytes, str)):  # zmq.Frame
        return bytes(value.bytes)
    return value


class Agent:
    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        # jupyter_client 7 defaults to a blocking zmq.Context; the relay needs asyncio sockets.
        self.km = AsyncKernelManager(kernel_name=KERNEL_NAME, context=zmq.asyncio.Context())
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.internal: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.ready = asyncio.Event()
        self.restarting = False
        self.kernel_info: dict[str, Any] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.port: Port | None = None
        self._depth_init()
        self.net = GuestNet(self)

    # -- kernel --------------------------------------------------------------------------------

    async def start(self) -> None:
        os.makedirs(KERNEL_CWD, exist_ok=True)
        _write_pip_conf(None)  # network mode "none" until the host says otherwise
        self.port = Port(find_port(PORT_NAME), self.loop, self.on_frame)
        t0 = time.monotonic()
        # The kernel's own fds 1 and 2 would otherwise be the serial console, a file on the host:
        # anything printed at the fd level (subprocesses, C code) must not grow the host's disk.
        # jupyter_client keeps these arguments for restarts.
        await self.km.start_kernel(cwd=KERNEL_CWD, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        for channel in ("iopub", "shell", "control", "stdin"):
            sock = getattr(self.km, f"connect_{channel}")()
            self.sockets[channel] = sock
            self.spawn(self.relay_kernel(channel, sock))
        await self.wait_kernel_ready()
        log(f"kernel ready in {time.monotonic() - t0:.2f}s")
        self.spawn(self.monitor_kernel())

    async def wait_kernel_ready(self) -> None:
        self.ready.clear()
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            try:
                reply = await self.request_kernel("shell", "kernel_info_request", {}, timeout=5.0)
            except asyncio.TimeoutError:
                continue
            self.kernel_info = reply["content"]
            self.ready.set()
            return
        raise RuntimeError(f"kernel did not answer kernel_info within {READY_TIMEOUT}s")

    async def request_kernel(
        self, channel: str, msg_type: str, content: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        """Send a message of the agent's own; its reply is not relayed to the host."""
        msg = self.km.session.msg(msg_type, content)
        fut: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        msg_id = msg["header"]["msg_id"]
        self.internal[msg_id] = fut
        try:
            await self.sockets[channel].send_multipart(self.km.session.serialize(msg))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.internal.pop(msg_id, None)

    async def relay_kernel(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        session = self.km.session
        while True:
            parts = await sock.recv_multipart(copy=True)
            try:
                _, msg_list = session.feed_identities(parts, copy=True)
                msg = session.deserialize(msg_list, content=True, copy=True)
            except Exception as exc:  # a kernel message we cannot parse is dropped, not fatal
                log(f"dropping unparsable {channel} message:", exc)
                continue
            parent_id = (msg.get("parent_header") or {}).get("msg_id")
            if parent_id in self.internal:
                if channel != "iopub" and not self.internal[parent_id].done():
                    self.internal[parent_id].set_result(msg)
                continue
            wire = {
                "header": _plain(msg["header"]),
                "parent_header": _plain(msg.get("parent_header") or {}),
                "metadata": _plain(msg.get("metadata") or {}),
                "content": _plain(msg.get("content") or {}),
                "buffers": [_plain(b) for b in msg.get("buffers") or []],
            }
            if self._depth_outgoing(channel, wire):
                self.send({"op": "jupyter", "channel": channel, "msg": wire})

    async def monitor_kernel(self) -> None:
        # Wait on the kernel process itself (a thread parked in waitpid) rather than polling:
        # an idle sandbox then costs no wake-ups here, which matters for many idle VMs under TCG.
        while True:
            proc = getattr(self.km.provisioner, "process", None)
            if proc is None or self.restarting:
                await asyncio.sleep(MONITOR_INTERVAL)
                continue
            code = await asyncio.to_thread(proc.wait)
            if self.restarting or getattr(self.km.provisioner, "process", None) is not proc:
                continue  # a restart we asked for replaced it
            log("kernel died, exit code", code)
            self.send({"op": "event", "event": "kernel_died", "exit_code": code})
            await self.restart_kernel(reason="died")

    async def restart_kernel(self, reason: str) -> None:
        self.restarting = True
        self.ready.clear()  # shell messages wait for the new kernel instead of reaching the old
        try:
            await self.km.restart_kernel(now=True)
            await self.wait_kernel_ready()
        finally:
            self.restarting = False
        self.send({"op": "event", "event": "kernel_restarted", "reason": reason})

    # -- host ----------------------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        assert self.port is not None
        self.port.send(message)

    def spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log("task failed:", repr(task.exception()))

    def on_frame(self, frame: dict[str, Any]) -> None:
        op = frame["op"]
        if op == "jupyter":
            self.spawn(self.to_kernel(frame))
        elif op == "net":
            self.net.on_frame(frame)
        elif isinstance(frame.get("id"), int) and hasattr(self, f"op_{op}"):
            self.spawn(self.answer(frame))
        else:
            self.send({"op": "reply", "id": frame.get("id"), "ok": False,
                       "error": f"unknown op {op!r}"})

    async def to_kernel(self, frame: dict[str, Any]) -> None:
        channel = frame.get("channel")
        msg = frame.get("msg")
        if channel not in ("shell", "control", "stdin") or not isinstance(msg, dict):
            log("ignoring jupyter frame for channel", channel)
            return
        if channel == "shell":
            await self.ready.wait()
        self._depth_incoming(channel, msg)
        buffers = msg.get("buffers") or []
        parts = self.km.session.serialize(msg)
        await self.sockets[channel].send_multipart(parts + list(buffers))

    async def answer(self, frame: dict[str, Any]) -> None:
        handler = getattr(self, f"op_{frame['op']}")
        try:
            result = await handler(frame)
            reply = {"op": "reply", "id": frame["id"], "ok": True, **(result or {})}
        except Exception as exc:
            reply = {"op": "reply", "id": frame["id"], "ok": False,
                     "error": f"{type(exc).__name__}: {exc}"}
        self.send(reply)

    async def op_hello(self, frame: dict[str, Any]) -> dict[str, Any]:
        await self.ready.wait()
        return {"agent_version": AGENT_VERSION, "kernel_info": self.kernel_info,
                "boot_id": BOOT_ID}

    async def op_ping(self, frame: dict[str, Any]) -> dict[str, Any]:
        return {"ready": self.ready.is_set(), "kernel_alive": await self.km.is_alive()}

    async def op_interrupt(self, frame: dict[str, Any]) -> dict[str, Any]:
        await self.km.interrupt_kernel()
        return {}

    async def op_restart(self, frame: dict[str, Any]) -> dict[str, Any]:
        await self.restart_kernel(reason="requested")
        return {"kernel_info": self.kernel_info}

    # == execution depth: output limits, usage figures, bash, files ================================
    # Ops and relay hooks of the execution-depth work (issue 3). Hooks: _depth_incoming (host ->
    # kernel) notes each execute_request's limits and the kernel's CPU time at its start;
    # _depth_outgoing (kernel -> host) caps stream output per request and puts the usage figures in
    # the execute_reply's metadata["kernelhost"]. The host re-checks everything: this side only
    # keeps the guest from pushing output nobody will keep through the channel.
    #
    # bash: each command runs as its own `bash -c` in a new session (process group), stdin
    # /dev/null; the exported environment and the working directory are saved by an EXIT trap and
    # handed to the next command, so they persist between calls. Output and the end come back as
    # Jupyter-shaped messages whose parent msg_id is the host's run_id: iopub "stream", then shell
    # "bash_reply" {exit_code, signal, cpu_ms, peak_memory_bytes}.
    #
    # files: stateless ops on paths (relative ones are under KERNEL_CWD); an OSError is answered
    # ok=True with {"oserror": {"errno": "ENOENT", "message", "path"}} so the host can map it.

    def _depth_init(self) -> None:
        self.stream_left: dict[str, int] = {}  # execute msg_id -> stream bytes it may still send
        self.usage_start: dict[str, tuple[int, int]] = {}  # msg_id -> (kernel pid, cpu ticks)
        self.bash_runs: dict[str, subprocess.Popen[bytes]] = {}
        self.bash_env: dict[str, str] | None = None  # None: the agent's own environment
        self.bash_cwd = KERNEL_CWD
        self.bash_cgroups: dict[str, str] = {}  # run_id -> its cgroup ("" without cgroup2)
        self.bash_stale_cgroups: list[str] = []  # cgroups still holding background jobs

    @staticmethod
    def _remember(table: dict[str, Any], key: str, value: Any) -> None:
        table[key] = value
        while len(table) > DEPTH_TABLE_MAX:  # replies that never came must not pile up
            table.pop(next(iter(table)))

    def _depth_incoming(self, channel: str, msg: dict[str, Any]) -> None:
        try:
            self._depth_note(channel, msg)
        except Exception as exc:  # bookkeeping only: the message goes to the kernel anyway
            log("execution depth: cannot note a request:", repr(exc))

    def _depth_note(self, channel: str, msg: dict[str, Any]) -> None:
        header = msg.get("header") if isinstance(msg.get("header"), dict) else {}
        if channel != "shell" or header.get("msg_type") != "execute_request":
            return
        msg_id = header.get("msg_id")
        if not isinstance(msg_id, str):
            return
        meta = msg.get("metadata") if isinstance(msg.get("metadata"), dict) else {}
        limits = meta.get("kernelhost") if isinstance(meta.get("kernelhost"), dict) else {}
        cap = limits.get("max_output_bytes")
        if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0:
            self._remember(self.stream_left, msg_id, cap + 1)  # one more: the host sees the cut
        pid = self._kernel_pid()
        if pid is not None:
            ticks = _cpu_ticks(pid)
            _reset_peak(pid)
            if ticks is not None:
                self._remember(self.usage_start, msg_id, (pid, ticks))

    def _depth_outgoing(self, channel: str, wire: dict[str, Any]) -> bool:
        """Adjust a kernel message on its way to the host; False drops it. Never raises: user
        code can make the kernel send odd messages, and the relay must outlive them."""
        try:
            return self._depth_adjust(channel, wire)
        except Exception as exc:
            log("execution depth: passing on a message it could not inspect:", repr(exc))
            return True

    def _depth_adjust(self, channel: str, wire: dict[str, Any]) -> bool:
        parent = wire["parent_header"].get("msg_id")
        msg_type = wire["header"].get("msg_type")
        if channel == "iopub" and msg_type == "stream" and parent in self.stream_left:
            text = wire["content"].get("text")
            if not isinstance(text, str):
                return True
            left = self.stream_left[parent]
            data = text.encode("utf-8", "surrogatepass")
            if left <= 0:
                return False
            if len(data) > left:
                wire["content"]["text"] = data[:left].decode("utf-8", "ignore")
                left = 0
            else:
                left -= len(data)
            self.stream_left[parent] = left
        elif channel == "iopub" and msg_type == "status" and parent in self.stream_left:
            if wire["content"].get("execution_state") == "idle":
                self.stream_left.pop(parent, None)
        elif channel == "shell" and msg_type == "execute_reply" and parent in self.usage_start:
            pid, ticks = self.usage_start.pop(parent)
            now = _cpu_ticks(pid)
            usage: dict[str, Any] = {}
            if now is not None:
                usage["cpu_ms"] = round((now - ticks) * 1000 / CLOCK_TICKS, 1)
            peak = _peak_rss(pid)
            if peak is not None:
                usage["peak_memory_bytes"] = peak
            wire["metadata"]["kernelhost"] = usage
        return True

    def _kernel_pid(self) -> int | None:
        pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
        return pid if isinstance(pid, int) and not isinstance(pid, bool) else None

    # -- bash --

    async def op_bash(self, frame: dict[str, Any]) -> dict[str, Any]:
        run_id, command = frame.get("run_id"), frame.get("command")
        cap = frame.get("max_output_bytes")
        if not isinstance(run_id, str) or not run_id.isalnum() or len(run_id) > 64:
            raise ValueError("run_id must be an alphanumeric string of at most 64 characters")
        if not isinstance(command, str):
            raise ValueError("command must be a string")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ValueError("max_output_bytes must be a non-negative integer or null")
        if run_id in self.bash_runs:
            raise ValueError(f"bash run {run_id} is already running")
        os.makedirs(BASH_DIR, mode=0o700, exist_ok=True)
        script = os.path.join(BASH_DIR, run_id + ".sh")
        state = os.path.join(BASH_DIR, run_id + ".state")
        with open(script, "w", encoding="utf-8", errors="surrogateescape") as f:  # noqa: ASYNC230 (tmpfs)
            f.write(command)
        env = dict(os.environ) if self.bash_env is None else dict(self.bash_env)
        cwd = self.bash_cwd if os.path.isdir(self.bash_cwd) else KERNEL_CWD
        self._bash_prune_cgroups()
        cgroup = _new_cgroup(f"kh-bash-{run_id}")
        proc = subprocess.Popen(  # noqa: ASYNC220 (fork+exec only; it is reaped via a pidfd)
            ["/bin/bash", "--noprofile", "--norc", "-c", BASH_PRELUDE, "bash", state, script,
             cgroup],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=cwd, env=env, start_new_session=True, close_fds=True, bufsize=0)
        self.bash_runs[run_id] = proc
        self.bash_cgroups[run_id] = cgroup
        self.spawn(self._bash_relay(run_id, proc, script, state,
                                    None if cap is None else cap + 1))
        return {"pid": proc.pid}

    async def _bash_relay(self, run_id: str, proc: subprocess.Popen[bytes], script: str,
                          state: str, cap: int | None) -> None:
        left = [cap]
        pumps = [asyncio.ensure_future(self._bash_pump(run_id, proc.stdout, "stdout", left)),
                 asyncio.ensure_future(self._bash_pump(run_id, proc.stderr, "stderr", left))]
        exit_code: int | None = None
        sig: int | None = None
        usage: dict[str, Any] = {}
        failure: str | None = None
        try:
            status, rusage = await _wait_process(self.loop, proc.pid)
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                exit_code = 128 + sig
            else:
                exit_code = os.WEXITSTATUS(status)
            # CPU from rusage (bash and the children it waited for); memory from the run's cgroup:
            # a child's ru_maxrss starts at the agent's own size, copied in by fork.
            usage = {"cpu_ms": round((rusage.ru_utime + rusage.ru_stime) * 1000, 1),
                     "peak_memory_bytes": _cgroup_peak(self.bash_cgroups.get(run_id, ""))}
            # A background job (`server &`) keeps the pipes open: take what is there, not wait.
            _, pending = await asyncio.wait(pumps, timeout=BASH_DRAIN_SECONDS)
            for task in pending:
                task.cancel()
            self._bash_load_state(state)
        except Exception as exc:  # the host must still hear that the run ended
            failure = f"{type(exc).__name__}: {exc}"
            log("bash run", run_id, "failed:", failure)
        finally:
            for task in pumps:
                task.cancel()
            self.bash_runs.pop(run_id, None)
            cgroup = self.bash_cgroups.pop(run_id, "")
            if cgroup:
                self.bash_stale_cgroups.append(cgroup)
            self._bash_prune_cgroups()
            for path in (script, state, state + ".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self._bash_send(run_id, "shell", "bash_reply",
                        {"exit_code": exit_code, "signal": sig, "failure": failure, **usage})

    async def _bash_pump(self, run_id: str, pipe: Any, name: str, left: list[int | None]) -> None:
        reader = asyncio.StreamReader(limit=BASH_CHUNK)
        transport, _ = await self.loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        try:
            while True:
                data = await reader.read(BASH_CHUNK)
                if not data:
                    text = decoder.decode(b"", final=True)
                    if text:
                        self._bash_send(run_id, "iopub", "stream", {"name": name, "text": text})
                    return
                budget = left[0]
                if budget is not None:  # past the cap: keep draining so bash never blocks
                    data = data[:max(0, budget)]
                    left[0] = max(0, budget) - len(data)
                    if not data:
                        continue
                text = decoder.decode(data)
                if text:
                    self._bash_send(run_id, "iopub", "stream", {"name": name, "text": text})
        finally:
            transport.close()

    def _bash_send(self, run_id: str, channel: str, msg_type: str,
                   content: dict[str, Any]) -> None:
        self.send({"op": "jupyter", "channel": channel, "msg": {
            "header": {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "session": "bash",
                       "username": "kernelhost", "version": "5.3",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat()},
            "parent_header": {"msg_id": run_id, "msg_type": "bash_request"},
            "metadata": {}, "content": content, "buffers": []}})

    def _bash_load_state(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                raw = f.read(BASH_STATE_MAX + 1)
        except OSError:
            return  # killed before its EXIT trap ran: the previous state stays
        if len(raw) > BASH_STATE_MAX:
            log("bash state over", BASH_STATE_MAX, "bytes; keeping the previous one")
            return
        cwd, *entries = raw.split(b"\0")
        env: dict[str, str] = {}
        for entry in entries:
            key, sep, value = entry.partition(b"=")
            name = os.fsdecode(key)
            if sep and name and name not in ("_", "SHLVL") and not name.startswith("__kh"):
                env[name] = os.fsdecode(value)
        self.bash_env = env
        self.bash_cwd = os.fsdecode(cwd) or KERNEL_CWD

    async def op_bash_signal(self, frame: dict[str, Any]) -> dict[str, Any]:
        run_id, name = frame.get("run_id"), frame.get("signal")
        if name not in BASH_SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(BASH_SIGNALS)}, got {name!r}")
        targets = list(self.bash_runs.items()) if run_id is None else \
            [(run_id, self.bash_runs[run_id])] if run_id in self.bash_runs else []
        for target, proc in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, BASH_SIGNALS[name])
            if name == "KILL":  # also what left the process group (setsid, daemons)
                _cgroup_kill(self.bash_cgroups.get(target, ""))
        return {"signalled": len(targets)}

    def _bash_prune_cgroups(self) -> None:
        for path in list(self.bash_stale_cgroups):
            with contextlib.suppress(OSError):
                os.rmdir(path)  # fails while a background job of that run still lives
                self.bash_stale_cgroups.remove(path)

    async def op_bash_reset(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Kill every running command and forget the saved environment and directory."""
        for run_id, proc in list(self.bash_runs.items()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            _cgroup_kill(self.bash_cgroups.get(run_id, ""))
        for path in self.bash_stale_cgroups:  # background jobs of earlier commands
            _cgroup_kill(path)
        self.bash_env = None
        self.bash_cwd = KERNEL_CWD
        return {}

    # -- files --

    @staticmethod
    def _fs_path(frame: dict[str, Any], key: str = "path") -> str:
        path = frame.get(key)
        if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096:
            raise ValueError(f"{key} must be a non-empty path of at most 4096 characters")
        return os.path.normpath(os.path.join(KERNEL_CWD, path))

    @staticmethod
    def _fs_int(frame: dict[str, Any], key: str, low: int, high: int) -> int:
        value = frame.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{key} must be an integer from {low} to {high}")
        return value

    @staticmethod
    def _oserror(exc: OSError, path: str) -> dict[str, Any]:
        return {"oserror": {"errno": errno.errorcode.get(exc.errno or 0, "EIO"),
                            "message": exc.strerror or str(exc),
                            "path": exc.filename if isinstance(exc.filename, str) else path}}

    async def op_fs_stat(self, frame: dict[str, Any]) -> dict[str, Any]:
        path = self._fs_path(frame)
        try:
            return {"path": path, "stat": _stat_dict(os.stat(path))}
        except OSError as exc:
            return self._oserror(exc, path)

    async def op_fs_read(self, frame: dict[str, Any]) -> dict[str, Any]:
        path = self._fs_path(frame)
        offset = self._fs_int(frame, "offset", 0, 1 << 62)
        length = self._fs_int(frame, "length", 1, FS_CHUNK_MAX)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "Is a directory", path) \
                        if stat.S_ISDIR(st.st_mode) else \
                        OSError(errno.EINVAL, "Not a regular file", path)
                data = os.pread(fd, length, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            return self._oserror(exc, path)
        return {"path": path, "data": data, "size": st.st_size}

    async def op_fs_write(self, frame: dict[str, Any]) -> dict[str, Any]:
        path = self._fs_path(frame)
        offset = self._fs_int(frame, "offset", 0, 1 << 62)
        data = frame.get("data")
        if not isinstance(data, bytes) or len(data) > FS_CHUNK_MAX:
            raise ValueError(f"data must be bytes, at most {FS_CHUNK_MAX} of them")
        create = frame.get("create") is True
        try:
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
        except OSError as exc:
            return self._oserror(exc, path)
        return {"path": path}

    async def op_fs_rename(self, frame: dict[str, Any]) -> dict[str, Any]:
        src, dst = self._fs_path(frame, "src"), self._fs_path(frame, "dst")
        try:
            if os.path.isdir(dst) and not os.path.islink(dst):
                raise IsADirectoryError(errno.EISDIR, "Is a directory", dst)
            os.replace(src, dst)
        except OSError as exc:
            return self._oserror(exc, dst)
        return {"path": dst}

    async def op_fs_list(self, frame: dict[str, Any]) -> dict[str, Any]:
        path = self._fs_path(frame)
        entries = []
        truncated = False
        try:
            with os.scandir(path) as it:
                for entry in it:
                    if len(entries) >= FS_LIST_MAX:
                        truncated = True
                        break
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # vanished while listing
                    entries.append({"name": entry.name, **_stat_dict(st)})
        except OSError as exc:
            return self._oserror(exc, path)
        entries.sort(key=lambda e: e["name"])
        return {"path": path, "entries": entries, "truncated": truncated}

    async def op_fs_remove(self, frame: dict[str, Any]) -> dict[str, Any]:
        path = self._fs_path(frame)
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
            return self._oserror(exc, path)
        return {"path": path}

    # -- snapshots, clones and resumes -----------------------------------------------------------

    async def run_silent(self, code: str, timeout: float = 120.0) -> None:
        """Run code in the kernel without output, history or execution count (agent's own)."""
        reply = await self.request_kernel("shell", "execute_request", {
            "code": code, "silent": True, "store_history": False, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": False,
        }, timeout=timeout)
        content = reply.get("content", {})
        if content.get("status") != "ok":
            raise RuntimeError(f"{content.get('ename')}: {content.get('evalue')}")

    async def op_net_config(self, frame: dict[str, Any]) -> dict[str, Any]:
        """The sandbox's network mode (issue 6): "none", or a proxy on 127.0.0.1:NET_PROXY_PORT
        whose connections the host opens through the channel ("allowlist", "outbound"). Sent
        after every attach (create, fork, wake, service restart): tunnels of an earlier host are
        dropped. Writes /etc/pip.conf and sets the proxy environment of the kernel and bash."""
        mode = frame.get("mode")
        if mode not in ("none", "allowlist", "outbound"):
            raise ValueError(f"mode must be none, allowlist or outbound, got {mode!r}")
        env = frame.get("env") if mode != "none" else {}
        pip = frame.get("pip") if mode != "none" else None
        if not isinstance(env, dict) or not all(
                isinstance(k, str) and k in NET_ENV_KEYS and isinstance(v, str)
                for k, v in env.items()):
            raise ValueError(f"env must map some of {', '.join(NET_ENV_KEYS)} to strings")
        if pip is not None and not isinstance(pip, dict):
            raise ValueError("pip must be a map")
        self.net.reset()
        if mode == "none":
            await self.net.stop()
        else:
            await self.net.listen()
        config = (mode, sorted(env.items()), repr(pip))
        if config != self.net.config:
            _write_pip_conf(None if mode == "none" else {**(pip or {}), "mode": mode})
            self._net_env(env)
            await self.ready.wait()
            await self.run_silent(
                "import os as _kh_os, site as _kh_site, sys as _kh_sys\n"
                f"_kh_os.environ.update({env!r})\n"
                f"for _kh_k in {sorted(set(NET_ENV_KEYS) - set(env))!r}:\n"
                "    _kh_os.environ.pop(_kh_k, None)\n"
                f"_kh_os.makedirs({PIP_SITE!r}, exist_ok=True)\n"
                f"if {PIP_SITE!r} not in _kh_sys.path:\n"
                f"    _kh_site.addsitedir({PIP_SITE!r})\n"
                "del _kh_os, _kh_site, _kh_sys", timeout=30.0)
            self.net.config = config
        return {"listening": self.net.server is not None, "port": NET_PROXY_PORT}

    def _net_env(self, env: dict[str, str]) -> None:
        """Proxy variables for kernels started later (restarts) and for bash commands."""
        os.makedirs(PIP_SITE, exist_ok=True)
        for target in (os.environ, self.bash_env):
            if target is None:
                continue
            for key in NET_ENV_KEYS:
                target.pop(key, None)
            target.update(env)

    async def op_prepare_snapshot(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Warm the kernel before its VM is frozen into a template: import the template's heavy
        modules, collect garbage, and drop the guest's page cache so the RAM file holds less."""
        await self.ready.wait()
        t0 = time.monotonic()
        modules = [m for m in frame.get("preload", []) if isinstance(m, str) and m]
        for module in modules:
            if not all(part.isidentifier() for part in module.split(".")):
                raise ValueError(f"not a module name: {module!r}")
            await self.run_silent(f"import {module}")
        # One ordinary cell of each kind a user's first call takes (a value, output, an error's
        # traceback): the modules they import lazily are in RAM before the page cache is dropped,
        # so a clone's first call is not the slow one. No history, so no execution count moves.
        for code in WARM_UP_CELLS:
            await self.request_kernel("shell", "execute_request", {
                "code": code, "silent": False, "store_history": False, "user_expressions": {},
                "allow_stdin": False, "stop_on_error": False,
            }, timeout=120.0)
        await self.run_silent(WARM_UP_CLEANUP)
        await self.run_silent("import gc as _kh_gc; _kh_gc.collect(); del _kh_gc")
        import gc

        gc.collect()
        os.sync()
        fd = os.open("/proc/sys/vm/drop_caches", os.O_WRONLY)
        try:
            os.write(fd, b"3\n")
        finally:
            os.close(fd)
        return {"preloaded": modules, "seconds": round(time.monotonic() - t0, 3)}

    async def op_resumed(self, frame: dict[str, Any]) -> dict[str, Any]:
        """After a restore, clone or resume: set the clock from the host, mix fresh entropy into
        the kernel RNG and reseed it, and reseed Python's ``random`` (and numpy's global RNG) in
        the kernel, so no two sandboxes share a random stream or a stale clock."""
        t0 = time.monotonic()
        time_ns = frame.get("time_ns")
        if isinstance(time_ns, int):
            time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)
        entropy = frame.get("entropy")
        if isinstance(entropy, bytes) and entropy:
            _add_entropy(entropy)
        await self.ready.wait()
        await self.run_silent(
            "import random as _kh_r, sys as _kh_s\n"
            "_kh_r.seed()\n"
            "if 'numpy' in _kh_s.modules:\n"
            "    _kh_s.modules['numpy'].random.seed()\n"
            "del _kh_r, _kh_s", timeout=30.0)
        return {"seconds": round(time.monotonic() - t0, 4)}


# == network (issue 6): a local HTTP proxy whose connections the host opens ======================
# Frames {"op": "net", "t": ..., "tunnel": N}: guest -> host "open" {host, port}, host -> guest
# "opened" {ok, status, error}; both ways "data" {data}, "ack" {n} (bytes written out: each side
# sends at most NET_WINDOW unacknowledged bytes per tunnel) and "close". Tunnel ids are ours.

NET_PROXY_PORT = 3128
NET_CHUNK = 64 * 1024
NET_WINDOW = 256 * 1024
NET_HEAD_MAX = 16 * 1024
NET_OPEN_TIMEOUT = 45.0
NET_ENV_KEYS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy",
                "ALL_PROXY", "all_proxy")
PIP_CONF = "/etc/pip.conf"
PIP_SITE = f"/usr/local/lib/python3.{sys.version_info.minor}/dist-packages"
PIP_MARK = "# Written by kernelhost"


def _write_pip_conf(pip: dict[str, Any] | None) -> None:
    """/etc/pip.conf for the network mode (None: "none"); one the user wrote is left alone."""
    try:
        with open(PIP_CONF) as f:
            if not f.read().startswith(PIP_MARK):
                return
    except FileNotFoundError:
        pass
    except OSError:
        return
    if pip is None:
        text = (f"{PIP_MARK}: this sandbox has no network (network mode \"none\").\n"
                "# Create the sandbox with network={\"mode\": \"allowlist\"} to install packages;\n"
                "# see docs/network.md of kernelhost.\n"
                "[global]\nretries = 1\ntimeout = 5\nbreak-system-packages = true\n")
    else:
        lines = [f"{PIP_MARK} for network mode {pip.get('mode')!r}: connections go through the",
                 "# proxy below, which the host checks.", "[global]",
                 f"proxy = http://127.0.0.1:{NET_PROXY_PORT}", "break-system-packages = true"]
        for key in ("index-url", "extra-index-url", "trusted-host"):
            value = pip.get(key)
            words = [value] if isinstance(value, str) else value if isinstance(value, list) else []
            words = [w for w in words if isinstance(w, str) and w and not any(c in w for c in "\r\n")]
            if words:
                lines.append(f"{key} = {' '.join(words)}")
        text = "\n".join(lines) + "\n"
    try:
        with open(PIP_CONF + ".tmp", "w") as f:
            f.write(text)
        os.replace(PIP_CONF + ".tmp", PIP_CONF)
    except OSError as exc:
        log("cannot write", PIP_CONF, exc)


class GuestTunnel:
    def __init__(self, tunnel_id: int) -> None:
        self.id = tunnel_id
        self.opened: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.credit = NET_WINDOW  # bytes we may still send before the host acknowledges
        self.room = asyncio.Event()
        self.room.set()
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.writer: asyncio.StreamWriter | None = None


class GuestNet:
    """The proxy on 127.0.0.1:NET_PROXY_PORT: CONNECT (https) and absolute http:// requests."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.server: asyncio.AbstractServer | None = None
        self.tunnels: dict[int, GuestTunnel] = {}
        self.ids = iter(range(1, 1 << 62))
        self.config: Any = None

    async def listen(self) -> None:
        if self.server is None:
            self.server = await asyncio.start_server(
                self.serve_client, "127.0.0.1", NET_PROXY_PORT, limit=NET_HEAD_MAX,
                reuse_address=True)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def reset(self) -> None:
        """Drop every tunnel (a new host knows none of them)."""
        for tun in list(self.tunnels.values()):
            tun.inbox.put_nowait(None)
            if not tun.opened.done():
                tun.opened.set_result({"ok": False, "status": 502,
                                       "error": "the host reconnected; retry"})
            if tun.writer is not None:
                tun.writer.close()
        self.tunnels.clear()

    def send(self, kind: str, tunnel_id: int, **fields: Any) -> None:
        self.agent.send({"op": "net", "t": kind, "tunnel": tunnel_id, **fields})

    def on_frame(self, frame: dict[str, Any]) -> None:
        kind, tunnel_id = frame.get("t"), frame.get("tunnel")
        tun = self.tunnels.get(tunnel_id) if isinstance(tunnel_id, int) else None
        if tun is None:
            if kind != "close" and isinstance(tunnel_id, int):
                self.send("close", tunnel_id)
            return
        if kind == "opened":
            if not tun.opened.done():
                tun.opened.set_result(frame)
        elif kind == "data" and isinstance(frame.get("data"), bytes):
            tun.inbox.put_nowait(frame["data"])
        elif kind == "ack" and isinstance(frame.get("n"), int):
            tun.credit = min(NET_WINDOW, tun.credit + frame["n"])
            tun.room.set()
        elif kind == "close":
            tun.inbox.put_nowait(None)
            if not tun.opened.done():
                tun.opened.set_result({"ok": False, "status": 502, "error": "closed by the host"})

    async def serve_client(self, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        tun: GuestTunnel | None = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                    ConnectionError):
                return
            line, _, rest = head[:-4].partition(b"\r\n")
            words = line.decode("latin-1").split()
            if len(words) != 3:
                return await _respond(writer, 400, "kernelhost proxy: malformed request line")
            method, target, version = words
            first = b""
            if method.upper() == "CONNECT":
                host, _, port_text = target.rpartition(":")
                host = host.strip("[]")
            else:
                import urllib.parse

                url = urllib.parse.urlsplit(target)
                if url.scheme.lower() != "http" or not url.hostname:
                    return await _respond(writer, 400, "kernelhost proxy: send CONNECT host:port "
                                          "or an absolute http:// URL")
                host, port_text = url.hostname, str(url.port or 80)
                path = (url.path or "/") + (f"?{url.query}" if url.query else "")
                drop = (b"proxy-connection:", b"connection:", b"keep-alive:",
                        b"proxy-authorization:")
                headers = [h for h in rest.split(b"\r\n") if h and not h.lower().startswith(drop)]
                first = b"\r\n".join([f"{method} {path} {version}".encode("latin-1"), *headers,
                                       b"Connection: close", b"", b""])
            if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
                return await _respond(writer, 400, f"kernelhost proxy: bad target {target[:100]}")
            tun = GuestTunnel(next(self.ids))
            tun.writer = writer
            self.tunnels[tun.id] = tun
            self.send("open", tun.id, host=host, port=int(port_text))
            try:
                reply = await asyncio.wait_for(asyncio.shield(tun.opened), NET_OPEN_TIMEOUT)
            except asyncio.TimeoutError:
                return await _respond(writer, 504, "kernelhost proxy: the host did not answer")
            if not reply.get("ok"):
                status = reply.get("status") if isinstance(reply.get("status"), int) else 403
                return await _respond(writer, status, str(reply.get("error") or "refused"))
            if first:
                tun.credit -= len(first)
                self.send("data", tun.id, data=first)
            else:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await self._pump(tun, reader, writer)
        except (ConnectionError, OSError):
            pass
        finally:
            if tun is not None and self.tunnels.pop(tun.id, None) is not None:
                self.send("close", tun.id)
            writer.close()

    async def _pump(self, tun: GuestTunnel, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        async def up() -> None:
            while True:
                while tun.credit <= 0:
                    tun.room.clear()
                    await tun.room.wait()
                data = await reader.read(min(NET_CHUNK, tun.credit))
                if not data:
                    return
                tun.credit -= len(data)
                self.send("data", tun.id, data=data)

        async def down() -> None:
            while True:
                data = await tun.inbox.get()
                if data is None:
                    return
                writer.write(data)
                await writer.drain()
                self.send("ack", tun.id, n=len(data))

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task


async def _respond(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    """An error answer of the proxy; the reason is the status line's phrase (what pip shows)."""
    phrase = "".join(c if 32 <= ord(c) < 127 else " " for c in reason)[:300]
    body = (phrase + "\n").encode()
    writer.write(f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    with contextlib.suppress(ConnectionError, OSError):
        await writer.drain()


RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


def _add_entropy(data: bytes) -> None:
    import fcntl
    import struct

    data = data[:512]
    pad = (-len(data)) % 4
    info = struct.pack("ii", len(data) * 8, len(data)) + data + b"\0" * pad
    fd = os.open("/dev/random", os.O_WRONLY)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, info)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


# -- execution depth: constants and helpers (see the Agent section of the same name) ------------

DEPTH_TABLE_MAX = 64
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
WARM_UP_CELLS = ("1 + 1", "print('warm')", "raise ValueError('warm')")
# ...and no trace of them: `_`, `Out` and `_N` as in a fresh kernel, no sys.last_* error
WARM_UP_CLEANUP = (
    "import sys as _kh_s\n"
    "get_ipython().displayhook.flush()\n"
    "for _kh_n in [k for k in globals() if k[:1] == '_' and k[1:].isdigit()]:\n"
    "    del globals()[_kh_n]\n"
    "for _kh_a in ('last_type', 'last_value', 'last_traceback', 'last_exc'):\n"
    "    if hasattr(_kh_s, _kh_a):\n"
    "        delattr(_kh_s, _kh_a)\n"
    "del _kh_s, _kh_a\n"
    "if '_kh_n' in globals():\n"
    "    del _kh_n\n")
BASH_DIR = "/run/kernelhost/bash"
BASH_CHUNK = 1 << 20  # at most this much output per message; more is buffered while one is sent
BASH_DRAIN_SECONDS = 0.5
BASH_STATE_MAX = 1 << 20
BASH_PIDS_MAX = 1024  # processes one bash call may hold at once (its cgroup's pids.max)
BASH_SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "KILL": signal.SIGKILL}
# $1: where the EXIT trap saves the working directory and the exported environment (NUL-separated,
# the directory first); $2: the file holding the command, run by eval so errors read "bash: ...".
BASH_PRELUDE = r"""__kh_state=$1 __kh_cmd=$2
[ -z "$3" ] || echo $$ >"$3/cgroup.procs" 2>/dev/null  # $3: the run's cgroup, or empty
set --
__kh_save() {
    { printf '%s\0' "$PWD"; env -0; } >"$__kh_state.tmp" 2>/dev/null \
        && mv -f "$__kh_state.tmp" "$__kh_state"
}
trap __kh_save EXIT
eval "$(< "$__kh_cmd")"
"""
FS_CHUNK_MAX = 4 << 20
CGROUP_ROOT: str | None = "/sys/fs/cgroup"  # cgroup2 (mounted on first use); None: do without
_cgroup_ready: list[bool] = []
FS_LIST_MAX = 10000


def _cpu_ticks(pid: int) -> int | None:
    """utime + stime + cutime + cstime of ``pid``, in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15])
    except (OSError, IndexError, ValueError):
        return None


def _reset_peak(pid: int) -> None:
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set size
    except OSError:
        pass


def _peak_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


async def _wait_process(loop: asyncio.AbstractEventLoop, pid: int) -> tuple[int, Any]:
    """Wait for a child without a thread (pidfd), then reap it: (wait status, rusage)."""
    pidfd = os.pidfd_open(pid)
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    _, status, rusage = os.wait4(pid, 0)  # noqa: ASYNC222 (it has exited: returns at once)
    return status, rusage


def _new_cgroup(name: str) -> str:
    """A fresh cgroup2 group (memory and pids controllers), or "" where that is not possible."""
    if CGROUP_ROOT is None:
        return ""
    if not _cgroup_ready:
        ok = os.path.exists(f"{CGROUP_ROOT}/cgroup.controllers")
        if not ok:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.mount(b"cgroup2", CGROUP_ROOT.encode(), b"cgroup2", 0, None) == 0
        if ok:
            for controller in ("memory", "pids"):  # one by one: a missing one spoils no other
                try:
                    with open(f"{CGROUP_ROOT}/cgroup.subtree_control", "w") as f:
                        f.write(f"+{controller}")
                except OSError as exc:
                    log(f"cgroup2: cannot enable the {controller} controller:", exc)
        _cgroup_ready.append(ok)
    if not _cgroup_ready[0]:
        return ""
    path = f"{CGROUP_ROOT}/{name}"
    try:
        os.mkdir(path)
    except OSError as exc:
        log("cgroup2: cannot create", path, exc)
        return ""
    # a fork bomb stays a bounded number of processes, so the guest keeps answering and the
    # timeout ladder can kill the whole group
    with contextlib.suppress(OSError):
        with open(f"{path}/pids.max", "w") as f:
            f.write(str(BASH_PIDS_MAX))
    return path


def _cgroup_peak(path: str) -> int | None:
    if not path:
        return None
    try:
        with open(f"{path}/memory.peak") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _cgroup_kill(path: str) -> None:
    if path:
        with contextlib.suppress(OSError):
            with open(f"{path}/cgroup.kill", "w") as f:
                f.write("1")


def _stat_dict(st: os.stat_result) -> dict[str, Any]:
    mode = st.st_mode
    kind = ("dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode)
            else "symlink" if stat.S_ISLNK(mode) else "other")
    return {"type": kind, "size": st.st_size, "mtime": st.st_mtime,
            "mode": stat.S_IMODE(mode)}


BOOT_ID = uuid.uuid4().hex


async def main() -> None:
    agent = Agent()
    await agent.start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
