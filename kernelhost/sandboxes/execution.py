"""Run one call on a sandbox (Python on its kernel, or a bash command on its agent) and turn what
comes back into execution events.

Events (plain dicts, JSON-ready, in the order they happen):

- ``{"type": "stdout"|"stderr", "text": str}``
- ``{"type": "result", "data": {mime: value}, "metadata": {...}, "is_main_result": bool}``, plus
  ``"truncated": true`` when formats over ``max_result_bytes`` were dropped
- ``{"type": "error", "name": str, "value": str, "traceback": [str]}``
- ``{"type": "clear_output", "wait": bool}``
- ``{"type": "end", ...}``, always last: ``status`` (``ok``, ``error``, ``timeout``,
  ``interrupted``, ``restarted``, ``kernel_died``), ``execution_count`` (Python), ``exit_code``
  (bash), ``duration_ms`` (wall time), ``cpu_ms`` and ``peak_memory_bytes`` (measured in the guest,
  when it reported them), ``output_truncated``, and ``recovery`` when the sandbox had to be
  brought back: ``interrupted``, ``killed`` (bash), ``kernel_restarted`` or ``vm_replaced``.

Output limits: stdout and stderr together are cut at ``max_output_bytes`` per call, with one
visible marker; a result over ``max_result_bytes`` loses its largest formats, with a marker. The
guest is told the caps so it drops what nobody will keep, but the host enforces them.

Timeouts escalate, and always end with a usable sandbox: at the deadline the code is interrupted
(SIGINT: KeyboardInterrupt, state kept); if it is still running ``interrupt_grace`` seconds later
and the agent answers a ping, the kernel is restarted (bash: the command's processes are killed);
if the agent does not answer, or the restart fails, ``replace_vm`` gives the sandbox a new VM.
The one ``TimeoutError`` event says which rung it took, and ``end.recovery`` names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..channel import AgentClient, AgentError, ChannelClosed, JupyterMessage, Subscription

PROTOCOL_VERSION = "5.3"
LANGUAGES = ("python", "bash")

#: ``replace_vm(reason)``: give the sandbox a new VM; False when it must not (being deleted).
ReplaceVm = Callable[[str], Awaitable[bool]]


@dataclass
class Control:
    """What other calls on the sandbox (interrupt, restart) can do to the running execution."""

    kind: str = "python"
    run_id: str = ""
    sub: Subscription | None = None
    interrupt_requested: bool = False

    def notify(self, what: str, **content: Any) -> None:
        """Wake the execution with a notice (``restarted``, ``kernel_died``) from the host."""
        if self.sub is not None:
            _inject(self.sub, what, content)


@dataclass
class _Tally:
    """Output accounting of one execution."""

    max_output_bytes: int | None
    max_result_bytes: int | None
    used: int = 0
    truncated: bool = False

    def stream(self, name: str, text: str) -> list[dict[str, Any]]:
        if self.max_output_bytes is None:
            return [{"type": name, "text": text}]
        if self.truncated:
            return []
        data = text.encode("utf-8", "surrogatepass")
        if self.used + len(data) <= self.max_output_bytes:
            self.used += len(data)
            return [{"type": name, "text": text}]
        keep = data[: self.max_output_bytes - self.used].decode("utf-8", "ignore")
        self.used, self.truncated = self.max_output_bytes, True
        events = [{"type": name, "text": keep}] if keep else []
        events.append({"type": name, "text": (
            f"\n[kernelhost: output truncated: this call wrote more than "
            f"{self.max_output_bytes} bytes to stdout/stderr (the server's max_output_bytes); "
            "the rest was dropped. Write large output to a file and read it with files.read]\n")})
        return events

    def result(self, event: dict[str, Any]) -> dict[str, Any]:
        """Drop MIME entries that are not JSON-safe, then the largest until under the cap."""
        sizes: dict[str, int] = {}
        for mime, value in event["data"].items():
            size = _json_size(value)
            if isinstance(mime, str) and size is not None:
                sizes[mime] = size
        data = {mime: event["data"][mime] for mime in sizes}
        dropped = [m for m in event["data"] if m not in sizes]
        limit = self.max_result_bytes
        total = sum(sizes.values())
        if limit is not None and total > limit:
            for mime in sorted(sizes, key=lambda m: sizes[m], reverse=True):
                if total <= limit:
                    break
                del data[mime]
                total -= sizes[mime]
                dropped.append(str(mime))
        if not dropped:
            return event
        note = (f"[kernelhost: {', '.join(map(str, dropped))} dropped from this result: over "
                f"the server's max_result_bytes of {limit} bytes, or not JSON data. Save large "
                "outputs to a file and read it with files.read]")
        plain = data.get("text/plain")
        data["text/plain"] = f"{plain}\n{note}" if isinstance(plain, str) else note
        metadata = event["metadata"] if _json_size(event["metadata"]) is not None else {}
        return {**event, "data": data, "metadata": metadata, "truncated": True}


def _json_size(value: Any) -> int | None:
    if isinstance(value, str):
        return len(value)
    try:
        return len(json.dumps(value))
    except (TypeError, ValueError, RecursionError):
        return None


def jupyter_message(msg_type: str, content: dict[str, Any], session: str,
                    metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "session": session,
            "username": "kernelhost",
            "date": datetime.now(timezone.utc).isoformat(),
            "version": PROTOCOL_VERSION,
        },
        "parent_header": {},
        "metadata": metadata or {},
        "content": content,
        "buffers": [],
    }


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else str(value)


STDIN_HINT = (" (kernelhost runs code without a terminal, so input() and getpass() fail at once: "
              "put the value in the code, or in a file written with files.write)")


def iopub_event(m: JupyterMessage) -> dict[str, Any] | None:
    """The event for one iopub message of an execution, or None if it carries none."""
    c = m.content
    t = m.msg_type
    if t == "stream":
        name = "stderr" if c.get("name") == "stderr" else "stdout"
        return {"type": name, "text": _text(c.get("text", ""))}
    if t in ("execute_result", "display_data"):
        data = c.get("data") if isinstance(c.get("data"), dict) else {}
        meta = c.get("metadata") if isinstance(c.get("metadata"), dict) else {}
        return {"type": "result", "data": data, "metadata": meta,
                "is_main_result": t == "execute_result"}
    if t == "error":
        tb = c.get("traceback")
        name = _text(c.get("ename", "Error"))
        value = _text(c.get("evalue", ""))
        if name == "StdinNotImplementedError":
            value = value.rstrip(".") + STDIN_HINT
        return {"type": "error", "name": name, "value": value,
                "traceback": [_text(x) for x in tb] if isinstance(tb, list) else []}
    if t == "clear_output":
        return {"type": "clear_output", "wait": bool(c.get("wait", False))}
    return None


def _usage(value: Any) -> dict[str, Any]:
    """``cpu_ms`` and ``peak_memory_bytes`` from the guest, kept only if they are sane numbers."""
    out: dict[str, Any] = {}
    if not isinstance(value, dict):
        return out
    cpu = value.get("cpu_ms")
    if isinstance(cpu, (int, float)) and not isinstance(cpu, bool) and math.isfinite(cpu) \
            and cpu >= 0:
        out["cpu_ms"] = round(float(cpu), 1)
    peak = value.get("peak_memory_bytes")
    if isinstance(peak, int) and not isinstance(peak, bool) and 0 <= peak < 1 << 50:
        out["peak_memory_bytes"] = peak
    return out


# -- one kind of call each: Python on the kernel, bash on the agent ------------------------------


@dataclass
class _Call:
    """The part of an execution that depends on what runs: start, read messages, stop."""

    agent: AgentClient
    run_id: str
    tally: _Tally
    agent_timeout: float
    done: bool = False
    failed: bool = False
    end: dict[str, Any] = field(default_factory=dict)

    kind = "python"
    stop_rung = "kernel_restarted"

    async def start(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def on_message(self, m: JupyterMessage) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def interrupt(self) -> None:
        raise NotImplementedError

    async def stop(self, timeout: float) -> bool:
        """Rung 2: end the code at the cost of its state; True if the agent did it."""
        raise NotImplementedError

    def _output(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        if event["type"] in ("stdout", "stderr"):
            return self.tally.stream(event["type"], event["text"])
        if event["type"] == "result":
            return [self.tally.result(event)]
        return [event]


@dataclass
class _PythonCall(_Call):
    code: str = ""
    session: str = ""
    got_reply: bool = False
    got_idle: bool = False

    async def start(self) -> list[dict[str, Any]]:
        limits = {k: v for k, v in (("max_output_bytes", self.tally.max_output_bytes),
                                    ("max_result_bytes", self.tally.max_result_bytes))
                  if v is not None}
        msg = jupyter_message("execute_request", {
            "code": self.code, "silent": False, "store_history": True, "user_expressions": {},
            # Calls never queue in the kernel (the host runs them one at a time), so nothing is
            # there to abort after an error; an abort would only ever hit an innocent call.
            "allow_stdin": False, "stop_on_error": False,
        }, self.session, metadata={"kernelhost": limits} if limits else None)
        msg["header"]["msg_id"] = self.run_id
        await self.agent.send_jupyter("shell", msg)
        return []

    def on_message(self, m: JupyterMessage) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if m.channel == "iopub":
            if m.msg_type == "status" and m.content.get("execution_state") == "idle":
                self.got_idle = True
            elif m.msg_type == "execute_input":
                if isinstance(m.content.get("execution_count"), int):
                    self.end["execution_count"] = m.content["execution_count"]
            else:
                event = iopub_event(m)
                if event is not None:
                    events = self._output(event)
        elif m.channel == "shell" and m.msg_type == "execute_reply":
            self.got_reply = True
            if isinstance(m.content.get("execution_count"), int):
                self.end["execution_count"] = m.content["execution_count"]
            self.failed = m.content.get("status") != "ok"
            if m.content.get("status") == "aborted":
                events = [{"type": "error", "name": "Aborted",
                           "value": "the kernel aborted this request without running it",
                           "traceback": []}]
            self.end.update(_usage(m.msg.get("metadata", {}).get("kernelhost")))
        self.done = self.got_reply and self.got_idle
        return events

    async def interrupt(self) -> None:
        with contextlib.suppress(AgentError, ChannelClosed, asyncio.TimeoutError):
            await self.agent.request("interrupt", timeout=self.agent_timeout)

    async def stop(self, timeout: float) -> bool:
        try:
            await self.agent.request("restart", timeout=timeout)
        except (AgentError, ChannelClosed, asyncio.TimeoutError):
            return False
        return True


@dataclass
class _BashCall(_Call):
    command: str = ""

    kind = "bash"
    stop_rung = "killed"

    async def start(self) -> list[dict[str, Any]]:
        try:
            await self.agent.request("bash", timeout=self.agent_timeout, run_id=self.run_id,
                                     command=self.command,
                                     max_output_bytes=self.tally.max_output_bytes)
        except AgentError as exc:
            self.done = self.failed = True
            what = ("the sandbox's guest image predates language='bash'; rebuild the images "
                    "(make image) and create a new sandbox" if "unknown op" in str(exc)
                    else f"the sandbox could not start the command: {exc}")
            return [{"type": "error", "name": "BashUnavailable", "value": what, "traceback": []}]
        return []

    def on_message(self, m: JupyterMessage) -> list[dict[str, Any]]:
        if m.channel == "iopub" and m.msg_type == "stream":
            event = iopub_event(m)
            return self._output(event) if event is not None else []
        if not (m.channel == "shell" and m.msg_type == "bash_reply"):
            return []
        self.done = True
        c = m.content
        code, sig = c.get("exit_code"), c.get("signal")
        self.end.update(_usage(c))
        if isinstance(code, int) and not isinstance(code, bool):
            self.end["exit_code"] = code
        if isinstance(c.get("failure"), str):
            self.failed = True
            return [{"type": "error", "name": "AgentError",
                     "value": f"the sandbox's agent lost track of the command: {c['failure']}",
                     "traceback": []}]
        if self.end.get("exit_code", 0) == 0:
            return []
        self.failed = True
        how = (f"was killed by signal {sig} (exit code {code})"
               if isinstance(sig, int) and not isinstance(sig, bool) else f"exited with code {code}")
        return [{"type": "error", "name": "CommandFailed", "value": f"the command {how}",
                 "traceback": []}]

    async def interrupt(self) -> None:
        with contextlib.suppress(AgentError, ChannelClosed, asyncio.TimeoutError):
            await self.agent.request("bash_signal", timeout=self.agent_timeout,
                                     run_id=self.run_id, signal="INT")

    async def stop(self, timeout: float) -> bool:
        try:
            await self.agent.request("bash_signal", timeout=min(timeout, self.agent_timeout),
                                     run_id=self.run_id, signal="KILL")
        except (AgentError, ChannelClosed, asyncio.TimeoutError):
            return False
        return True


# -- the driver: deadline, ladder, loss of the VM, the consumer leaving ---------------------------


async def run_cell(
    agent: AgentClient,
    session: str,
    code: str,
    *,
    timeout: float | None,
    interrupt_grace: float,
    restart_timeout: float = 60.0,
    language: str = "python",
    max_output_bytes: int | None = None,
    max_result_bytes: int | None = None,
    agent_timeout: float = 10.0,
    control: Control | None = None,
    replace_vm: ReplaceVm | None = None,
    on_subscription: Callable[[Subscription | None], None] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """Yield the events of running ``code``; the caller holds the sandbox's execution lock."""
    started = time.monotonic()
    run_id = uuid.uuid4().hex
    tally = _Tally(max_output_bytes, max_result_bytes)
    call: _Call
    if language == "bash":
        call = _BashCall(agent, run_id, tally, agent_timeout, command=code)
    else:
        call = _PythonCall(agent, run_id, tally, agent_timeout, code=code, session=session)
    control = control or Control()
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    status: str | None = None
    recovery: str | None = None
    timeout_reported = False
    interrupting: asyncio.Future[None] | None = None
    finished = recovering = False

    with agent.subscribe(run_id) as sub:
        control.kind, control.run_id, control.sub = call.kind, run_id, sub
        if on_subscription is not None:
            on_subscription(sub)
        try:
            for event in await call.start():
                yield event
            while not call.done:
                wait = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    m = await sub.get(timeout=wait)
                except (asyncio.TimeoutError, TimeoutError):
                    if interrupting is None:  # rung 1: interrupt, and give it a grace period
                        status, recovery = "timeout", "interrupted"
                        # Not awaited here: its reply can queue behind this call's own output,
                        # which only this loop drains.
                        interrupting = asyncio.ensure_future(call.interrupt())
                        deadline = loop.time() + interrupt_grace
                        continue
                    sub.close()  # later output is moot; it must not hold the recovery up
                    recovering = True
                    recovery = await _recover(call, agent, restart_timeout, agent_timeout,
                                              replace_vm)
                    yield _timeout_error(timeout, _rung_text(recovery, call.kind,
                                                             interrupt_grace))
                    timeout_reported = True
                    break
                if m.channel == "agent":  # a notice from the host or the agent, not the code
                    if m.msg_type == "kernel_died" and call.kind == "python":
                        status, recovery = "kernel_died", "kernel_restarted"
                        code_ = m.content.get("exit_code")
                        yield {"type": "error", "name": "KernelDied",
                               "value": f"the kernel process died (exit code {code_}) while "
                                        "running this cell; it was restarted and its state is "
                                        "lost", "traceback": []}
                        break
                    if m.msg_type == "restarted":
                        status = "restarted"
                        yield {"type": "error", "name": "KernelRestarted",
                               "value": "the sandbox was restarted by a restart request while "
                                        "this call ran; variables, imports and the shell's "
                                        "state are lost", "traceback": []}
                        break
                    continue
                for event in call.on_message(m):
                    if event["type"] == "error" and status == "timeout" and not timeout_reported:
                        # the interrupt's KeyboardInterrupt: report it as the timeout it is
                        timeout_reported = True
                        event = {**_timeout_error(timeout, _rung_text(
                            "interrupted", call.kind, interrupt_grace)),
                            "traceback": event.get("traceback", [])}
                    yield event
            finished = True
        except ChannelClosed as exc:
            status = "kernel_died"
            lost = f"the sandbox's VM stopped answering ({exc})"
            recovery = await _replace(replace_vm, lost)
            value = (f"{lost}; it was replaced with a fresh VM from its template, and "
                     "variables, imports and files are lost" if recovery == "vm_replaced"
                     else f"{lost}; create a new sandbox")
            yield {"type": "error", "name": "SandboxLost", "value": value, "traceback": []}
            finished = True
        finally:
            control.sub = None
            if interrupting is not None:
                interrupting.cancel()
            if not finished and not recovering:
                # The consumer went away mid-call (client disconnected): stop the code, and hold
                # the sandbox until it has stopped, so the next call starts on an idle kernel.
                with contextlib.suppress(Exception):
                    await asyncio.shield(_settle(
                        call, sub, agent, interrupt_grace, restart_timeout, agent_timeout,
                        replace_vm, interrupt=interrupting is None))
    if status == "timeout" and not timeout_reported:
        # the code caught the KeyboardInterrupt, or bash has no error to convert
        yield _timeout_error(timeout, _rung_text(recovery or "interrupted", call.kind,
                                                 interrupt_grace))
    if status is None:
        status = ("interrupted" if control.interrupt_requested
                  else "error" if call.failed else "ok")
    end: dict[str, Any] = {"type": "end", "status": status,
                           "execution_count": call.end.get("execution_count"),
                           "duration_ms": round((time.monotonic() - started) * 1000, 2)}
    if call.kind == "bash":
        end["exit_code"] = call.end.get("exit_code")
    for key in ("cpu_ms", "peak_memory_bytes"):
        if key in call.end:
            end[key] = call.end[key]
    end["output_truncated"] = tally.truncated
    if recovery is not None:
        end["recovery"] = recovery
    yield end


