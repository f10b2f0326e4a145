"""Co-attach: the Jupyter clients attached to one sandbox's kernel (Kernel Gateway WebSockets),
and what they have running on it.

A ``KernelSession`` exists while a sandbox has attached clients. It listens on the sandbox's
channel: every iopub message of the kernel goes to every client (so a notebook sees the cells an
agent runs through the native API), and a reply (shell, control, stdin) goes only to the client
whose request it answers (``origin``).

Ordering with native calls: while an execute_request of an attached client is in the kernel,
the session leases the sandbox's execution lock (``ExecutionLock.lease``), so a native
``execute`` waits for the clients' cells (and its timeout cannot interrupt them), and a client's
execute_request waits for a native call that runs. The clients' own execute_requests are
forwarded at once while the session holds the lease, so the kernel queues them and
``stop_on_error`` works as in any notebook. The lease ends when the last outstanding cell has
ended (its idle status or its reply), or when the channel changes under it (kernel died or
restarted, VM lost or replaced), because replies in flight then never come.

A debugger session (ipykernel's, driven by debug_request on control) does not outlive the
clients that attached it: when the last of them leaves, the session sends the kernel the
``disconnect`` request JupyterLab sends when its debugger is switched off (breakpoints cleared,
stopped threads resumed), so a cell stopped at a breakpoint finishes and the lease ends, instead
of holding every other caller of the sandbox behind it forever.

Everything the channel delivers runs on its reader task: nothing here may block or raise.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import structlog

from ..channel import AgentClient, ChannelListener, Event, JupyterMessage
from ..channel.protocol import jupyter_message
from ..tasks import TaskSet
from .errors import Remedy, SandboxNotFound, SandboxNotRunning
from .registry import Registry
from .sandbox import Sandbox, ensure_usable, wait_replacement
from .states import SandboxState

log = structlog.get_logger("kernelhost.session")

ORIGINS_KEPT = 8192  # request msg_ids remembered for routing replies
#: the debug_request that ends a debugger session without ending the kernel (JupyterLab's own)
DEBUG_DISCONNECT = {"restart": False, "terminateDebuggee": False}
TOUCH_EVERY = 5.0  # seconds between activity writes to the store

#: ``wake(sbx)``: wake a hibernated sandbox (the caller holds its execution lock)
Wake = Callable[[Sandbox], Awaitable[None]]


@dataclass(frozen=True)
class SessionEnd:
    """Why a session's clients are cut off: its sandbox was deleted, or its VM died."""

    deleted: bool
    reason: str


class SessionClient(Protocol):
    """One attached client. Both hooks run on the channel's reader: they must not block."""

    def deliver(self, channel: str, msg: dict[str, Any], cache: dict[Any, Any]) -> None:
        """Send one Jupyter message; ``cache`` is shared by the clients of one message (for
        its encodings)."""

    def end(self, why: SessionEnd) -> None:
        """The session is over for this client."""


