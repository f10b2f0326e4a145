"""Run one call on a sandbox and turn what comes back into execution events (``events.py``).

Timeouts escalate, and always end with a usable sandbox: at the deadline the code is interrupted
(SIGINT: KeyboardInterrupt, state kept); if it is still running ``interrupt_grace`` seconds later
and the agent answers a ping, the kernel is restarted (bash: the command's processes are killed);
if the agent does not answer, or the restart fails, ``replace_vm`` gives the sandbox a new VM.
The one ``TimeoutError`` event says which rung it took, and ``End.recovery`` names it.

Other calls act on a running one through its ``RunningCall``: an interrupt request sets
``interrupt_requested`` (the call then ends ``interrupted``), a restart or the kernel's death
is a notice queued on its subscription, which ends it at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from ...channel import AgentClient, ChannelError, JupyterMessage, Subscription
from ...channel.protocol import Op
from ..errors import InvalidRequest, SandboxError
from ..states import ExecutionStatus, Recovery
from .calls import BashCall, Call, PythonCall
from .events import End, Error, Event
from .output import OutputBudget, OutputLimits

log = structlog.get_logger("kernelhost.execution")

LANGUAGES = ("python", "bash")

#: ``replace_vm(reason)``: give the sandbox a new VM; False when it must not (being deleted).
ReplaceVm = Callable[[str], Awaitable[bool]]


@dataclass(frozen=True)
class Cell:
    """What to run: code (Python) or a command (bash), under an optional deadline."""

    code: str
    language: str = "python"
    timeout: float | None = None
    #: bash only: a stdin the caller writes (op ``bash_input``: sandboxes/inside/processes.py), and
    #: whether the shell's state (cwd, exports) is what the command leaves (false for a
    #: background process)
    stdin: bool = False
    keep_state: bool = True
    #: bash only: the account it runs as ("root", or the sandbox's: ``set_user``); None: the
    #: sandbox's user (root unless one was set)
    user: str | None = None
    #: Python only: the code context whose kernel runs it (None: the main kernel)
    context: str | None = None

    @classmethod
    def checked(
        cls,
        code: str,
        language: str,
        timeout: float | None,
        *,
        max_bytes: int,
        default_timeout: float,
        context: str | None = None,
    ) -> Cell:
        """A caller's call, checked (``InvalidRequest`` naming the field): a known language, code
        within ``max_bytes``, a positive timeout or none (``default_timeout`` if positive)."""
        if language not in LANGUAGES:
            raise InvalidRequest(
                f"language {language!r} is not supported; use one of: {', '.join(LANGUAGES)}",
                field="language",
            )
        size = len(code.encode())
        if size > max_bytes:
            raise InvalidRequest(
                f"code is {size} bytes, over the limit of {max_bytes}; upload large inputs as files",
                field="code",
            )
        if timeout is not None and timeout <= 0:
            raise InvalidRequest(f"timeout={timeout} must be positive (seconds) or null", field="timeout")
        if timeout is None and default_timeout > 0:
            timeout = default_timeout
        if context is not None and language != "python":
            raise InvalidRequest(
                f"a code context runs in a kernel; language {language!r} has none there: "
                "run bash without a context",
                field="context",
            )
        return cls(code, language, timeout, context=context)


@dataclass(frozen=True)
class CellPolicy:
    """How any call runs: output limits and the deadlines of the timeout ladder."""

    limits: OutputLimits = field(default_factory=OutputLimits)
    interrupt_grace: float = 5.0
    restart_timeout: float = 60.0
    agent_timeout: float = 10.0


@dataclass
class RunningCall:
    """What other calls on the sandbox (interrupt, restart) can do to the running execution."""

    language: str = "python"
    context: str | None = None  # the code context whose kernel runs it (None: the main kernel)
    run_id: str = ""
    sub: Subscription | None = None
    interrupt_requested: bool = False
    #: set once the call was sent to the guest (or failed to be): ``run_id`` names it there
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self, what: str, **content: Any) -> None:
        """Wake the execution with a notice (``restarted``, ``kernel_died``) from the host."""
        if self.sub is not None:
            msg = {
                "header": {"msg_type": what},
                "parent_header": {},
                "content": content,
                "metadata": {},
                "buffers": [],
            }
            self.sub.notify(JupyterMessage("agent", msg))


def run_cell(
    agent: AgentClient,
    cell: Cell,
    policy: CellPolicy,
    running: RunningCall,
    session: str,
    replace_vm: ReplaceVm | None = None,
) -> AsyncGenerator[Event, None]:
    """The events of running ``cell``; the caller holds the sandbox's execution lock. Close the
    generator (``aclosing``) when leaving early: the code is then stopped before it returns."""
    return _Driver(agent, cell, policy, running, session, replace_vm).run()


class _Driver:
    def __init__(
        self,
        agent: AgentClient,
        cell: Cell,
        policy: CellPolicy,
        running: RunningCall,
        session: str,
        replace_vm: ReplaceVm | None,
    ) -> None:
        self.agent = agent
        self.cell = cell
        self.policy = policy
        self.running = running
        self.replace_vm = replace_vm
        self.started = time.monotonic()
        run_id = uuid.uuid4().hex
        budget = OutputBudget(policy.limits)
        self.call: Call = (
            BashCall(
                agent,
                run_id,
                budget,
                policy.agent_timeout,
                command=cell.code,
                stdin=cell.stdin,
                keep_state=cell.keep_state,
                user=cell.user,
            )
            if cell.language == "bash"
            else PythonCall(
                agent,
                run_id,
                budget,
                policy.agent_timeout,
                code=cell.code,
                session=session,
                context=cell.context,
            )
        )
        self.status: ExecutionStatus | None = None
        self.recovery: Recovery | None = None
        self.timeout_reported = False
        self.interrupting: asyncio.Future[None] | None = None
        self.finished = self.recovering = False

    async def run(self) -> AsyncGenerator[Event, None]:
        loop = asyncio.get_running_loop()
        timeout = self.cell.timeout
        deadline = None if timeout is None else loop.time() + timeout
        call = self.call
        with self.agent.subscribe(call.run_id) as sub:
            self.running.language, self.running.run_id = call.language, call.run_id
            self.running.sub = sub
            try:
                try:
                    started = await call.start()
                finally:
                    self.running.started.set()
                    self._forget_code()
                for event in started:
                    yield event
                while not call.done:
                    wait = None if deadline is None else max(0.0, deadline - loop.time())
                    try:
                        m = await sub.get(timeout=wait)
                    except TimeoutError:
                        if self.interrupting is None:  # rung 1: interrupt, and give it a grace
                            self._interrupt()
                            deadline = loop.time() + self.policy.interrupt_grace
                            continue
                        yield await self._climb(sub)
                        break
                    if m.channel == "agent":  # a notice from the host or the agent
                        notice = self._notice(m)
                        if notice is None:
                            continue
                        yield notice
                        break
                    for event in call.on_message(m):
                        yield self._as_timeout(event)
                self.finished = True
            except ChannelError as exc:  # closed, or a guest that stopped reading
                yield await self._lost(exc)
                self.finished = True
            finally:
                await self._cleanup(sub)
        if self.status == ExecutionStatus.TIMEOUT and not self.timeout_reported:
            # the code caught the KeyboardInterrupt, or bash has no error to convert
            yield self._timeout_error(self.recovery or Recovery.INTERRUPTED)
        yield self._end()

    def _forget_code(self) -> None:
        """The guest has the code now: the host keeps none of it (a background command may run
        for hours, and its text may be megabytes)."""
        self.cell = dataclasses.replace(self.cell, code="")
        if isinstance(self.call, BashCall):
            self.call.command = ""
        elif isinstance(self.call, PythonCall):
            self.call.code = ""

    def _interrupt(self) -> None:
        self.status, self.recovery = ExecutionStatus.TIMEOUT, Recovery.INTERRUPTED
        # Not awaited here: its reply can queue behind this call's own output, which only this
        # loop drains.
        self.interrupting = asyncio.ensure_future(self.call.interrupt())

    async def _climb(self, sub: Subscription) -> Event:
        """Rungs 2 and 3, after the interrupt's grace ran out."""
        sub.close()  # later output is moot; it must not hold the recovery up
        self.recovering = True
        self.recovery = await recover(self.call, self.agent, self.policy, self.replace_vm)
        self.timeout_reported = True
        return self._timeout_error(self.recovery)

    def _notice(self, m: JupyterMessage) -> Event | None:
        if m.msg_type == "kernel_died" and self.call.language == "python":
            self.status, self.recovery = ExecutionStatus.KERNEL_DIED, Recovery.KERNEL_RESTARTED
            return Error(
                "KernelDied",
                f"the kernel process died (exit code "
                f"{m.content.get('exit_code')}) while running this cell; it was "
                "restarted and its state is lost",
            )
        if m.msg_type == "restarted":
            self.status = ExecutionStatus.RESTARTED
            return Error(
                "KernelRestarted",
                "the sandbox was restarted by a restart request "
                "while this call ran; variables, imports and the shell's state are lost",
            )
        if m.msg_type == "restored":
            self.status = ExecutionStatus.RESTORED
            return Error(
                "SandboxRestored",
                f"the sandbox was rewound to checkpoint {m.content.get('checkpoint')} while this "
                "call ran; its variables and files are as they were then",
            )
        return None

    def _as_timeout(self, event: Event) -> Event:
        if isinstance(event, Error) and self.status == ExecutionStatus.TIMEOUT and not self.timeout_reported:
            # the interrupt's KeyboardInterrupt: report it as the timeout it is
            self.timeout_reported = True
            return Error("TimeoutError", self._timeout_text(Recovery.INTERRUPTED), event.traceback)
        return event

    async def _lost(self, exc: Exception) -> Event:
        self.status = ExecutionStatus.KERNEL_DIED
        lost = f"the sandbox's VM stopped answering ({exc})"
        self.recovery = await replace(self.replace_vm, lost)
        value = (
            f"{lost}; it was replaced with a fresh VM from its template, and variables, "
            "imports and files are lost"
            if self.recovery == Recovery.VM_REPLACED
            else f"{lost}; create a new sandbox"
        )
        return Error("SandboxLost", value)

    async def _cleanup(self, sub: Subscription) -> None:
        self.running.sub = None
        if self.interrupting is not None:
            self.interrupting.cancel()
        if not self.finished and not self.recovering:
            # The consumer went away mid-call (client disconnected): stop the code, and hold the
            # sandbox until it has stopped, so the next call starts on an idle kernel.
            await asyncio.shield(
                stop_abandoned(
                    self.call,
                    sub,
                    self.agent,
                    self.policy,
                    self.replace_vm,
                    interrupt=self.interrupting is None,
                )
            )

    def _end(self) -> End:
        status = self.status
        if status is None:
            status = (
                ExecutionStatus.INTERRUPTED
                if self.running.interrupt_requested
                else ExecutionStatus.ERROR
                if self.call.failed
                else ExecutionStatus.OK
            )
        out = self.call.outcome
        return End(
            status=status,
            duration_ms=round((time.monotonic() - self.started) * 1000, 2),
            execution_count=out.get("execution_count"),
            language=self.call.language,
            exit_code=out.get("exit_code"),
            cpu_ms=out.get("cpu_ms"),
            peak_memory_bytes=out.get("peak_memory_bytes"),
            output_truncated=self.call.budget.truncated,
            recovery=self.recovery,
        )

    def _timeout_error(self, recovery: Recovery | None) -> Error:
        return Error("TimeoutError", self._timeout_text(recovery))

    def _timeout_text(self, recovery: Recovery | None) -> str:
        what = rung_text(recovery, self.call.language, self.policy.interrupt_grace)
        return f"execution exceeded its timeout of {self.cell.timeout}s; {what}"


