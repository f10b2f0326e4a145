"""What every part of the E2B surface shares: who is calling, which sandbox a call is for, and
errors in the two shapes E2B's SDKs parse.

- Lifecycle calls (``/e2b/...``) carry the API key as ``X-API-KEY`` (E2B's header; a
  ``Bearer`` key works too). Their errors are ``{"code": <int status>, "message": str}``.
- In-sandbox calls (``/e2b/sandbox/...``: envd and the code interpreter) name the sandbox in
  ``E2b-Sandbox-Id`` and carry the sandbox's access token, ``X-Access-Token``: an HMAC of the
  sandbox id under the owner key's digest, returned at create and connect as
  ``envdAccessToken``. It is recomputed, never stored, and is worthless for any other sandbox.
  The code interpreter's context calls carry no token in E2B's SDKs; they are answered from the
  sandbox id alone and can only list or restart that sandbox's kernel.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import structlog
from aiohttp import web

from ...sandboxes import Sandbox, SandboxError, SandboxNotFound
from ..errors import status_for
from ..state import KEY_ID, KEYS, RUNTIME, Runtime

log = structlog.get_logger("kernelhost.api.e2b")

PREFIX = "/e2b"
SANDBOX_PREFIX = "/e2b/sandbox"
#: the envd version the SDKs are told: every feature gate of theirs that we serve is open
ENVD_VERSION = "0.6.4"
ENVD_PORT, INTERPRETER_PORT = "49983", "49999"
#: E2B's default templates (the code interpreter's and the bare SDK's) are our python built-in
TEMPLATE_ALIASES = {"code-interpreter-v1": "python", "code-interpreter": "python", "base": "python"}
MAX_PAGE = 1000  # items in one page of a list

#: the sandbox ``identify`` found for an in-sandbox call (its views read it, never look it up again)
SANDBOX: Any = web.RequestKey("e2b_sandbox", Sandbox) if hasattr(web, "RequestKey") else "e2b_sandbox"

View = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


class E2BError(Exception):
    """A lifecycle error as E2B's API words it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: web.Request) -> dict[str, Any]:
    """A lifecycle call's JSON object body ({} for none)."""
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise E2BError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise E2BError(400, "the request body must be a JSON object")
    return body


def paginate(request: web.Request, items: list[T], default: int) -> tuple[list[T], dict[str, str]]:
    """One page of ``items`` as E2B's lists give it: ``limit`` and ``nextToken`` in the query,
    the next page's token in ``x-next-token`` (absent on the last page)."""
    try:
        limit = int(request.query.get("limit", default))
        start = int(request.query.get("nextToken") or 0)
    except ValueError:
        raise E2BError(
            400, "limit and nextToken must be whole numbers (nextToken: from x-next-token)"
        ) from None
    if not 1 <= limit <= MAX_PAGE or start < 0:
        raise E2BError(400, f"limit must be 1 to {MAX_PAGE}")
    headers = {"x-next-token": str(start + limit)} if start + limit < len(items) else {}
    return items[start : start + limit], headers


def lifecycle_error(status: int, message: str) -> web.Response:
    # Should-Retry: false, or the SDK retries 429/502/503/504 on its own, with back-off
    return web.json_response(
        {"code": status, "message": message}, status=status, headers={"Should-Retry": "false"}
    )


def lifecycle_view(view: View) -> View:
    """A lifecycle view whose errors are E2B's ``{code, message}``."""

    @functools.wraps(view)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await view(request)
        except E2BError as exc:
            return lifecycle_error(exc.status, exc.message)
        except SandboxError as exc:
            return lifecycle_error(status_for(exc), exc.message)

    return wrapped


def runtime(request: web.Request) -> Runtime:
    return request.app[RUNTIME]


def access_token(request: web.Request, owner: str, sandbox_id: str) -> str:
    digest = request.app[KEYS].digests.get(owner, "")
    mac = hmac.new(digest.encode(), f"e2b-envd:{sandbox_id}".encode(), hashlib.sha256)
    return "kh_" + mac.hexdigest()[:40]


def api_key_id(request: web.Request) -> str | None:
    """The caller's key id from ``X-API-KEY`` (or ``Authorization: Bearer``), or None."""
    presented = request.headers.get("X-API-KEY", "").strip()
    if not presented:
        scheme, _, rest = request.headers.get("Authorization", "").partition(" ")
        presented = rest.strip() if scheme.lower() == "bearer" else ""
    return request.app[KEYS].identify(presented) if presented else None


def _token_ok(request: web.Request, owner: str, sandbox_id: str) -> bool:
    presented = request.headers.get("X-Access-Token", "")
    return hmac.compare_digest(presented.encode(), access_token(request, owner, sandbox_id).encode())


