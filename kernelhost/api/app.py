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
from ..sandboxes import BackendUnavailable, SandboxManager
from ..sandboxes.store import open_store
from ..servicelock import ServiceLock
from .auth import KeyRing
from .cluster import cluster_middleware, setup_cluster
from .console import setup_console
from .e2b import read_bodies_in_time, setup_e2b
from .errors import error_middleware
from .gateway import setup_gateway
from .mcp_http import setup_mcp
from .middleware import add_security_headers, auth_middleware, request_limits, trace_middleware
from .pip_index import serving as serving_pip_index
from .ports import port_routing
from .state import KEYS, RUNTIME, SETTINGS, Runtime
from .v1.checkpoints import checkpoint_routes
from .v1.openapi import setup_openapi
from .v1.routes import routes
from .v1.templates import routes as template_routes
from .v1.usage import usage_routes

log = structlog.get_logger("kernelhost.api")


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    # records, keys and hibernated guests: nobody else's to read (QEMU gets its files by fd)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    settings.state_dir.chmod(0o700)
    lock = ServiceLock(settings.state_dir, settings.run_dir, settings.domain_prefix)
    lock.acquire()  # before any domain is touched: a second service must not reconcile ours
    try:
        async with _service(app, settings):
            yield
    finally:
        lock.release()


@contextlib.asynccontextmanager
async def _service(app: web.Application, settings: Settings) -> AsyncIterator[None]:
    # migrates the schema (under its lock), or refuses one that needs a newer kernelhost
    store = await asyncio.to_thread(open_store, settings)
    hv = Hypervisor(settings.libvirt_uri, settings.domain_prefix, settings.run_dir)
    images = ImageStore(settings.image_dir, settings.built_image_dir)
    try:
        await asyncio.to_thread(hv.versions)
    except LibvirtUnavailable as exc:
        store.close()
        raise BackendUnavailable(str(exc)) from exc
    templates = images.templates()
    if templates:
        try:
            accel, reason = await asyncio.to_thread(
                choose_accel, hv, images.get(templates[0]), settings.accel, settings.accel_cache_file
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
        middlewares=[
            port_routing(settings.domain),  # {port}-{sandbox id}.{domain}: a server in a sandbox
            trace_middleware,  # a span per call (off unless OTEL_TRACES_EXPORTER says)
            error_middleware,
            auth_middleware,
            request_limits(settings),
            cluster_middleware,
            read_bodies_in_time,  # /e2b: a body's deadline, after the credential check and count
        ],
        client_max_size=settings.max_code_bytes + 1024 * 1024,
    )
    app.on_response_prepare.append(add_security_headers)
    app[SETTINGS] = settings
    app[KEYS] = keys or KeyRing.from_settings(settings)
    app.cleanup_ctx.append(_resources)
    app.add_routes(routes)
    app.add_routes(checkpoint_routes)
    app.add_routes(template_routes)
    app.add_routes(usage_routes)
    setup_cluster(app)  # /v1/cluster: nodes, drain; forwarding to the node of a sandbox
    setup_openapi(app)
    setup_mcp(app, settings)  # /mcp: the MCP server over streamable HTTP
    setup_gateway(app)  # /api/kernels, /api/kernelspecs: the Kernel Gateway API (Jupyter)
    setup_e2b(app)  # /e2b: E2B's lifecycle, envd and code-interpreter APIs
    setup_console(app)  # /: the web console
    return app
