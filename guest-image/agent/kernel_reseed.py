"""``kernelhost_reseed_request`` on the kernel's control channel: fresh random streams after a
clone, a fork or a restore (``launch_kernel.py`` installs it; the agent sends it in ``resumed``).

The same work as the reseed cell (``random.seed()``, and numpy's global RNG when numpy is
imported) without a cell: no input transformers, parse, compile or displayhook, and none of
the user's IPython hooks (``pre_execute``, ``post_execute``: matplotlib's figure flush) run for
it. A kernel restart, whose standby is reseeded before the user's next cell, answers about
0.1 s sooner under emulation; a fork's call returns 0.1 s sooner too, though its child's first
cell then translates the execute path the cell had translated.

The reply's content: ``{"status": "ok"}``, or ``{"status": "error", "ename", "evalue"}``.
"""

from __future__ import annotations

import random
import sys
from typing import Any

from ipykernel.ipkernel import IPythonKernel

MSG_TYPE = "kernelhost_reseed_request"
REPLY_TYPE = "kernelhost_reseed_reply"


def reseed() -> None:
    """New seeds, from the (freshly reseeded) kernel RNG, for the streams a user draws from."""
    random.seed()
    numpy = sys.modules.get("numpy")
    numpy_random = getattr(numpy, "random", None)
    if numpy_random is not None:
        numpy_random.seed()


def _handle(kernel: Any, stream: Any, ident: Any, parent: Any) -> None:
    try:
        reseed()
        content: dict[str, Any] = {"status": "ok"}
    except Exception as exc:  # a user's numpy stand-in: the agent sees the error, not a hang
        content = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
    kernel.session.send(stream, REPLY_TYPE, content, parent, ident)


def install() -> None:
    """Make ``MSG_TYPE`` a control message of every IPythonKernel made from now on."""
    if MSG_TYPE in IPythonKernel.control_msg_types:
        return
    IPythonKernel.control_msg_types = [*IPythonKernel.control_msg_types, MSG_TYPE]
    setattr(IPythonKernel, MSG_TYPE, _handle)
