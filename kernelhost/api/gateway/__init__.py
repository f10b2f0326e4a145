"""The Kernel Gateway API: JupyterLab and other Jupyter tools run their kernels in sandboxes.

``jupyter lab --gateway-url=http://127.0.0.1:8999 --GatewayClient.auth_token=$KERNELHOST_API_KEY``
sends its kernel and kernelspec calls here:

- ``GET /api/kernelspecs[/{name}]``: one kernelspec per template; ``GET /kernelspecs/{name}/{file}``
  its logos (``kernelspecs.py``);
- ``GET/POST /api/kernels``, ``GET/DELETE /api/kernels/{id}``, ``POST .../interrupt|restart``,
  and the WebSocket ``/api/kernels/{id}/channels`` (``kernels.py``);
- the WebSocket's framing, queues and close codes (``connection.py``).

A kernel *is* a sandbox: same owner (other keys get 404), limits and lifecycle. What is attached
to a sandbox's kernel, the routing of replies and the execution lock belong to the sandbox layer
(``kernelhost.sandboxes.session``); this package holds none of it.
"""

from __future__ import annotations

import contextlib

from aiohttp import web

from ..state import RUNTIME
from .connection import Connection
from .kernels import MARK_KEY, MARK_VALUE, iso, kernel_id, kernel_model
from .kernels import routes as kernel_routes
from .kernelspecs import routes as kernelspec_routes

__all__ = ["MARK_KEY", "MARK_VALUE", "iso", "kernel_id", "kernel_model", "setup_gateway"]


async def _close_all(app: web.Application) -> None:
    """On shutdown: give back the execution locks held for clients, close every WebSocket."""
    runtime = app.get(RUNTIME)
    if runtime is None:
        return
    for client in runtime.manager.sessions.close_all():
        if isinstance(client, Connection):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await client.ws.close(code=1001, message=b"kernelhost is shutting down")


def setup_gateway(app: web.Application) -> None:
    """Add the Kernel Gateway routes to ``app``."""
    app.on_shutdown.append(_close_all)
    app.add_routes(kernelspec_routes)
    app.add_routes(kernel_routes)
