"""The local ipykernel: its manager, its sockets, readiness, restarts and the agent's own requests.

The agent talks to the kernel like any Jupyter client, through jupyter_client and zmq. It also
sends requests of its own (kernel_info to see the kernel is ready, silent cells for the network
mode and snapshots); the kernel's answers to those are claimed here and never reach the host.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
import zmq.asyncio
from jupyter_client.kernelspec import KernelSpecManager

from .accounts import Account, AccountKernelManager
from .config import AgentConfig
from .languages import language_for
from .shared import log, log_exception, protocol
from .standby import Standby

__all__ = ["CHANNELS", "HOST_CHANNELS", "Kernel", "KernelNotReady"]

#: Every socket of the kernel the agent listens to, and those the host may write to.
CHANNELS = ("iopub", "shell", "control", "stdin")
HOST_CHANNELS = ("shell", "control", "stdin")
_FINISHED_MAX = 256  # own requests remembered after their reply, for late iopub messages
_INFO_TIMEOUT = 5.0  # one kernel_info attempt while waiting for a (re)started kernel
_IOPUB_TIMEOUT = 0.5  # after its reply: no iopub message by then, and kernel_info is asked again
_RESTART_BACKOFF_MAX = 30.0
#: after a swap, the next standby starts this much later: its Python start takes the guest's CPU
#: for seconds under emulation, and the call that follows a restart comes first
STANDBY_AFTER_SWAP = 2.0
RESEED_REQUEST_TIMEOUT = 10.0  # then the reseed cell: the kernel has no kernel_reseed.py

Send = Callable[[dict[str, Any]], bool]


@dataclasses.dataclass
class _Pending:
    """One request of the agent's own: its reply, and whether iopub said anything for it."""

    reply: asyncio.Future[dict[str, Any]]
    iopub: asyncio.Event


class KernelNotReady(RuntimeError):
    """The kernel did not become ready in time (a start or restart failed or hangs)."""


