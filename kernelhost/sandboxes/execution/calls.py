"""One kind of call each: Python on the kernel, a bash command on the agent. A call knows how to
start, how to read the messages of its run, how to interrupt, and how to stop at the cost of its
state (rung 2 of the timeout ladder); the driver (``driver.py``) does the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...channel import AgentClient, ChannelError, JupyterMessage, NotSupportedByAgent
from ...channel.protocol import BashFrame, Op, jupyter_message
from ..states import Recovery
from .events import ClearOutput, Error, Event, Result, Stream
from .output import OutputBudget

STDIN_HINT = (
    " (kernelhost runs code without a terminal, so input() and getpass() fail at once: "
    "put the value in the code, or in a file written with files.write)"
)


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else str(value)


def iopub_event(m: JupyterMessage) -> Event | None:
    """The event for one iopub message of an execution, or None if it carries none."""
    c = m.content
    t = m.msg_type
    if t == "stream":
        return Stream("stderr" if c.get("name") == "stderr" else "stdout", _text(c.get("text", "")))
    if t in ("execute_result", "display_data", "update_display_data"):
        data = c.get("data") if isinstance(c.get("data"), dict) else {}
        meta = c.get("metadata") if isinstance(c.get("metadata"), dict) else {}
        transient = c.get("transient")
        raw_id = transient.get("display_id") if isinstance(transient, dict) else None
        display_id = (
            str(raw_id)[:200] if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) else None
        )
        if t == "update_display_data" and display_id is None:
            return None  # an update of nothing: Jupyter drops it too
        return Result(
            data or {},
            meta or {},
            is_main_result=t == "execute_result",
            display_id=display_id,
            update=t == "update_display_data",
        )
    if t == "error":
        tb = c.get("traceback")
        name = _text(c.get("ename", "Error"))
        value = _text(c.get("evalue", ""))
        if name == "StdinNotImplementedError":
            value = value.rstrip(".") + STDIN_HINT
        return Error(name, value, [_text(x) for x in tb] if isinstance(tb, list) else [])
    if t == "clear_output":
        return ClearOutput(bool(c.get("wait", False)))
    return None


def usage(value: Any) -> dict[str, Any]:
    """``cpu_ms`` and ``peak_memory_bytes`` from the guest, kept only if they are sane numbers."""
    out: dict[str, Any] = {}
    if not isinstance(value, dict):
        return out
    cpu = value.get("cpu_ms")
    if isinstance(cpu, int | float) and not isinstance(cpu, bool) and math.isfinite(cpu) and cpu >= 0:
        out["cpu_ms"] = round(float(cpu), 1)
    peak = value.get("peak_memory_bytes")
    if isinstance(peak, int) and not isinstance(peak, bool) and 0 <= peak < 1 << 50:
        out["peak_memory_bytes"] = peak
    return out


@dataclass
class Call:
    """The part of an execution that depends on what runs: start, read messages, stop."""

    agent: AgentClient
    run_id: str
    budget: OutputBudget
    agent_timeout: float
    done: bool = False
    failed: bool = False
    outcome: dict[str, Any] = field(default_factory=dict)  # execution_count, exit_code, usage

    language = "python"
    stop_rung = Recovery.KERNEL_RESTARTED

    async def start(self) -> list[Event]:
        raise NotImplementedError

    def on_message(self, m: JupyterMessage) -> list[Event]:
        raise NotImplementedError

    async def interrupt(self) -> None:
        raise NotImplementedError

    async def stop(self, timeout: float) -> bool:
        """Rung 2: end the code at the cost of its state; True if the agent did it."""
        raise NotImplementedError

    def _output(self, event: Event) -> list[Event]:
        if isinstance(event, Stream):
            return list(self.budget.stream(event.name, event.text))
        if isinstance(event, Result):
            return [self.budget.result(event)]
        return [event]


@dataclass
class PythonCall(Call):
    """A cell on the main kernel, or on the kernel of code context ``context``."""

    code: str = ""
    session: str = ""
    context: str | None = None
    got_reply: bool = False
    got_idle: bool = False

    async def start(self) -> list[Event]:
        limits = self.budget.limits.for_guest()
        msg = jupyter_message(
            "execute_request",
            {
                "code": self.code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                # Calls never queue in the kernel (the host runs them one at a time), so nothing is
                # there to abort after an error; an abort would only ever hit an innocent call.
                "allow_stdin": False,
                "stop_on_error": False,
            },
            self.session,
            msg_id=self.run_id,
            metadata={"kernelhost": limits} if limits else None,
        )
        await self.agent.send_jupyter("shell", msg, timeout=self.agent_timeout, context=self.context)
        return []

    def on_message(self, m: JupyterMessage) -> list[Event]:
        events: list[Event] = []
        if m.channel == "iopub":
            if m.msg_type == "status" and m.content.get("execution_state") == "idle":
                self.got_idle = True
            elif m.msg_type == "execute_input":
                self._count(m.content.get("execution_count"))
            else:
                event = iopub_event(m)
                if event is not None:
                    events = self._output(event)
        elif m.channel == "shell" and m.msg_type == "execute_reply":
            self.got_reply = True
            self._count(m.content.get("execution_count"))
            self.failed = m.content.get("status") != "ok"
            if m.content.get("status") == "aborted":
                events = [Error("Aborted", "the kernel aborted this request without running it")]
            self.outcome.update(usage(m.msg.get("metadata", {}).get("kernelhost")))
        self.done = self.got_reply and self.got_idle
        return events

    def _count(self, value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            self.outcome["execution_count"] = value

    async def interrupt(self) -> None:
        try:
            if self.context is None:
                await self.agent.request(Op.INTERRUPT, timeout=self.agent_timeout)
            else:
                await self.agent.request(
                    Op.CONTEXT_INTERRUPT, timeout=self.agent_timeout, context=self.context
                )
        except ChannelError:
            pass  # the ladder's next rung deals with an agent that does not answer

    async def stop(self, timeout: float) -> bool:
        try:
            if self.context is None:
                await self.agent.request(Op.RESTART, timeout=timeout)
            else:
                await self.agent.request(Op.CONTEXT_RESTART, timeout=timeout, context=self.context)
        except ChannelError:
            return False
        return True


@dataclass
class BashCall(Call):
    command: str = ""
    stdin: bool = False
    keep_state: bool = True
    user: str | None = None

    language = "bash"
    stop_rung = Recovery.KILLED

    async def start(self) -> list[Event]:
        process: dict[str, Any] = {"stdin": True} if self.stdin else {}
        if not self.keep_state:
            process["keep_state"] = False
        if self.user is not None:
            process["user"] = self.user
        try:
            await self.agent.start_bash(
                self.run_id,
                timeout=self.agent_timeout,
                command=self.command,
                max_output_bytes=self.budget.limits.max_output_bytes,
                **process,
            )
        except NotSupportedByAgent:
            return self._unavailable(
                "the sandbox's guest image predates language='bash'; "
                "rebuild the images (make image) and create a new sandbox"
            )
        except ChannelError as exc:
            return self._unavailable(f"the sandbox could not start the command: {exc}")
        return []

    def _unavailable(self, why: str) -> list[Event]:
        self.done = self.failed = True
        return [Error("BashUnavailable", why)]

    def on_message(self, m: JupyterMessage) -> list[Event]:
        if m.channel == "iopub" and m.msg_type == "stream":
            event = iopub_event(m)
            return self._output(event) if event is not None else []
        if not (m.channel == "shell" and m.msg_type == BashFrame.REPLY):
            return []
        self.done = True
        c = m.content
        code, sig = c.get("exit_code"), c.get("signal")
        self.outcome.update(usage(c))
        if isinstance(code, int) and not isinstance(code, bool):
            self.outcome["exit_code"] = code
        if isinstance(c.get("failure"), str):
            self.failed = True
            return [Error("AgentError", f"the sandbox's agent lost track of the command: {c['failure']}")]
        if self.outcome.get("exit_code", 0) == 0:
            return []
        self.failed = True
        how = (
            f"was killed by signal {sig} (exit code {code})"
            if isinstance(sig, int) and not isinstance(sig, bool)
            else f"exited with code {code}"
        )
        return [Error("CommandFailed", f"the command {how}")]

    async def interrupt(self) -> None:
        try:
            await self.agent.request(
                Op.BASH_SIGNAL, timeout=self.agent_timeout, run_id=self.run_id, signal="INT"
            )
        except ChannelError:
            pass  # the ladder's next rung deals with an agent that does not answer

    async def stop(self, timeout: float) -> bool:
        try:
            await self.agent.request(
                Op.BASH_SIGNAL, timeout=min(timeout, self.agent_timeout), run_id=self.run_id, signal="KILL"
            )
        except ChannelError:
            return False
        return True
