"""The aiohttp application: factory, typed keys, resources in ``cleanup_ctx``, middlewares."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from hypervisor import Hypervisor, ImageNotFound, ImageStore, LibvirtUnavailable, choose_accel

from ..config import Settings
from ..metrics import StateCollector
from ..sandboxes import BackendUnavailable, SandboxManager, Store
from .auth import KeyRing
from .console import PATHS as CONSOLE_PATHS
from .console import setup_console
from .errors import Handler, error_middleware, error_response
from .gateway import setup_gateway
from .mcp_http import setup_mcp
from .openapi import setup_openapi
from .pip_index import serving as serving_pip_index
from .routes import routes
from .state import KEY_ID, KEYS, RUNTIME, SETTINGS, Runtime

log = structlog.get_logger("kernelhost.api")


PUBLIC_PATHS = frozenset({"/healthz", "/metrics", "/openapi.json"}) | CONSOLE_PATHS


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    structlog.contextvars.clear_contextvars()
    sandbox_id = request.match_info.get("sandbox_id")
    if sandbox_id:
        structlog.contextvars.bind_contextvars(sandbox_id=sandbox_id)
    if request.path in PUBLIC_PATHS:
        return await handler(request)
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() not in ("bearer", "token") or not presented.strip():
        return error_response(
            401,
            "unauthorized",
            "missing API key: send 'Authorization: Bearer <key>' (the key is printed by "
            "'kernelhost serve' at first start, or set in KERNELHOST_API_KEYS)",
        )
    kid = request.app[KEYS].identify(presented.strip())
    if kid is None:
        return error_response(
            401, "unauthorized", "invalid API key; check KERNELHOST_API_KEY on the client side"
        )
    request[KEY_ID] = kid
    structlog.contextvars.bind_contextvars(key_id=kid)
    return await handler(request)


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    # records, keys and hibernated guests: nobody else's to read (QEMU gets its files by fd)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    settings.state_dir.chmod(0o700)
    store = Store(settings.db_path)
    hv = Hypervisor(settings.libvirt_uri, settings.domain_prefix, settings.run_dir)
    images = ImageStore(settings.image_dir)
    try:
        await asyncio.to_thread(hv.versions)
    except LibvirtUnavailable as exc:
        store.close()
        raise BackendUnavailable(str(exc)) from exc
    templates = images.templates()
    if templates:
        try:
            accel, reason = await asyncio.to_thread(
                choose_accel, hv, images.get(templates[0]), settings.accel, settings.state_dir / "accel.json"
            )
        except ImageNotFound:
            accel, reason = "tcg", "no image to probe with"
    else:
        accel, reason = ("kvm" if settings.accel == "kvm" else "tcg"), "no guest image built yet"
        log.warning("images.none", image_dir=str(settings.image_dir), fix="run 'make image'")
    log.info("accel.chosen", accel=accel, reason=reason)
    manager = SandboxManager(settings, hv, images, store, accel)
    try:
        async with contextlib.AsyncExitStack() as stack:
            roots = manager.host_network.file_roots
            if roots:  # the host's file:// package indexes, for sandboxes with a network
                manager.host_network.index_endpoint = await stack.enter_async_context(
                    serving_pip_index(roots)
                )
            await manager.start()
            manager.metrics.registry.register(StateCollector(manager))
            app[RUNTIME] = Runtime(settings, app[KEYS], store, hv, manager, accel, reason, time.time())
            log.info("service.ready", url=settings.url, sandboxes=len(manager.all()), templates=templates)
            yield
    finally:
        await manager.close()
        hv.close()
        store.close()


def init_app(settings: Settings, keys: KeyRing | None = None) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware, auth_middleware], client_max_size=settings.max_code_bytes + 1024 * 1024
    )
    app[SETTINGS] = settings
    app[KEYS] = keys or KeyRing.from_settings(settings)
    app.cleanup_ctx.append(_resources)
    app.add_routes(routes)
    setup_openapi(app)
    setup_mcp(app, settings)  # /mcp: the MCP server over streamable HTTP
    setup_gateway(app)  # /api/kernels, /api/kernelspecs: the Kernel Gateway API (Jupyter)
    setup_console(app)  # /: the web console
    return app
