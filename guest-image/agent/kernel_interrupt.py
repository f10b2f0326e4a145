"""A reply to every execute_request, also when an interrupt hits outside the cell's own code
(``launch_kernel.py`` installs it).

ipykernel turns SIGINT into ``KeyboardInterrupt`` for the whole time it handles a request, but
only the part that runs the user's code catches it (IPython shows it as the cell's error). One
that lands while the kernel prepares the cell (after ``execute_input``: input transformers,
parsing) or while it flushes the cell's output before the reply escapes the handler: ipykernel
logs "KeyboardInterrupt caught in kernel" and sends nothing, no error and no reply. A client
then waits for that reply for ever (a notebook's cell, jupyter_client's ``execute_interactive``),
and the host's timeout ladder takes the silence for a kernel that ignores interrupts and
restarts it, losing the namespace. Under emulation the window is tens of milliseconds wide, so
an interrupt sent as soon as ``execute_input`` is seen finds it.

Here such a request gets what an interrupt in its code gives: an ``error`` on iopub, an
``execute_reply`` with status ``error`` and ename ``KeyboardInterrupt`` (unless its reply had
already gone), and the queued requests aborted as ``stop_on_error`` asks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ipykernel import kernelbase
from jupyter_client.session import Session

_installed = False
_replied_to: str | None = None  # msg_id of the request whose execute_reply went last

TRACEBACK = ["KeyboardInterrupt: interrupted before the cell's code ran or after it ended"]


def _msg_id(msg: Any) -> str | None:
    header = msg.get("header") if isinstance(msg, dict) else None
    msg_id = header.get("msg_id") if isinstance(header, dict) else None
    return msg_id if isinstance(msg_id, str) else None


def _answer(kernel: Any, stream: Any, ident: Any, parent: Any) -> None:
    """The error and the reply an interrupt in the cell's code would have given."""
    if _msg_id(parent) is None or _msg_id(parent) == _replied_to:
        return  # its reply went before the interrupt came: nothing is owed
    content = parent.get("content") if isinstance(parent.get("content"), dict) else {}
    error = {"ename": "KeyboardInterrupt", "evalue": "", "traceback": list(TRACEBACK)}
    silent = bool(content.get("silent", False))
    if not silent:
        topic = kernel._topic("error") if hasattr(kernel, "_topic") else None
        kernel.session.send(kernel.iopub_socket, "error", error, parent, ident=topic)
    reply = {
        "status": "error",
        "execution_count": kernel.execution_count,
        "user_expressions": {},
        "payload": [],
        **error,
    }
    kernel.session.send(stream, "execute_reply", reply, parent, ident=ident)
    kernel.log.warning("an interrupt outside the cell's code: replied with KeyboardInterrupt")
    if not silent and content.get("stop_on_error", True):
        kernel._abort_queues()


def install() -> None:
    """Patch ipykernel before the kernel object exists (its handlers are bound at creation)."""
    global _installed
    if _installed:
        return
    _installed = True
    inner: Callable[..., Any] = kernelbase.Kernel.execute_request  # unannotated upstream
    original_send: Callable[..., Any] = Session.send

    def send(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _replied_to
        msg = original_send(self, *args, **kwargs)
        if isinstance(msg, dict) and msg.get("msg_type") == "execute_reply":
            _replied_to = _msg_id({"header": msg.get("parent_header")})
        return msg

    async def execute_request(self: Any, stream: Any, ident: Any, parent: Any) -> Any:
        try:
            result = inner(self, stream, ident, parent)
            if inspect.isawaitable(result):
                result = await result
            return result
        except KeyboardInterrupt:
            _answer(self, stream, ident, parent)
            return None

    Session.send = send  # type: ignore[method-assign]
    kernelbase.Kernel.execute_request = execute_request  # type: ignore[method-assign]