async def _settle(call: _Call, sub: Subscription, agent: AgentClient, grace: float,
                  restart_timeout: float, agent_timeout: float,
                  replace_vm: ReplaceVm | None, interrupt: bool = True) -> None:
    """Interrupt a call nobody listens to any more (unless that was done) and drain it until it
    ends; climb the ladder if it does not end within ``grace``. Its output is dropped."""
    loop = asyncio.get_running_loop()
    # Not awaited before draining: the reply can queue behind the call's output.
    interrupting = asyncio.ensure_future(call.interrupt() if interrupt else asyncio.sleep(0))
    deadline = loop.time() + grace
    try:
        while not call.done:
            m = await sub.get(timeout=max(0.0, deadline - loop.time()))
            if m.channel == "agent":
                return  # the kernel died or was restarted: nothing left to stop
            call.on_message(m)
    except (asyncio.TimeoutError, TimeoutError):
        sub.close()
        await _recover(call, agent, restart_timeout, agent_timeout, replace_vm)
    except ChannelClosed:
        await _replace(replace_vm, "its VM stopped answering")
    finally:
        interrupting.cancel()


async def _recover(call: _Call, agent: AgentClient, restart_timeout: float,
                   agent_timeout: float, replace_vm: ReplaceVm | None) -> str:
    """Rungs 2 and 3: stop the code if the agent answers, else (or if that fails) a new VM."""
    try:
        await agent.request("ping", timeout=agent_timeout)
        alive = True
    except (AgentError, ChannelClosed, asyncio.TimeoutError):
        alive = False
    if alive and await call.stop(restart_timeout):
        return call.stop_rung
    reason = (f"its agent did not answer within {agent_timeout:g}s" if not alive
              else "stopping the code failed")
    return await _replace(replace_vm, reason) or "failed"


