"""What every part of the E2B surface shares: who is calling, which sandbox a call is for, and
errors in the two shapes E2B's SDKs parse.

- Lifecycle calls (``/e2b/...``) carry the API key as ``X-API-KEY`` (E2B's header; a
  ``Bearer`` key works too). Their errors are ``{"code": <int status>, "message": str}``.
- In-sandbox calls (``/e2b/sandbox/...``: envd and the code interpreter) name the sandbox in
  ``E2b-Sandbox-Id`` and carry one of its access tokens (``sandboxes/access.py``: random,
  minted at create, fork and connect, kept only as hashes), returned as ``envdAccessToken``
  (sent back as ``X-Access-Token``) and as ``trafficAccessToken`` (sent back as
  ``E2B-Traffic-Access-Token``: E2B's SDKs send only that one with the code interpreter's
  context calls). Every in-sandbox call must carry one, and is checked before it is counted
  against the owner's key or run; ``/health`` answers 502 (E2B's proxy's "not found") for a
  call that does not, as for a sandbox that does not run.
- An unknown sandbox, a wrong or missing token, and a sandbox whose owner key is no longer
  configured get the same 404, byte for byte: the answer says nothing of which it was.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import posixpath
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import structlog
from aiohttp import web

from ...sandboxes import InvalidRequest, Sandbox, SandboxError, SandboxNotFound, SandboxRecord, SandboxState
from ..errors import Handler, status_for
from ..state import KEY_ID, KEYS, RUNTIME, SETTINGS, Runtime

log = structlog.get_logger("kernelhost.api.e2b")

PREFIX = "/e2b"
SANDBOX_PREFIX = "/e2b/sandbox"
HEALTH_PATH = SANDBOX_PREFIX + "/health"
#: the envd version the SDKs are told: every feature gate of theirs that we serve is open, and
#: those we do not serve stay shut, so the SDK itself refuses them naming the feature: file
#: metadata (0.6.2: "File metadata requires envd 0.6.2 or later"), a watch event's entry
#: (0.6.3) and watching network mounts (0.6.4)
ENVD_VERSION = "0.6.1"
ENVD_PORT, INTERPRETER_PORT = "49983", "49999"
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
    """A lifecycle call's JSON object body ({} for none). ``read_bodies_in_time`` has read it
    already (so ``can_read_body`` is false): this parses what it read."""
    raw = await request.read() if request.body_exists else b""
    if not raw:
        return {}
    try:
        body = json.loads(raw)
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


def our_template(request: web.Request, name: str) -> str:
    """The template of ours an E2B template name stands for (the ``e2b_templates`` setting:
    ``code-interpreter-v1`` is the data-science built-in, as E2B's has the data stack)."""
    return runtime(request).settings.e2b_template_map.get(name, name)


def access_token(request: web.Request, sbx: Sandbox) -> str:
    """A new access token of ``sbx`` for the caller (create, fork, connect); earlier ones stay."""
    return runtime(request).manager.mint_access_token(sbx)


def api_key_id(request: web.Request) -> str | None:
    """The caller's key id from ``X-API-KEY`` (or ``Authorization: Bearer``), or None."""
    presented = request.headers.get("X-API-KEY", "").strip()
    if not presented:
        scheme, _, rest = request.headers.get("Authorization", "").partition(" ")
        presented = rest.strip() if scheme.lower() == "bearer" else ""
    return request.app[KEYS].identify(presented) if presented else None


#: the accounts an envd call may name (E2B's SDKs: ``user=``); every kernelhost image has both
ENVD_USERS = ("user", "root")
#: the home of the sandbox's own account, ``user``: its code's cwd, and where relative paths go
HOME = "/home/user"


def envd_user(request: web.Request) -> str | None:
    """The user an envd call runs as: the SDK's ``user`` (``Authorization: Basic <user>:``, or
    ``?username=`` on ``/files``); None: the sandbox's own (``user``, E2B's default).
    ``InvalidRequest`` (naming the value and the users there are) for any other name."""
    name = request.query.get("username", "")
    scheme, _, rest = request.headers.get("Authorization", "").partition(" ")
    if not name and scheme.lower() == "basic":
        try:
            name = base64.b64decode(rest.strip(), validate=True).decode("utf-8").partition(":")[0]
        except (ValueError, UnicodeDecodeError):
            raise InvalidRequest(
                "the Authorization header is not Basic base64('<user>:')", field="username"
            ) from None
    if not name:
        return None
    if name not in ENVD_USERS:
        raise InvalidRequest(
            f"user {name!r:.40} does not exist in this sandbox; kernelhost's images have "
            f"{' and '.join(repr(u) for u in ENVD_USERS)} (the default)",
            field="username",
        )
    return name


def home_of(user: str | None) -> str:
    """The home directory of an envd call's user (None: the sandbox's own, ``user``)."""
    return "/root" if user == "root" else HOME


def envd_path(path: str, user: str | None) -> str:
    """A path as envd resolves it for ``user``: ``~`` is the user's home, and a relative path
    lies under it (``/root/...`` for root, as on E2B); an absolute path is taken as it is.
    ``InvalidRequest`` for ``~name`` (envd expands no other user's home either)."""
    home = home_of(user)
    if path == "~" or path.startswith("~/"):
        return home + path[1:]
    if path.startswith("~"):
        raise InvalidRequest(
            f"path {path!r:.100} names another user's home; use an absolute path or ~/...",
            field="path",
        )
    if path.startswith("/"):
        return path
    return posixpath.normpath(posixpath.join(home, path))


def message_path(request: web.Request, message: dict[str, Any], field: str = "path") -> str:
    """A path field of an envd message, resolved for the call's user (``envd_path``)."""
    value = message.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field} must be a non-empty path", field=field)
    return envd_path(value, envd_user(request))