class KernelSession(ChannelListener):
    def __init__(self, sessions: Sessions, sbx: Sandbox) -> None:
        self.sessions = sessions
        self.sbx = sbx
        self.clients: set[SessionClient] = set()
        self.origin: OrderedDict[str, SessionClient] = OrderedDict()  # request msg_id -> sender
        self.outstanding: set[str] = set()  # clients' execute_requests the kernel has not ended
        self.holding = False  # we hold the lease of sbx.lock on behalf of ``outstanding``
        self.debuggers: set[SessionClient] = set()  # clients with a debugger session attached
        self.quiet_restart = False  # a restart whose clients reconnect by themselves runs
        self.session_id = uuid.uuid4().hex  # of the status messages the session writes itself
        self.execution_state = "busy" if sbx.busy else "idle"
        self.last_activity = sbx.record.last_active_at
        self._touched = 0.0
        self._name = f"kernel-session:{uuid.uuid4().hex[:8]}"

    @property
    def running(self) -> bool:
        """Whether the clients have something running in the kernel."""
        return bool(self.outstanding) or self.execution_state == "busy"

    # -- the channel (ChannelListener) -----------------------------------------------------------

    def bind(self, agent: AgentClient) -> None:
        """Listen on the sandbox's (new) channel."""
        agent.add_listener(self)
        if agent.connected and self.sbx.record.state == SandboxState.REPLACING:
            self.drop_outstanding()  # a fresh VM: the kernel's state is gone
            self.broadcast("restarting")
            self.execution_state = "idle"

    def on_message(self, message: JupyterMessage) -> None:
        kind, parent = message.msg_type, message.parent_id
        if kind == "iopub_welcome" or message.context is not None:  # the agent's, or a context's
            return
        if message.channel == "iopub":
            if kind == "status":
                state = message.content.get("execution_state")
                if isinstance(state, str):
                    self.execution_state = state
                if state == "idle" and parent in self.outstanding:
                    self._done(parent)
            targets = list(self.clients)
        else:
            client = self.origin.get(parent) if parent else None
            if message.channel != "stdin" and kind.endswith("_reply") and parent:
                self.origin.pop(parent, None)
                if kind == "execute_reply" and parent in self.outstanding:
                    self._done(parent)
            targets = [client] if client is not None and client in self.clients else []
        cache: dict[Any, Any] = {}
        for client in targets:
            client.deliver(message.channel, message.msg, cache)
        self.touch()

    def on_event(self, event: dict[str, Any]) -> None:
        what = event.get("event")
        if event.get("context") is not None:  # a code context's kernel: not the clients'
            return
        if what == Event.KERNEL_DIED:
            self.drop_outstanding()
            self.broadcast("restarting")  # clients reconnect and ask the new kernel
        elif what == Event.KERNEL_RESTARTED:
            self.drop_outstanding()
            if event.get("reason") != "died" and not self.quiet_restart:
                self.broadcast("restarting")  # restarted by another client (SDK, timeout)
            self.execution_state = "idle"  # the agent reports a restart once the kernel is up

    def on_close(self, reason: str, violation: bool) -> None:
        self.drop_outstanding()  # replies in flight on the old channel will not come
        sbx = self.sbx
        if not self.sessions.registry.holds(sbx):
            self._end_all(SessionEnd(True, "the sandbox was deleted"))
        elif sbx.record.state == SandboxState.DEAD:
            self._end_all(SessionEnd(False, f"the sandbox's VM stopped: {reason}"))

    def _end_all(self, why: SessionEnd) -> None:
        self.broadcast("dead")
        for client in list(self.clients):
            client.end(why)

    # -- bookkeeping -----------------------------------------------------------------------------

    def broadcast(self, state: str) -> None:
        """An iopub ``status`` of the session's own (restarting, dead) to every client."""
        self.execution_state = state
        msg = jupyter_message("status", {"execution_state": state}, self.session_id)
        cache: dict[Any, Any] = {}
        for client in list(self.clients):
            client.deliver("iopub", msg, cache)

    def _done(self, msg_id: str) -> None:
        self.outstanding.discard(msg_id)
        if not self.outstanding:
            self._release()

    def drop_outstanding(self) -> None:
        """Forget what was outstanding and end the lease (the channel changed under it)."""
        self.outstanding.clear()
        self._release()

    def _release(self) -> None:
        if self.holding:
            self.holding = False
            self.sbx.lock.end_lease(self._name)
            self.touch(force=True)
        if not self.clients:
            self.sessions.drop(self)

    def touch(self, force: bool = False) -> None:
        """Activity (what the idle reaper measures from), written at most every TOUCH_EVERY."""
        now = time.time()
        self.last_activity = now
        if force or now - self._touched >= TOUCH_EVERY:
            self._touched = now
            self.sessions.registry.touch(self.sbx, now)

    # -- to the kernel ---------------------------------------------------------------------------

    async def _agent(self) -> AgentClient:
        """The sandbox's live channel, waking a hibernated sandbox (a message is activity)."""
        sbx = self.sbx
        if not self.sessions.registry.holds(sbx):
            raise SandboxNotFound(sbx.id)
        await wait_replacement(sbx)
        if sbx.record.state == SandboxState.HIBERNATED:
            if self.holding:
                await self.sessions.wake(sbx)
            else:
                async with sbx.lock.hold(self._name):
                    await self.sessions.wake(sbx)
        ensure_usable(sbx)
        agent = sbx.live_agent
        if agent is None:
            raise SandboxNotRunning(
                f"sandbox {sbx.id} has no live VM channel right now",
                remedy=Remedy.RESTART,
                state=sbx.record.state.value,
                sandbox_id=sbx.id,
            )
        return agent

    async def send(self, client: SessionClient, channel: str, msg: dict[str, Any]) -> None:
        """Send a client's message on control or stdin (or shell, through ``send_shell``)."""
        if channel == "control" and msg["header"]["msg_type"] == "debug_request":
            self._note_debugger(client, msg["content"].get("command"))
        self.origin[msg["header"]["msg_id"]] = client
        while len(self.origin) > ORIGINS_KEPT:
            self.origin.popitem(last=False)
        agent = await self._agent()
        await agent.send_jupyter(channel, msg, timeout=self.sessions.send_timeout)
        self.touch()

    async def send_shell(self, client: SessionClient, msg: dict[str, Any]) -> None:
        """A shell message; an execute_request first makes sure the session holds the lease."""
        msg_id = msg["header"]["msg_id"]
        execute = msg["header"]["msg_type"] == "execute_request" and isinstance(
            msg["content"].get("code"), str
        )
        if execute:
            if not self.holding:
                await self.sbx.lock.lease(self._name)  # behind a native call that runs now
                self.holding = True
            self.outstanding.add(msg_id)
        try:
            await self.send(client, "shell", msg)
        except BaseException:
            if execute:
                self._done(msg_id)
            raise

    def attach(self, client: SessionClient) -> None:
        self.clients.add(client)

    def detach(self, client: SessionClient) -> None:
        self.clients.discard(client)
        if client in self.debuggers:
            self.debuggers.discard(client)
            if not self.debuggers:
                self.sessions.tasks.spawn(self._end_debugger(), name=f"{self._name}:end-debugger")
        if not self.clients and not self.outstanding:
            self.sessions.drop(self)

    # -- the debugger ----------------------------------------------------------------------------

    def _note_debugger(self, client: SessionClient, command: object) -> None:
        if command == "attach":
            self.debuggers.add(client)
        elif command == "disconnect":
            self.debuggers.discard(client)

    async def _end_debugger(self) -> None:
        """Disconnect the kernel's debugger: its last client left with it attached."""
        agent = self.sbx.live_agent
        if agent is None or self.debuggers:  # no kernel to tell, or a client attached again
            return
        msg = jupyter_message(
            "debug_request",
            {"type": "request", "seq": 1, "command": "disconnect", "arguments": DEBUG_DISCONNECT},
            self.session_id,
        )
        try:
            await agent.send_jupyter("control", msg, timeout=self.sessions.send_timeout)
        except Exception as exc:  # the channel went: the kernel (and its debugger) went with it
            log.info("session.debugger_end_failed", sandbox_id=self.sbx.id, error=str(exc))
            return
        log.info("session.debugger_ended", sandbox_id=self.sbx.id, why="its last client left")


class Sessions:
    """The kernel sessions of the sandboxes that have clients attached."""

    def __init__(self, registry: Registry, wake: Wake, send_timeout: float, tasks: TaskSet) -> None:
        self.registry = registry
        self.wake = wake
        self.send_timeout = send_timeout
        self.tasks = tasks  # the manager's: what a session starts on its own

    def open(self, sbx: Sandbox) -> KernelSession:
        """The sandbox's session, made (and bound to its channel) if it has none."""
        if sbx.kernel is None:
            sbx.kernel = KernelSession(self, sbx)
            if sbx.agent is not None:
                sbx.agent.add_listener(sbx.kernel)
        return cast(KernelSession, sbx.kernel)  # the only kind of AttachedKernel

    def drop(self, session: KernelSession) -> None:
        sbx = session.sbx
        if sbx.kernel is session:
            sbx.kernel = None
        if sbx.agent is not None:
            sbx.agent.remove_listener(session)

    def close_all(self) -> list[SessionClient]:
        """Give back every lease (the service stops); the clients still attached."""
        clients: list[SessionClient] = []
        for sbx in self.registry:
            if sbx.kernel is not None:
                clients.extend(sbx.kernel.clients)
                sbx.kernel.drop_outstanding()
        return clients