async def _replace(replace_vm: ReplaceVm | None, reason: str) -> str | None:
    """``vm_replaced``, ``failed``, or None when there is nothing to do: the sandbox is going
    away, or no one can replace VMs (``run_cell`` used without a manager)."""
    if replace_vm is None:
        return None
    try:
        return "vm_replaced" if await asyncio.shield(replace_vm(reason)) else None
    except Exception:  # the manager has logged it and marked the sandbox dead
        return "failed"


def _rung_text(recovery: str, kind: str, grace: float) -> str:
    what = "command" if kind == "bash" else "kernel"
    return {
        "interrupted": (f"the {what} was interrupted (KeyboardInterrupt); its state is kept"
                        if kind == "python" else
                        "the command was interrupted (SIGINT); the shell's state is kept"),
        "kernel_restarted": (f"the kernel did not stop within {grace:g}s of the interrupt and "
                             "was restarted; variables and imports were lost"),
        "killed": (f"the command did not stop within {grace:g}s of SIGINT and its processes "
                   "were killed"),
        "vm_replaced": (f"the {what} did not stop and the sandbox's agent could not stop it, so "
                        "the sandbox got a fresh VM from its template; variables, imports and "
                        "files were lost"),
    }.get(recovery, f"the {what} could not be stopped and replacing the VM failed; delete the "
                    "sandbox and create a new one")


def _timeout_error(timeout: float | None, what: str) -> dict[str, Any]:
    return {"type": "error", "name": "TimeoutError",
            "value": f"execution exceeded its timeout of {timeout}s; {what}", "traceback": []}


def _inject(sub: Subscription, what: str, content: dict[str, Any]) -> None:
    msg = {"header": {"msg_type": what}, "parent_header": {}, "content": content,
           "metadata": {}, "buffers": []}
    # Never drop the notice: with the queue full, drop the oldest output instead.
    while sub.queue.full():
        sub.queue.get_nowait()
    sub.queue.put_nowait(JupyterMessage("agent", msg))


def inject_kernel_death(sub: Subscription, event: dict[str, Any]) -> None:
    """Wake an execution waiting on ``sub``: its kernel died."""
    _inject(sub, "kernel_died", event)
