"""The request path before a view runs: its trace span, who is calling (API keys), how much one
key may have open at once, and the headers every response carries."""

from __future__ import annotations

from collections import Counter

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from .. import tracing
from ..config import Settings
from ..sandboxes import ADMITTED, MAX_WAIT, InvalidRequest
from . import cluster, credentials, e2b
from .cluster import peers
from .console import PATHS as CONSOLE_PATHS
from .errors import Handler, error_response
from .state import KEY_ID, KEYS, SETTINGS

log = structlog.get_logger("kernelhost.api")


PUBLIC_PATHS = frozenset({"/openapi.json"}) | CONSOLE_PATHS
#: tenant-wide counts, public unless the operator sets metrics_require_key
HEALTH_PATHS = frozenset({"/healthz", "/metrics"})


@web.middleware
async def trace_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One server span per call (docs/tracing.md), named by the route's canonical path
    (``POST /v1/sandboxes/{sandbox_id}/execute``), child of the caller's ``traceparent``; it
    ends when the answer has been sent, a streamed one included. Carries the key's id, never
    the key. A no-op with tracing off."""
    if not tracing.enabled():
        return await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else None
    name = f"{request.method} {route}" if route else request.method
    with tracing.server_span(
        name,
        request.headers,
        **{
            "http.request.method": request.method,
            "http.route": route,
            "url.path": request.path,
            "url.scheme": request.scheme,
            "user_agent.original": request.headers.get("User-Agent"),
        },
        sandbox_id=request.match_info.get("sandbox_id"),
    ) as span:
        try:
            response = await handler(request)
        finally:
            tracing.set_attributes(span, key_id=request.get(KEY_ID))
        tracing.set_attributes(span, **{"http.response.status_code": response.status})
        if response.status >= 500:
            tracing.mark_error(span, f"HTTP {response.status}")
        return response


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    structlog.contextvars.clear_contextvars()
    sandbox_id = request.match_info.get("sandbox_id")
    if sandbox_id:
        structlog.contextvars.bind_contextvars(sandbox_id=sandbox_id)
    refused = await peers.peer_auth(request)  # another node of the cluster, forwarding a call
    if refused is not None:
        return refused
    if request.get(peers.PEER):
        refused = e2b.identify_forwarded(request, request[KEY_ID])  # an in-sandbox call's sandbox
        return refused if refused is not None else await handler(request)
    if request.path in PUBLIC_PATHS or (
        request.path in HEALTH_PATHS and not request.app[SETTINGS].metrics_require_key
    ):
        return await handler(request)
    if request.path == e2b.SIGNED_PATH:  # E2B's signed file URLs: the signature is the credential
        refused = e2b.identify_signed(request)
        return refused if refused is not None else await handler(request)
    if request.path == e2b.PREFIX or request.path.startswith(e2b.PREFIX + "/"):
        if request.path.startswith(e2b.SANDBOX_PREFIX + "/"):  # a sandbox on another node?
            elsewhere = await cluster.forward_e2b_sandbox(request)
            if elsewhere is not None:
                return elsewhere
        refused = e2b.identify(request)  # E2B's headers, and its error shapes
        return refused if refused is not None else await handler(request)
    presented = credentials.presented_key(request)  # the header's, or a gateway route's ?token=
    if not presented:
        return error_response(
            401,
            "unauthorized",
            "missing API key: send 'Authorization: Bearer <key>' (the key is printed by "
            "'kernelhost serve' at first start, or set in KERNELHOST_API_KEYS)"
            + (
                "; the Kernel Gateway routes also take ?token=<key>"
                if credentials.takes_query_token(request.path)
                else ""
            ),
        )
    kid = request.app[KEYS].identify(presented)
    if kid is None:
        return error_response(
            401, "unauthorized", "invalid API key; check KERNELHOST_API_KEY on the client side"
        )
    request[KEY_ID] = kid
    structlog.contextvars.bind_contextvars(key_id=kid)
    return await handler(request)


def request_limits(settings: Settings) -> Middleware:
    """At most ``max_requests_per_key`` requests of one key open at once (an execute stream, a
    download or a WebSocket counts until it ends): one key cannot hold every connection and
    task of the service."""
    limit = settings.max_requests_per_key
    open_now: Counter[str] = Counter()

    @web.middleware
    async def limits(request: web.Request, handler: Handler) -> web.StreamResponse:
        kid = request.get(KEY_ID)
        if kid is None:  # a public path
            return await handler(request)
        if open_now[kid] >= limit:
            return error_response(
                429,
                "capacity_exceeded",
                f"this API key has {open_now[kid]} requests open, its limit (max_requests_per_key); "
                "wait for some to end, or raise the setting",
                limit="max_requests_per_key",
                value=limit,
            )
        open_now[kid] += 1
        try:
            MAX_WAIT.set(_queue_wait(request))
            response = await handler(request)
            admitted = ADMITTED.get()
            if admitted is not None and not response.prepared:  # it waited for room: say so
                response.headers[QUEUE_WAITED] = f"{admitted.waited:.3f}"
                response.headers[QUEUE_POSITION] = str(admitted.position)
            return response
        finally:
            open_now[kid] -= 1
            if not open_now[kid]:
                del open_now[kid]

    return limits


QUEUE_WAIT = "X-Kernelhost-Queue-Wait"  # request: the longest the caller waits for room
QUEUE_WAITED = "X-Kernelhost-Queue-Waited"  # answer: seconds it waited for room
QUEUE_POSITION = "X-Kernelhost-Queue-Position"  # answer: its place in the key's queue then


def _queue_wait(request: web.Request) -> float | None:
    """The caller's bound on waiting for room (docs/limits.md), if it sent one."""
    raw = request.headers.get(QUEUE_WAIT)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < 86400:
        raise InvalidRequest(
            f"{QUEUE_WAIT}: {raw!r:.40} is not a number of seconds; send 0 (no wait) or more",
            field=QUEUE_WAIT,
        )
    return value


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every response: the browser must not guess a content type (a file from a sandbox served
    as HTML would run in the service's origin)."""
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
