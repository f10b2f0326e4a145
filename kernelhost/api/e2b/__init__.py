"""E2B's APIs, so that programs written against E2B's SDKs run on kernelhost unmodified:

    E2B_API_URL=$KERNELHOST_URL/e2b
    E2B_SANDBOX_URL=$KERNELHOST_URL/e2b/sandbox
    E2B_API_KEY=$KERNELHOST_API_KEY

``lifecycle.py`` is the lifecycle API and ``snapshots.py`` its snapshots; under
``/e2b/sandbox`` (every in-sandbox call, told apart by E2B's ``E2b-Sandbox-Id`` header)
``interpreter.py`` is the code interpreter, ``files.py`` (with ``entries.py``), ``watch.py``,
``watchers.py`` and ``process.py`` are envd. Each
translates to the sandbox manager's public API and holds no sandbox state. docs/e2b.md says
what maps to what.
"""

from __future__ import annotations

from aiohttp import web

from . import files, interpreter, lifecycle, process, signed, watch, watchers
from .common import (
    PREFIX,
    SANDBOX_PREFIX,
    identify,
    identify_forwarded,
    is_rpc,
    lifecycle_error,
    read_bodies_in_time,
    sandbox_error,
)
from .signed import SIGNED_PATH, identify_signed

__all__ = [
    "PREFIX",
    "SANDBOX_PREFIX",
    "SIGNED_PATH",
    "identify",
    "identify_forwarded",
    "identify_signed",
    "read_bodies_in_time",
    "setup_e2b",
]


async def _no_route(request: web.Request) -> web.Response:
    what = f"{request.method} {request.path[len(PREFIX) :]}"
    if request.path.startswith(SANDBOX_PREFIX + "/"):
        code = "unimplemented" if is_rpc(request) else "not_found"
        return sandbox_error(
            request, 501 if is_rpc(request) else 404, code, f"{what} is not supported by kernelhost"
        )
    return lifecycle_error(404, f"{what} is not part of kernelhost's E2B surface (docs/e2b.md)")


def setup_e2b(app: web.Application) -> None:
    lifecycle.add_routes(app, PREFIX)
    interpreter.add_routes(app, SANDBOX_PREFIX)
    watch.add_routes(app, SANDBOX_PREFIX)  # before the filesystem service's other methods
    watchers.add_routes(app, SANDBOX_PREFIX)
    files.add_routes(app, SANDBOX_PREFIX)
    process.add_routes(app, SANDBOX_PREFIX)
    signed.add_routes(app)  # /files at the root: E2B's signed URLs
    app.router.add_route("*", PREFIX + "/{tail:.*}", _no_route)