async def stop_abandoned(
    call: Call,
    sub: Subscription,
    agent: AgentClient,
    policy: CellPolicy,
    replace_vm: ReplaceVm | None,
    interrupt: bool = True,
) -> None:
    """Interrupt a call nobody listens to any more (unless that was done) and drain it until it
    ends; climb the ladder if it does not end within the grace. Its output is dropped."""
    loop = asyncio.get_running_loop()
    # Not awaited before draining: the reply can queue behind the call's output.
    interrupting = asyncio.ensure_future(call.interrupt() if interrupt else asyncio.sleep(0))
    deadline = loop.time() + policy.interrupt_grace
    try:
        while not call.done:
            m = await sub.get(timeout=max(0.0, deadline - loop.time()))
            if m.channel == "agent":
                return  # the kernel died or was restarted: nothing left to stop
            call.on_message(m)
    except TimeoutError:
        sub.close()
        await recover(call, agent, policy, replace_vm)
    except ChannelError:
        await replace(replace_vm, "its VM stopped answering")
    finally:
        interrupting.cancel()


async def recover(
    call: Call, agent: AgentClient, policy: CellPolicy, replace_vm: ReplaceVm | None
) -> Recovery:
    """Rungs 2 and 3: stop the code if the agent answers, else (or if that fails) a new VM."""
    try:
        await agent.request(Op.PING, timeout=policy.agent_timeout)
        alive = True
    except ChannelError:
        alive = False
    if alive and await call.stop(policy.restart_timeout):
        return call.stop_rung
    reason = (
        f"its agent did not answer within {policy.agent_timeout:g}s"
        if not alive
        else "stopping the code failed"
    )
    return await replace(replace_vm, reason) or Recovery.FAILED


