"""Run one cell on a sandbox's kernel and turn the kernel's messages into execution events.

Events (plain dicts, JSON-ready, in the order they happen):

- ``{"type": "stdout"|"stderr", "text": str}``
- ``{"type": "result", "data": {mime: value}, "metadata": {...}, "is_main_result": bool}``
- ``{"type": "error", "name": str, "value": str, "traceback": [str]}``
- ``{"type": "end", "status": "ok"|"error"|"timeout"|"kernel_died", "execution_count": int|None,
  "duration_ms": float}`` (always last)

Timeouts escalate: at the deadline the kernel is interrupted; if it has not finished
``interrupt_grace`` seconds later, the kernel is restarted and the result says the state is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from datetime import datetime, timezone
from typing import Any

from ..channel import AgentClient, AgentError, ChannelClosed, JupyterMessage, Subscription

PROTOCOL_VERSION = "5.3"


def jupyter_message(msg_type: str, content: dict[str, Any], session: str) -> dict[str, Any]:
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
        "metadata": {},
        "content": content,
        "buffers": [],
    }


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else str(value)


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
        return {"type": "error", "name": _text(c.get("ename", "Error")),
                "value": _text(c.get("evalue", "")),
                "traceback": [_text(x) for x in tb] if isinstance(tb, list) else []}
    if t == "clear_output":
        return {"type": "clear_output", "wait": bool(c.get("wait", False))}
    return None


async def run_cell(
    agent: AgentClient,
    session: str,
    code: str,
    *,
    timeout: float | None,
    interrupt_grace: float,
    restart_timeout: float = 60.0,
    on_subscription: Callable[[Subscription | None], None] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """Yield the events of executing ``code``; the caller holds the sandbox's execution lock."""
    started = time.monotonic()
    msg = jupyter_message("execute_request", {
        "code": code, "silent": False, "store_history": True, "user_expressions": {},
        "allow_stdin": False, "stop_on_error": True,
    }, session)
    msg_id = msg["header"]["msg_id"]
    status, count = "ok", None
    got_reply = got_idle = False
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    interrupted = False
    interrupt: asyncio.Future[None] | None = None
    finished = False

    with agent.subscribe(msg_id) as sub:
        if on_subscription is not None:
            on_subscription(sub)
        try:
            await agent.send_jupyter("shell", msg)
            while not (got_reply and got_idle):
                wait = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    m = await sub.get(timeout=wait)
                except (asyncio.TimeoutError, TimeoutError):
                    if not interrupted:
                        interrupted = True
                        status = "timeout"
                        # Do not wait for the reply here: it can be queued behind this cell's
                        # own output, which only this loop drains.
                        interrupt = asyncio.ensure_future(_interrupt(agent))
                        yield _timeout_error(timeout, "the kernel was interrupted; its state is kept")
                        deadline = loop.time() + interrupt_grace
                        continue
                    yield _timeout_error(
                        timeout, f"the kernel did not stop within {interrupt_grace:.0f}s of the "
                        "interrupt and was restarted; variables and imports were lost")
                    sub.close()  # later output is moot; it must not hold up the restart's reply
                    await _restart(agent, restart_timeout)
                    break
                if m.channel == "agent":  # synthetic: the kernel process died mid-execution
                    status = "kernel_died"
                    code_ = m.content.get("exit_code")
                    yield {"type": "error", "name": "KernelDied",
                           "value": f"the kernel process died (exit code {code_}) while running "
                                    "this cell; it was restarted and its state is lost",
                           "traceback": []}
                    break
                if m.channel == "iopub":
                    if m.msg_type == "status" and m.content.get("execution_state") == "idle":
                        got_idle = True
                    elif m.msg_type == "execute_input":
                        if isinstance(m.content.get("execution_count"), int):
                            count = m.content["execution_count"]
                    else:
                        event = iopub_event(m)
                        if event is not None:
                            yield event
                elif m.channel == "shell" and m.msg_type == "execute_reply":
                    got_reply = True
                    if isinstance(m.content.get("execution_count"), int):
                        count = m.content["execution_count"]
                    if status == "ok" and m.content.get("status") != "ok":
                        status = "error"
            finished = True
        except ChannelClosed as exc:
            status = "kernel_died"
            yield {"type": "error", "name": "SandboxLost",
                   "value": f"the sandbox's VM stopped answering ({exc}); create a new sandbox",
                   "traceback": []}
            finished = True
        finally:
            if interrupt is not None:
                interrupt.cancel()
            if not finished and interrupt is None:
                # The consumer went away mid-cell (client disconnected): stop the code. Drop the
                # subscription first, so its full queue cannot hold the reply up behind output.
                sub.close()
                with contextlib.suppress(Exception):
                    await asyncio.shield(agent.request("interrupt", timeout=10))
    yield {"type": "end", "status": status, "execution_count": count,
           "duration_ms": round((time.monotonic() - started) * 1000, 2)}


def _timeout_error(timeout: float | None, what: str) -> dict[str, Any]:
    return {"type": "error", "name": "TimeoutError",
            "value": f"execution exceeded its timeout of {timeout}s; {what}", "traceback": []}


async def _interrupt(agent: AgentClient) -> None:
    with contextlib.suppress(AgentError, ChannelClosed, asyncio.TimeoutError):
        await agent.request("interrupt", timeout=10)


async def _restart(agent: AgentClient, timeout: float) -> None:
    with contextlib.suppress(AgentError, asyncio.TimeoutError):
        await agent.request("restart", timeout=timeout)


def inject_kernel_death(sub: Subscription, event: dict[str, Any]) -> None:
    """Wake an execution waiting on ``sub``: its kernel died."""
    msg = {"header": {"msg_type": "kernel_died"}, "parent_header": {}, "content": event,
           "metadata": {}, "buffers": []}
    # Never drop the death notice: with the queue full, drop the oldest output instead.
    while sub.queue.full():
        sub.queue.get_nowait()
    sub.queue.put_nowait(JupyterMessage("agent", msg))