#: the one answer to an in-sandbox call that does not prove it may use the sandbox it names
NO_SUCH_SANDBOX = (
    "no sandbox of this E2b-Sandbox-Id accepts this access token: send the sandboxID and the "
    "envdAccessToken (as X-Access-Token) that create or connect returned"
)
NO_SANDBOX_HEADER = "no E2b-Sandbox-Id header: set E2B_SANDBOX_URL to this service's /e2b/sandbox"
TOKEN_HEADERS = ("X-Access-Token", "E2B-Traffic-Access-Token")


def presented_token(request: web.Request) -> str:
    """The access token an in-sandbox call carries (envd's header, else the code interpreter's)."""
    for name in TOKEN_HEADERS:
        value = request.headers.get(name, "").strip()
        if value:
            return value
    return ""


def may_use(request: web.Request, rec: SandboxRecord | None) -> bool:
    """Whether the call proves it may use the sandbox of ``rec`` (None: unknown): one of the
    sandbox's tokens, and an owner key that is still configured."""
    valid = runtime(request).manager.access_token_valid(rec, presented_token(request))
    return valid and rec is not None and rec.owner in request.app[KEYS].digests


class _Refused(Exception):
    """An in-sandbox call that does not prove it may use the sandbox it names (the message is
    sent as it is)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Paused(Exception):
    """An in-sandbox call for a paused sandbox that does not wake on a call (E2B's proxy: 502)."""


def _check_sandbox(request: web.Request) -> Sandbox:
    """The sandbox an in-sandbox call names, if the call carries one of its access tokens."""
    sandbox_id = request.headers.get("E2b-Sandbox-Id", "")
    if not sandbox_id:
        raise _Refused(NO_SANDBOX_HEADER)
    sbx = runtime(request).manager.find(sandbox_id)
    # one check, the same work whether the sandbox exists or not
    if not may_use(request, sbx.record if sbx is not None else None) or sbx is None:
        raise _Refused(NO_SUCH_SANDBOX)
    if sbx.record.state == SandboxState.HIBERNATED and not sbx.record.wake_on_call:
        raise _Paused  # auto_resume off: it runs again only when connected to
    return bind(request, sbx)


def bind(request: web.Request, sbx: Sandbox) -> Sandbox:
    """The sandbox a checked in-sandbox call is for, bound to the request and its logs."""
    request[KEY_ID] = sbx.record.owner
    request[SANDBOX] = sbx
    structlog.contextvars.bind_contextvars(sandbox_id=sbx.id, key_id=sbx.record.owner)
    return sbx


def identify_forwarded(request: web.Request, owner: str) -> web.Response | None:
    """An in-sandbox call another node forwarded, acting for ``owner`` (signed): the node the
    client called checked its access token (``may_use``) and passed it on without it; the
    sandbox must be that key's, else the one 404."""
    if not request.path.startswith(SANDBOX_PREFIX + "/"):
        return None
    sandbox_id = request.headers.get("E2b-Sandbox-Id", "")
    sbx = runtime(request).manager.find(sandbox_id) if sandbox_id else None
    if sbx is None or sbx.record.owner != owner:
        return not_running(request) if request.path == HEALTH_PATH else not_found(request)
    bind(request, sbx)
    return None


def sandbox_of(request: web.Request) -> Sandbox:
    """The sandbox of an in-sandbox call, as ``identify`` found and checked it."""
    sbx: Sandbox | None = request.get(SANDBOX)
    if sbx is None:
        raise SandboxNotFound(NO_SANDBOX_HEADER)
    return sbx


def identify(request: web.Request) -> web.Response | None:
    """Who an ``/e2b`` request is (``request[KEY_ID]`` set), or the error response to send."""
    if not request.path.startswith(SANDBOX_PREFIX + "/"):
        kid = api_key_id(request)
        if kid is None:
            return lifecycle_error(401, "missing or invalid API key: set E2B_API_KEY to a kernelhost API key")
        request[KEY_ID] = kid
        structlog.contextvars.bind_contextvars(key_id=kid)
        return None
    try:
        _check_sandbox(request)
    except _Paused:
        return not_running(request)
    except _Refused as exc:
        if request.path == HEALTH_PATH:  # E2B's proxy: 502, the SDK's is_running() False
            return not_running(request)
        return not_found(request, exc.message)
    return None


class SandboxGone(Exception):
    """The sandbox of a streaming call was killed (or timed out) while the call ran."""


def check_not_gone(request: web.Request) -> None:
    """Raise ``SandboxGone`` if the call's sandbox is no longer the service's."""
    sbx: Sandbox | None = request.get(SANDBOX)
    if sbx is not None and runtime(request).manager.find(sbx.id) is not sbx:
        raise SandboxGone


def break_transport(request: web.Request) -> None:
    """Cut a streaming answer off without its end, as E2B's transport breaks when the sandbox
    is killed mid-call: the SDKs then ask ``/health`` (502) and raise their "the sandbox was
    killed" error, where a clean end would have read as the call's own result."""
    log.info("e2b.sandbox_gone_mid_call", path=request.path)
    if request.transport is not None:
        request.transport.abort()


def not_running(request: web.Request, sandbox_id: str | None = None) -> web.Response:
    """What E2B's proxy answers for a sandbox that does not run (killed, timed out, paused, or
    never there; here also a call without one of its tokens: the same bytes, whatever the
    reason): 502 with a message the SDKs read as "the sandbox was killed or reached its
    timeout" (``SandboxNotRunningException``, ``is_running()`` false)."""
    if sandbox_id is None:
        sandbox_id = request.headers.get("E2b-Sandbox-Id", "")[:64]
    return web.json_response(
        {"code": 502, "message": f"The sandbox {sandbox_id} was not found", "sandboxId": sandbox_id},
        status=502,
    )


def not_found(request: web.Request, message: str = NO_SUCH_SANDBOX) -> web.Response:
    return sandbox_error(request, 404, "not_found", message)


#: bodies read as they come (an upload), each chunk within ``body_timeout`` (files.py)
STREAMED_BODIES = frozenset({SANDBOX_PREFIX + "/files"})


@web.middleware
async def read_bodies_in_time(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An ``/e2b`` call's body, read whole within ``body_timeout`` seconds before its view runs
    (the views read it again from memory): a caller that sends a head and holds the body back
    cannot hold a view, and a place in its key's ``max_requests_per_key``, for ever. Runs after
    the credential check and the request count."""
    if (
        request.get(KEY_ID) is None
        or not request.body_exists
        or request.path in STREAMED_BODIES
        or not request.path.startswith(PREFIX + "/")
    ):
        return await handler(request)
    wait = request.app[SETTINGS].body_timeout
    try:
        async with asyncio.timeout(wait):
            await request.read()
    except TimeoutError:
        return body_too_slow(request, wait)
    return await handler(request)


def body_too_slow(request: web.Request, wait: float) -> web.Response:
    message = (
        f"the request body did not arrive within body_timeout={wait:g}s; send it at once, or "
        "raise the server's body_timeout"
    )
    if request.path.startswith(SANDBOX_PREFIX + "/"):
        return sandbox_error(request, 408, "deadline_exceeded", message)
    return lifecycle_error(408, message)


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
            # ``items`` is closed next (aclosing): only once this read of it has ended, or its
            # aclose() finds it still running
            await asyncio.wait({pending})