async def replace(replace_vm: ReplaceVm | None, reason: str) -> Recovery | None:
    """``vm_replaced``, ``failed``, or None when there is nothing to do: the sandbox is going
    away, or no one can replace VMs (``run_cell`` used without a manager)."""
    if replace_vm is None:
        return None
    try:
        return Recovery.VM_REPLACED if await asyncio.shield(replace_vm(reason)) else None
    except SandboxError:  # BootFailed: the manager has logged it and marked the sandbox dead
        return Recovery.FAILED
    except Exception:  # a fault of ours: kept visible, and the call still ends cleanly
        log.exception("execution.replace_failed", reason=reason)
        return Recovery.FAILED


def rung_text(recovery: Recovery | None, language: str, grace: float) -> str:
    what = "command" if language == "bash" else "kernel"
    texts = {
        Recovery.INTERRUPTED: (
            f"the {what} was interrupted (KeyboardInterrupt); its state is kept"
            if language == "python"
            else "the command was interrupted (SIGINT); the shell's state is kept"
        ),
        Recovery.KERNEL_RESTARTED: (
            f"the kernel did not stop within {grace:g}s of the interrupt "
            "and was restarted; variables and imports were lost"
        ),
        Recovery.KILLED: (
            f"the command did not stop within {grace:g}s of SIGINT and its processes were killed"
        ),
        Recovery.VM_REPLACED: (
            f"the {what} did not stop and the sandbox's agent could not stop "
            "it, so the sandbox got a fresh VM from its template; variables, "
            "imports and files were lost"
        ),
    }
    if recovery in texts:
        return texts[recovery]
    return (
        f"the {what} could not be stopped and replacing the VM failed; delete the sandbox "
        "and create a new one"
    )
