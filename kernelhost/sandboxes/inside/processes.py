"""Background processes: shell commands that run beside a sandbox's calls (E2B's process
service), each with a pid, its output streamed to whoever listens, and optionally a stdin.

A native ``execute(language="bash")`` holds the sandbox's execution lock for its duration; a
process does not: it runs in the guest's shell area next to the kernel and the other processes
(the agent runs commands side by side), so a server started in the background does not hold
up the next ``run_code``. It leaves the shell's state (cwd, exports) alone (``keep_state``
false), so a process that ends late cannot bring back the state it started from.

Output (uncapped: it is streamed, never kept) goes to the process's first listener (the call
that started it) and to every later one (``listen``: a reconnect), from the moment each
listens; a listener that stops reading for ``LISTENER_PATIENCE`` seconds is cut off, so it
cannot stall the others or the guest. With no listener the output is dropped and the command
runs on. A process ends with its command (its ``End``), when it is signalled, at its timeout
(the timeout ladder of any bash call), when the sandbox is hibernated (its processes are killed
first: their host side cannot be carried over), or with the sandbox's VM.

What the host holds per process is bounded: a sandbox runs at most
``max_processes_per_sandbox`` of them and a key ``max_processes_per_key`` (the service's own,
such as a usage reading, are not counted); once the guest has the command, the host keeps its
first ``COMMAND_SHOWN`` characters and the caller's ``info`` (at most ``MAX_INFO_BYTES`` as JSON),
never the whole request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import structlog

from ...channel import AgentClient, ChannelError
from ...channel.protocol import Capability, Op
from ..context import Context
from ..errors import CapacityExceeded, InvalidRequest, NotSupportedByImage, ProcessNotFound, Remedy
from ..execution import Cell, CellPolicy, End, Error, Event, OutputLimits, RunningCall, run_cell
from ..sandbox import Sandbox, ensure_usable

log = structlog.get_logger("kernelhost.processes")

COMMAND_SHOWN = 200  # characters of a command the host keeps once the guest runs it (logs)
MAX_INFO_BYTES = 8192  # a process's ``info`` as JSON: a summary of the request, not the request
LISTENER_EVENTS = 256  # events queued for one listener before it must read
LISTENER_PATIENCE = 30.0  # seconds a listener may leave a full queue unread
SIGNALS = ("INT", "TERM", "KILL")
_END = object()  # a listener's queue: the process ended, or the listener was cut off


@dataclass(eq=False)
class Process:
    """One background command of one sandbox."""

    pid: int
    sandbox_id: str
    command: str  # its first COMMAND_SHOWN characters
    info: dict[str, Any]  # how the caller described it (E2B: a summary of its config), as given
    stdin: bool
    agent: AgentClient
    agent_timeout: float
    running: RunningCall = field(default_factory=RunningCall)
    end: End | None = None
    task: asyncio.Task[None] | None = None
    _first: asyncio.Queue[Any] = field(default_factory=lambda: asyncio.Queue(LISTENER_EVENTS))
    _listeners: set[asyncio.Queue[Any]] = field(default_factory=set)
    _first_taken: bool = False
    own: bool = False  # the service's own (a usage reading): not counted against the limits

    def __post_init__(self) -> None:
        self._listeners.add(self._first)

    def listen(self) -> AsyncGenerator[Event, None]:
        """The process's events from now to its ``End`` (the first call gets them from the
        start). A listener cut off for not reading gets an ``Error`` and no ``End``."""
        if not self._first_taken:
            self._first_taken = True
            return self._drain(self._first)
        queue: asyncio.Queue[Any] = asyncio.Queue(LISTENER_EVENTS)
        if self.end is not None:
            queue.put_nowait(self.end)
        else:
            self._listeners.add(queue)
        return self._drain(queue)

    async def _drain(self, queue: asyncio.Queue[Any]) -> AsyncGenerator[Event, None]:
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    yield Error("ListenerTooSlow", f"output of process {self.pid} was not read for "
                                f"{LISTENER_PATIENCE:g}s; listen again to follow it")  # fmt: skip
                    return
                yield item
                if isinstance(item, End):
                    return
        finally:
            self._listeners.discard(queue)

    async def _publish(self, event: Event) -> None:
        for queue in list(self._listeners):
            try:
                queue.put_nowait(event)
                continue
            except asyncio.QueueFull:
                pass
            try:
                async with asyncio.timeout(LISTENER_PATIENCE):
                    await queue.put(event)
            except TimeoutError:
                self._listeners.discard(queue)
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()  # room for the marker
                queue.put_nowait(_END)

    async def _run(self, events: AsyncGenerator[Event, None]) -> None:
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, End):
                    self.end = event
                await self._publish(event)

    async def send_input(self, data: bytes, eof: bool = False) -> None:
        """Write to the command's stdin; ``eof`` closes it (the command reads end of file)."""
        if not self.stdin:
            raise InvalidRequest(
                f"process {self.pid} was started without stdin; start it with stdin enabled",
                field="stdin",
            )
        await self._request(Op.BASH_INPUT, data=data, eof=eof)

    async def signal(self, name: str) -> None:
        """INT, TERM or KILL to the command and what it started."""
        if name not in SIGNALS:
            raise InvalidRequest(f"signal {name!r} is not one of {', '.join(SIGNALS)}", field="signal")
        await self._request(Op.BASH_SIGNAL, signal=name)

    async def _request(self, op: Op, **fields: Any) -> None:
        if self.end is not None:
            raise ProcessNotFound(self.sandbox_id, self.pid)
        async with asyncio.timeout(self.agent_timeout):
            await self.running.started.wait()
        try:
            await self.agent.request(op, timeout=self.agent_timeout, run_id=self.running.run_id, **fields)
        except ChannelError as exc:
            if self.end is not None:  # it ended while the request was on its way
                raise ProcessNotFound(self.sandbox_id, self.pid) from None
            raise InvalidRequest(f"process {self.pid}: {exc}", field="process") from None