class Kernel:
    """One ipykernel process, restarted in place when it dies or the host asks.

    ``config`` says which kernelspec, working directory and connection file (a code context's
    kernel gets a copy of the agent's with its own, ``contexts.py``); ``context`` is the id its
    events carry (None: the sandbox's main kernel, whose events carry none)."""

    def __init__(self, config: AgentConfig, send: Send, context: str | None = None) -> None:
        self.config = config
        self.context_id = context
        self._send = send
        self.context = zmq.asyncio.Context()
        self.km = self._manager(config.connection_file)
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        #: called with the new sockets after a restart swapped in the standby (the relay's readers)
        self.on_new_sockets: Callable[[], None] = lambda: None
        self.standby: Standby | None = None
        self.ready = asyncio.Event()
        self.kernel_info: dict[str, Any] = {}
        self._internal: dict[str, _Pending] = {}
        # Own requests already answered: the kernel's iopub status "idle" of a request comes
        # after its shell reply, and a kernel_info retried after a timeout may still be answered.
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._restarting = False
        self._restart_lock = asyncio.Lock()
        self.language = language_for(config.language)
        self._standby_task: asyncio.Task[None] | None = None

    def _manager(self, connection_file: str | None) -> AccountKernelManager:
        extra: dict[str, Any] = {}
        if self.config.kernelspec_dirs is not None:
            extra["kernel_spec_manager"] = KernelSpecManager(kernel_dirs=list(self.config.kernelspec_dirs))
        if connection_file is not None:
            extra["connection_file"] = connection_file
        # jupyter_client 7 defaults to a blocking zmq.Context; the relay needs asyncio sockets.
        km = AccountKernelManager(kernel_name=self.config.kernel_name, context=self.context, **extra)
        km.kh_identity = self.config.identity  # launched as the sandbox's user, once it has one
        km.session.unpacker = "kernel_wire.unpack"  # msgpack from our kernel, JSON from others
        unsigned = self.config.unsigned_kernel
        if unsigned or (unsigned is None and self.config.kernel_name == "kernelhost"):
            km.session.key = b""
        return km

    @property
    def session(self) -> Any:
        """The jupyter_client Session that signs messages with the kernel's key."""
        return self.km.session

    # -- lifecycle ---------------------------------------------------------------------------

    async def launch(self) -> None:
        """Start the kernel process and connect to its sockets (not yet waiting for it)."""
        # The kernel's own fds 1 and 2 would otherwise be the serial console, a file on the host:
        # anything printed at the fd level (subprocesses, C code) must not grow the host's disk.
        # jupyter_client keeps these arguments (the environment too, by reference) for restarts.
        await self.km.start_kernel(
            cwd=self.config.kernel_cwd,
            env=self.config.environ,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._connect()

    def _connect(self) -> None:
        """Connect the agent's sockets to the current kernel manager's kernel."""
        # One zmq identity for shell, control and stdin, as jupyter_client's own clients have:
        # the kernel sends a cell's input_request to the identity its execute_request came from,
        # on the stdin socket, and a router drops what is addressed to an identity it never saw.
        identity = self.session.bsession
        for channel in CHANNELS:
            connect = getattr(self.km, f"connect_{channel}")
            sock = connect() if channel == "iopub" else connect(identity=identity)
            self.sockets[channel] = cast(zmq.asyncio.Socket, sock)

    async def wait_ready(self) -> None:
        """Ask kernel_info until the kernel answers on shell and iopub (the relay must be
        running already)."""
        self.ready.clear()
        timeout = self.config.ready_timeout
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await self.request(
                    "shell",
                    "kernel_info_request",
                    {},
                    timeout=min(_INFO_TIMEOUT, left),
                    iopub_timeout=_IOPUB_TIMEOUT,
                )
            except TimeoutError:
                continue
            content = reply.get("content")
            self.kernel_info = content if isinstance(content, dict) else {}
            self.ready.set()
            return
        raise KernelNotReady(
            f"kernel {self.config.kernel_name!r} did not answer kernel_info within {timeout}s; "
            "its kernelspec's argv may not start (try it by hand) or ready_timeout is too short"
        )

    async def until_ready(self) -> None:
        """Wait for a ready kernel, at most ``request_ready_timeout`` seconds."""
        timeout = self.config.request_ready_timeout
        try:
            async with asyncio.timeout(timeout):
                await self.ready.wait()
        except TimeoutError:
            raise KernelNotReady(
                f"the kernel has not been ready for {timeout}s (a start or restart failed); "
                "send restart, or recreate the sandbox"
            ) from None

    async def restart(self, reason: str) -> None:
        """A fresh kernel process, then ``kernel_restarted``: the standby put in place if one is
        ready (then a new standby is started), else the process replaced (same ports and key)."""
        async with self._restart_lock:
            self._restarting = True
            self.ready.clear()  # shell messages wait for the new kernel instead of reaching the old
            try:
                if self.standby is not None and not self.standby.ready.is_set():
                    # A standby is starting: it is further along than a new process would be,
                    # and two Pythons starting at once halve the guest's CPU for each (under
                    # emulation, a restart then outlasted the host's deadline).
                    await self.until_standby(self.config.ready_timeout)
                swapped = await self._swap_in_standby()
                if not swapped:
                    async with asyncio.timeout(self.config.ready_timeout):
                        await self.km.restart_kernel(now=True)
                await self.wait_ready()
                if swapped:
                    await self._freshen(swapped)
                # the next standby, behind this restart (also when none was ready or it had died)
                self.spawn_standby(STANDBY_AFTER_SWAP)
            finally:
                self._restarting = False
        self.send_event(protocol.Event.KERNEL_RESTARTED, reason=reason)

    async def become(self, account: Account) -> None:
        """Make the running kernel ``account``'s: in place where its language can drop root
        (the process and its state stay), else a restart, which launches it as the user."""
        code = self.language.become(account)
        if code is not None and self.ready.is_set():
            await self.run_silent(code)
        else:
            await self.restart(reason="user")

    def send_event(self, event: protocol.Event, **fields: Any) -> None:
        """An event frame of this kernel (with its context's id, if it is a context's)."""
        frame: dict[str, Any] = {"op": protocol.Frame.EVENT, "event": event, **fields}
        if self.context_id is not None:
            frame["context"] = self.context_id
        self._send(frame)

    # -- the standby ---------------------------------------------------------------------------

    async def prepare_standby(self, delay: float = 0.0) -> None:
        """Start a standby kernel (unless one runs or the configuration has none), ``delay``
        seconds from now."""
        await asyncio.sleep(delay)
        if not self.config.standby_kernel or self.standby is not None:
            return
        self.standby = Standby(self.config, self._manager)
        await self.standby.start()
        if self.standby.failed:
            self.standby = None

    def spawn_standby(self, delay: float = 0.0) -> None:
        """Start the next standby in a task of the kernel's own (cancelled at ``stop``)."""
        if self._standby_task is None or self._standby_task.done():
            self._standby_task = asyncio.ensure_future(self.prepare_standby(delay))

    async def until_standby(self, timeout: float) -> bool:
        """Wait for the standby being started to be ready (before a freeze); False if none is."""
        if self._standby_task is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self._standby_task)
        return self.standby is not None and self.standby.ready.is_set()

    async def _swap_in_standby(self) -> Standby | None:
        """Put the ready standby in the kernel's place; the old kernel is killed."""
        standby = self.standby
        if standby is not None and standby.ready.is_set() and not standby.alive():
            log("the standby kernel had died (the OOM killer takes it first): a restart the slow way")
            self.standby = None
            await standby.stop()
            return None
        if standby is None or not self._env_cell(standby)[0] or not self._can_become(standby):
            return None
        km = standby.take()
        if km is None:
            return None
        self.standby = None
        old_km, old_sockets = self.km, self.sockets
        self.km, self.sockets = km, {}
        self._connect()
        self.on_new_sockets()
        for sock in old_sockets.values():
            sock.close(linger=0)
        try:
            async with asyncio.timeout(self.config.ready_timeout):
                await old_km.shutdown_kernel(now=True)
        except Exception:  # the new kernel is in place; the old one is the monitor's no more
            log_exception("the replaced kernel did not shut down cleanly:")
        return standby

    def _env_cell(self, standby: Standby) -> tuple[bool, str | None]:
        """Whether the standby can become this sandbox's kernel, and the cell that sets in it the
        environment set since it started (None: nothing to set). A change the kernel's language
        has no cell for rules the standby out."""
        changed, unset = standby.env_changes()
        if not (changed or unset):
            return True, None
        code = self.language.set_env(changed, unset, self.config.pip_site)
        return code is not None, code

    def _can_become(self, standby: Standby) -> bool:
        """Whether the standby runs as the sandbox's user, or can drop root to become it."""
        account = self.config.identity.account
        return standby.account == account or account is None or self.language.become(account) is not None

    async def _freshen(self, standby: Standby) -> None:
        """Make the promoted standby this sandbox's fresh kernel: its user, its environment and
        its random streams."""
        account = self.config.identity.account
        if account is not None and standby.account != account:
            code = self.language.become(account)
            if code is not None:
                await self.run_silent(code)
        _, code = self._env_cell(standby)
        if code is not None:
            await self.run_silent(code)
        await self.reseed()

    async def monitor(self) -> None:
        """Report a kernel that died, and start a new one (retrying with a growing pause)."""
        failures = 0
        while True:
            if self._restarting:
                await asyncio.sleep(self.config.monitor_interval)
                continue
            proc = self._process()
            if proc is not None:
                # Wait on the kernel process itself (its pidfd in the loop) rather than
                # polling: an idle sandbox then costs no wake-ups here, which matters for many
                # idle VMs under TCG.
                code = await wait_process(proc)
                if self._restarting or self._process() is not proc:
                    continue  # a restart we asked for replaced it
                log(f"kernel {self.context_id or '(main)'} died, exit code", code)
                self.send_event(protocol.Event.KERNEL_DIED, exit_code=code)
            # A dead kernel, or none at all (a restart failed): a sandbox needs one.
            try:
                await self.restart(reason="died")
                failures = 0
            except Exception:
                failures += 1
                pause = min(_RESTART_BACKOFF_MAX, 2.0**failures)
                log_exception(f"starting a new kernel failed (attempt {failures}); next try in {pause}s:")
                await asyncio.sleep(pause)

    def _process(self) -> Any:
        """The kernel's Popen, or None (none started, or a restart failed half-way)."""
        return getattr(self.km.provisioner, "process", None)

    async def stop(self) -> None:
        """Close the sockets and shut the kernel down (the agent is stopping)."""
        if self._standby_task is not None:
            self._standby_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._standby_task
        if self.standby is not None:
            await self.standby.stop()
            self.standby = None
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()
        try:
            if self.km.has_kernel:  # none in a build VM (``start_kernel`` off)
                async with asyncio.timeout(self.config.ready_timeout):
                    await self.km.shutdown_kernel(now=True)
        except Exception:  # stopping anyway: the rest must still be released
            log_exception("kernel shutdown failed:")
        self.context.destroy(linger=0)

    # -- requests of the agent's own -----------------------------------------------------------

    async def request(
        self,
        channel: str,
        msg_type: str,
        content: dict[str, Any],
        timeout: float,
        *,
        iopub_timeout: float | None = None,
    ) -> dict[str, Any]:
        """Send a message of the agent's own; its reply is not relayed to the host.

        With ``iopub_timeout``, also wait that long after the reply for an iopub message of the
        request (TimeoutError if none comes): the proof that the iopub subscription is connected.
        A zmq subscriber misses whatever was published before it joined, so a kernel answering on
        shell is not yet a ready one.
        """
        msg = self.session.msg(msg_type, content)
        msg_id: str = msg["header"]["msg_id"]
        pending = _Pending(asyncio.get_running_loop().create_future(), asyncio.Event())
        self._internal[msg_id] = pending
        try:
            await self.sockets[channel].send_multipart(self.session.serialize(msg))
            async with asyncio.timeout(timeout):
                reply = await pending.reply
            if iopub_timeout is not None:
                async with asyncio.timeout(iopub_timeout):
                    await pending.iopub.wait()
            return reply
        finally:
            self._internal.pop(msg_id, None)
            self._finished[msg_id] = None
            while len(self._finished) > _FINISHED_MAX:
                self._finished.popitem(last=False)

    def claim(self, channel: str, msg: dict[str, Any]) -> bool:
        """True if ``msg`` belongs to one of the agent's own requests (it is not relayed)."""
        parent = msg.get("parent_header")
        parent_id = parent.get("msg_id") if isinstance(parent, dict) else None
        if not isinstance(parent_id, str):
            return False
        pending = self._internal.get(parent_id)
        if pending is None:
            return parent_id in self._finished
        if channel == "iopub":
            pending.iopub.set()
        elif not pending.reply.done():
            pending.reply.set_result(msg)
        return True

    async def run_silent(self, code: str, timeout: float = 120.0) -> None:
        """Run code in the kernel without output, history or execution count (agent's own)."""
        reply = await self.request("shell", "execute_request", silent_cell(code), timeout=timeout)
        content = reply.get("content", {})
        if content.get("status") != "ok":
            raise RuntimeError(f"{content.get('ename')}: {content.get('evalue')}")

    async def reseed(self, timeout: float = 30.0) -> None:
        """Fresh random streams in the kernel: the language's control message where it has one
        (no cell: a fork's child answers sooner), else its cell. A kernel that does not answer
        the message in ``RESEED_REQUEST_TIMEOUT`` (not launched by launch_kernel.py) gets the
        cell."""
        lang = self.language
        if lang.reseed_request is not None:
            try:
                reply = await self.request(
                    "control", lang.reseed_request, {}, timeout=min(timeout, RESEED_REQUEST_TIMEOUT)
                )
            except TimeoutError:
                log(f"no reply to {lang.reseed_request} (not a kernelhost kernel?): the reseed cell")
            else:
                content = reply.get("content", {})
                if content.get("status") != "ok":
                    raise RuntimeError(f"{content.get('ename')}: {content.get('evalue')}")
                return
        if lang.reseed is not None:
            await self.run_silent(lang.reseed, timeout=timeout)

    # -- the process ---------------------------------------------------------------------------

    async def interrupt(self) -> None:
        """SIGINT to the kernel (the running cell raises KeyboardInterrupt)."""
        await self.km.interrupt_kernel()

    async def is_alive(self) -> bool:
        """Whether the kernel process runs."""
        return bool(await self.km.is_alive())

    def pid(self) -> int | None:
        """The kernel process's pid, if one runs."""
        pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
        return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


async def wait_process(proc: subprocess.Popen[Any]) -> int:
    """Wait until ``proc`` exits; its exit code. Its pidfd is watched by the loop, so no thread
    is parked per kernel (a sandbox's code contexts each have one, and a thread parked in
    waitpid each would exhaust the loop's default executor, which the agent's blocking calls
    share); a cancelled wait leaves nothing behind. Without pidfds, a thread in waitpid."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd_open here, or the process is reaped already
        return await asyncio.to_thread(proc.wait)
    try:
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        try:
            loop.add_reader(fd, readable)
        except NotImplementedError:  # a loop without add_reader
            return await asyncio.to_thread(proc.wait)
        try:
            await exited
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)
    return proc.wait()  # exited: reaps it at once


def silent_cell(code: str, *, silent: bool = True) -> dict[str, Any]:
    """The content of an execute_request of the agent's own (no history, no stdin)."""
    return {
        "code": code,
        "silent": silent,
        "store_history": False,
        "user_expressions": {},
        "allow_stdin": False,
        "stop_on_error": False,
    }
