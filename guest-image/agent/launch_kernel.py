"""Start ipykernel inside the guest (the kernelspec's argv runs this file)."""

# debugpy (ipykernel's debugger) costs about a second of start-up under TCG; a template
# snapshot's kernel pays it once, before the freeze, and its clones not at all.
import inspect
from typing import Any

import kernel_limits  # per-execution output cap; see kernel_limits.py
from ipykernel import kernelapp
from ipykernel.ipkernel import IPythonKernel

_do_history: Any = IPythonKernel.do_history


def _numbered(kernel: Any, reply: Any) -> Any:
    """IPython numbers the current session 0 in a history range; the protocol's entries carry
    the session's number, as a tail or a search gives it (jupyter_kernel_test checks it)."""
    if isinstance(reply, dict) and isinstance(reply.get("history"), list):
        number = kernel.shell.history_manager.session_number
        reply["history"] = [
            (number, *entry[1:]) if entry and entry[0] == 0 else entry for entry in reply["history"]
        ]
    return reply


def do_history(self: Any, *args: Any, **kwargs: Any) -> Any:
    reply = _do_history(self, *args, **kwargs)
    if inspect.isawaitable(reply):

        async def numbered() -> Any:
            return _numbered(self, await reply)

        return numbered()
    return _numbered(self, reply)


IPythonKernel.do_history = do_history  # type: ignore[method-assign]

kernel_limits.install()
kernelapp.launch_new_instance()