class Processes:
    """The background processes of a manager's sandboxes."""

    def __init__(
        self, ctx: Context, policy: CellPolicy, wait_for_vm: Callable[[Sandbox], Awaitable[None]]
    ) -> None:
        self.ctx = ctx
        self._wait_for_vm = wait_for_vm  # wait out a VM change in flight, wake a hibernated sandbox
        # no output cap: a process's output is streamed to its listeners, never kept
        self.policy = dataclasses.replace(policy, limits=OutputLimits(None, policy.limits.max_result_bytes))
        self._pids = itertools.count(1000)

    async def start(
        self,
        sbx: Sandbox,
        command: str,
        timeout: float | None = None,
        stdin: bool = False,
        info: dict[str, Any] | None = None,
        own: bool = False,
        user: str | None = None,
    ) -> Process:
        """Start ``command`` in the sandbox's shell; returns once the guest runs it. ``own``: the
        service's (not counted against the process limits); ``user``: the account it runs as
        (None: the sandbox's)."""
        if timeout is not None and timeout <= 0:
            raise InvalidRequest(f"timeout={timeout} must be positive (seconds) or null", field="timeout")
        shown = dict(info or {})
        if len(json.dumps(shown, default=str)) > MAX_INFO_BYTES:
            raise InvalidRequest(
                f"a process's description is over {MAX_INFO_BYTES} bytes as JSON; describe it in brief",
                field="info",
            )
        ensure_usable(sbx)
        await self._wait_for_vm(sbx)
        ensure_usable(sbx)
        agent = sbx.live_agent
        if agent is None or Capability.PROCESSES not in agent.info.capabilities:
            raise NotSupportedByImage(
                f"sandbox {sbx.id} cannot run background processes"
                + ("" if agent is None else ": its guest image predates them; rebuild the images"),
                remedy=Remedy.RECREATE,
            )
        if not own:
            self._check_room(sbx)  # no await from here to the insertion: starts cannot overbook
        proc = Process(
            next(self._pids),
            sbx.id,
            command[:COMMAND_SHOWN],
            shown,
            stdin,
            agent,
            self.policy.agent_timeout,
            own=own,
        )
        cell = Cell(command, "bash", timeout, stdin=stdin, keep_state=False, user=user)
        events = run_cell(agent, cell, self.policy, proc.running, sbx.session_id)
        sbx.processes[proc.pid] = proc
        proc.task = self.ctx.tasks.spawn(self._own(sbx, proc, events), name=f"process:{sbx.id}:{proc.pid}")
        self.ctx.registry.touch(sbx)
        log.info("process.started", sandbox_id=sbx.id, pid=proc.pid, stdin=stdin, timeout=timeout)
        return proc

    def _check_room(self, sbx: Sandbox) -> None:
        """Raise ``CapacityExceeded`` (naming the setting) when the sandbox or its key runs as
        many background processes as it may."""
        settings = self.ctx.settings
        here = _counted(sbx)
        if here >= settings.max_processes_per_sandbox:
            raise CapacityExceeded(
                f"sandbox {sbx.id} runs {here} background processes, its limit "
                f"(max_processes_per_sandbox={settings.max_processes_per_sandbox}); end some "
                "(kill them, or let them finish) before starting another, or raise the setting",
                limit="max_processes_per_sandbox",
                value=settings.max_processes_per_sandbox,
                sandbox_id=sbx.id,
            )
        held = sum(_counted(s) for s in self.ctx.registry.owned(sbx.record.owner))
        if held >= settings.max_processes_per_key:
            raise CapacityExceeded(
                f"this API key's sandboxes run {held} background processes, its limit "
                f"(max_processes_per_key={settings.max_processes_per_key}); end some (kill them, "
                "or let them finish) before starting another, or raise the setting",
                limit="max_processes_per_key",
                value=settings.max_processes_per_key,
            )

    async def _own(self, sbx: Sandbox, proc: Process, events: AsyncGenerator[Event, None]) -> None:
        try:
            await proc._run(events)
        finally:
            sbx.processes.pop(proc.pid, None)
            self.ctx.registry.touch(sbx)
            end = proc.end
            log.info(
                "process.ended",
                sandbox_id=sbx.id,
                pid=proc.pid,
                status=None if end is None else end.status.value,
                exit_code=None if end is None else end.exit_code,
            )

    def get(self, sbx: Sandbox, pid: int) -> Process:
        proc = sbx.processes.get(pid)
        if proc is None:
            raise ProcessNotFound(sbx.id, pid)
        return cast(Process, proc)  # the only kind of BackgroundProcess

    def of(self, sbx: Sandbox) -> list[Process]:
        return cast("list[Process]", sorted(sbx.processes.values(), key=lambda p: p.pid))


def _counted(sbx: Sandbox) -> int:
    return sum(1 for p in sbx.processes.values() if not p.own)


async def stop_processes(sbx: Sandbox, timeout: float) -> None:
    """Kill a sandbox's background processes and wait for their ends (before its VM is saved:
    the host side of a process cannot be carried over a hibernation)."""
    procs = list(sbx.processes.values())
    for proc in procs:
        with contextlib.suppress(Exception):
            await proc.signal("KILL")
    tasks = [p.task for p in procs if p.task is not None]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