def _wrong_token(sandbox_id: str) -> str:
    return (
        f"the X-Access-Token of sandbox {sandbox_id} is missing or wrong: use the "
        "envdAccessToken create or connect returned"
    )


def _check_sandbox(request: web.Request, *, token: bool, owner: str | None = None) -> Sandbox:
    """The sandbox an in-sandbox call names, checked against its access token (``token=False``:
    the id alone, for the calls E2B's SDKs send without one; ``owner``: a call another node
    forwarded, which checked the token and signed the owner it acts for)."""
    sandbox_id = request.headers.get("E2b-Sandbox-Id", "")
    sbx = runtime(request).manager.find(sandbox_id) if sandbox_id else None
    if sbx is None or (owner is not None and sbx.record.owner != owner):
        raise SandboxNotFound(
            f"no sandbox {sandbox_id!r}: send E2b-Sandbox-Id with an id create returned"
            if sandbox_id
            else "no E2b-Sandbox-Id header: set E2B_SANDBOX_URL to this service's /e2b/sandbox"
        )
    if token and not _token_ok(request, sbx.record.owner, sbx.id):
        raise Unauthorized(_wrong_token(sbx.id))
    request[KEY_ID] = sbx.record.owner
    request[SANDBOX] = sbx
    structlog.contextvars.bind_contextvars(sandbox_id=sbx.id, key_id=sbx.record.owner)
    return sbx


def sandbox_of(request: web.Request) -> Sandbox:
    """The sandbox of an in-sandbox call, as ``identify`` found and checked it."""
    sbx: Sandbox | None = request.get(SANDBOX)
    if sbx is None:
        raise SandboxNotFound("no E2b-Sandbox-Id header: set E2B_SANDBOX_URL to this service's /e2b/sandbox")
    return sbx


class Unauthorized(Exception):
    """An in-sandbox call without the sandbox's token."""


def identify(request: web.Request) -> web.Response | None:
    """Who an ``/e2b`` request is (``request[KEY_ID]`` set), or the error response to send."""
    if not request.path.startswith(SANDBOX_PREFIX + "/"):
        kid = api_key_id(request)
        if kid is None:
            return lifecycle_error(401, "missing or invalid API key: set E2B_API_KEY to a kernelhost API key")
        request[KEY_ID] = kid
        structlog.contextvars.bind_contextvars(key_id=kid)
        return None
    return _identify_sandbox(request)


def _needs_token(request: web.Request) -> bool | None:
    """Whether an in-sandbox call needs the sandbox's token (None: it names no sandbox)."""
    tail = request.path[len(SANDBOX_PREFIX) :]
    return None if tail == "/health" else not tail.startswith("/contexts")


def _identify_sandbox(request: web.Request, owner: str | None = None) -> web.Response | None:
    token = _needs_token(request)
    if token is None:
        return None
    try:
        _check_sandbox(request, token=token and owner is None, owner=owner)
    except SandboxNotFound as exc:
        return sandbox_error(request, 404, "not_found", exc.message)
    except Unauthorized as exc:
        return sandbox_error(request, 401, "unauthenticated", str(exc))
    return None


def identify_forwarded(request: web.Request, owner: str) -> web.Response | None:
    """An in-sandbox call another node forwarded, acting for ``owner`` (signed): its sandbox
    must be that key's; the token was checked where the call came in."""
    if not request.path.startswith(SANDBOX_PREFIX + "/"):
        return None
    return _identify_sandbox(request, owner)


def token_refusal(request: web.Request, owner: str, sandbox_id: str) -> web.Response | None:
    """Before an in-sandbox call goes to the node of its sandbox: its token, checked here (the
    call is passed on without it), or the error to answer."""
    if _needs_token(request) and not _token_ok(request, owner, sandbox_id):
        return sandbox_error(request, 401, "unauthenticated", _wrong_token(sandbox_id))
    return None


def is_rpc(request: web.Request) -> bool:
    """A Connect call (``/e2b/sandbox/<package.Service>/<Method>``), not envd's HTTP."""
    first = request.path[len(SANDBOX_PREFIX) + 1 :].split("/", 1)[0]
    return "." in first


def sandbox_error(request: web.Request, status: int, code: str, message: str) -> web.Response:
    """An in-sandbox error: Connect's ``{code, message}`` for RPCs, envd's for its HTTP."""
    if is_rpc(request):
        return web.json_response({"code": code, "message": message}, status=status)
    return web.json_response({"code": status, "message": message}, status=status)


async def with_keepalives(items: AsyncIterator[T], interval: float) -> AsyncGenerator[T | None, None]:
    """``items`` as they come, and None after each ``interval`` seconds without one (a stream's
    cue to send a keepalive); the item being waited for is not lost to the pause."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
