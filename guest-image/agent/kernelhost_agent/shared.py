"""What the agent shares with the host (``codec``, ``protocol``), and the agent's log.

The frame codec and the protocol constants are one source for both ends. On the host (unit
tests, mypy) they are ``kernelhost.channel.codec`` and ``kernelhost.channel.protocol``; in the
guest there is no ``kernelhost`` package, and the image build copies both files verbatim next to
this package (``/opt/kernelhost``), where they are the top-level modules ``codec`` and
``protocol``.
"""

from __future__ import annotations

import sys
import traceback

try:
    from kernelhost.channel import codec, protocol
except ModuleNotFoundError as exc:  # the guest: no kernelhost package, the copies instead
    if exc.name is None or exc.name.split(".")[0] != "kernelhost":
        raise  # kernelhost is there but broken: say so rather than hide it behind the copies
    import codec  # type: ignore[no-redef]
    import protocol  # type: ignore[no-redef]

__all__ = ["codec", "log", "log_exception", "log_failure", "protocol"]


def log(*parts: object) -> None:
    """One line on the agent's stderr (the guest's serial console, a file on the host)."""
    print("kernelhost-agent:", *parts, file=sys.stderr, flush=True)


def log_exception(context: str) -> None:
    """Log ``context`` and the traceback of the exception being handled."""
    log(f"{context}\n{traceback.format_exc().rstrip()}")


def log_failure(context: str, exc: BaseException) -> None:
    """Log ``context`` and the traceback of ``exc`` (one not being handled right now)."""
    log(f"{context}\n{''.join(traceback.format_exception(exc)).rstrip()}")
