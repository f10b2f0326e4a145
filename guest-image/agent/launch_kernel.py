"""Start ipykernel inside the guest (the kernelspec's argv runs this file)."""

# debugpy (ipykernel's debugger) costs about a second of start-up under TCG; a template
# snapshot's kernel pays it once, before the freeze, and its clones not at all.
import functools
import inspect
import os
import sys
from typing import Any

# No parent poller: the agent is the kernel's parent for the VM's whole life, and the poller's
# thread wakes every second, in every idle sandbox (ipykernel reads this at import).
os.environ.pop("JPY_PARENT_PID", None)

import kernel_displays
import kernel_interrupt
import kernel_limits
import kernel_reseed
from ipykernel import ipkernel, kernelapp, kernelbase
from ipykernel.ipkernel import IPythonKernel

# The message parts in msgpack (kernel_wire.py): only the agent reads this kernel's sockets.
sys.argv += ["--Session.packer=kernel_wire.pack", "--Session.unpacker=kernel_wire.unpack"]

# ipykernel asks inspect.signature of the same two methods on every execute_request (about
# 9 ms each under emulation): once per function is enough.
_modules: list[Any] = [kernelbase, ipkernel]
_accepts: Any = getattr(kernelbase, "_accepts_cell_id", None)
if _accepts is not None:
    _cached = functools.lru_cache(maxsize=64)(lambda func: _accepts(func))

    def _accepts_cell_id(meth: Any) -> Any:
        func = getattr(meth, "__func__", None)
        return _accepts(meth) if func is None else _cached(func)

    for _module in _modules:
        if hasattr(_module, "_accepts_cell_id"):
            _module._accepts_cell_id = _accepts_cell_id

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
kernel_reseed.install()
kernel_displays.install()  # E2B's e2b/data and e2b/chart, PIL images shown
kernel_interrupt.install()  # outermost: it answers what escapes the rest
kernelapp.launch_new_instance()
