"""What a command needs beyond the client: ``pip install kernelhost`` is the client alone
(the SDK and the commands that speak HTTP); the service's packages come with the ``server``
extra, the Jupyter provisioner's with ``jupyter``, the MCP server's with ``mcp``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

#: the top-level modules of each extra's packages (setup.cfg), for the hint
EXTRA_OF_MODULE = {
    "libvirt": "server",
    "msgpack": "server",
    "structlog": "server",
    "prometheus_client": "server",
    "zstandard": "server",
    "opentelemetry": "server",
    "psycopg": "postgres",
    "jupyter_client": "jupyter",
    "zmq": "jupyter",
    "traitlets": "jupyter",
    "mcp": "mcp",
}


def install_hint(exc: ImportError) -> str | None:
    """``pip install 'kernelhost[EXTRA]'`` when ``exc`` is a missing package of an extra."""
    extra = EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
    return f"pip install 'kernelhost[{extra}]'" if extra else None


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command; one whose extra is not installed says which to install (exit status 2)."""
    try:
        return int(func(args))
    except ModuleNotFoundError as exc:
        hint = install_hint(exc)
        if hint is None:
            raise
        print(f"kernelhost {args.command}: {exc.name} is not installed: {hint}", file=sys.stderr)
        return 2
