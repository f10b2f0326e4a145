"""E2B's signed file URLs (``sandbox.download_url(path)``, ``sandbox.upload_url(path)``): a
``GET`` or ``POST`` of ``/files?path=...&signature=v1_...[&signature_expiration=...]`` that
carries no credential but its signature, for a browser or ``curl`` to fetch or upload one file.

The SDKs build the URL on ``E2B_SANDBOX_URL`` with an absolute ``/files``, so it lands on the
service's root and names no sandbox: the sandbox is the one whose access token made the
signature. E2B's signature is ``v1_`` and the unpadded base64 of
``sha256("{path}:{read|write}:{username}:{token}[:{expiration}]")``; the service derives each
of its sandboxes' tokens again (``sandboxes/access.py``) and compares, in constant time. A
signature binds the path, the operation, the user and the expiry, and only its own
sandbox's token makes it: no URL reaches another sandbox, or another file. An expired URL is
refused before any sandbox is looked at; failed checks are rate limited (each tries every
token of the node).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import structlog
from aiohttp import web

from ...ratelimit import TokenBucket
from ...sandboxes import SandboxState
from ..state import KEYS
from .common import bind, not_running, runtime
from .files import download, upload

log = structlog.get_logger("kernelhost.api.e2b")

SIGNED_PATH = "/files"
FAILURES: web.AppKey[TokenBucket] = web.AppKey("e2b_signed_failures", TokenBucket)
FAILURE_RATE, FAILURE_BURST = 5.0, 50.0  # failed signature checks per second, in a burst
OPERATIONS = {"GET": "read", "POST": "write"}


def signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """E2B's v1 signature of a file URL (the SDKs' ``get_signature``)."""
    raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def _refused(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


def identify_signed(request: web.Request) -> web.Response | None:
    """Bind the sandbox a signed URL's signature names (as ``identify`` does for a token), or
    the error response to send."""
    query = request.query
    presented, operation = query.get("signature", ""), OPERATIONS.get(request.method)
    if operation is None or not presented.startswith("v1_") or len(presented) > 64:
        return _refused(
            401,
            "this URL carries no valid signature: use the SDK's download_url()/upload_url() "
            "(or send the sandbox's headers to /e2b/sandbox/files)",
        )
    expiration = None
    if "signature_expiration" in query:
        try:
            expiration = int(query["signature_expiration"])
        except ValueError:
            return _refused(400, "signature_expiration must be a Unix time in seconds")
        if expiration < time.time():
            return _refused(401, f"this signed URL expired at {expiration} (Unix time): ask for a new one")
    failures = request.app[FAILURES]
    if not failures.has():
        return _refused(429, "too many signed URLs failed their check just now; try again in a second")
    path, user = query.get("path", ""), query.get("username", "")

    def matches(token: str) -> bool:
        return hmac.compare_digest(signature(path, operation, user, token, expiration), presented)

    sbx = runtime(request).manager.find_by_token(matches)
    if sbx is None or sbx.record.owner not in request.app[KEYS].digests:
        failures.take()
        log.info("e2b.signed_url_refused", operation=operation)
        return _refused(401, "the signature does not match: the URL was changed, or its sandbox is gone")
    if sbx.record.state == SandboxState.HIBERNATED and not sbx.record.wake_on_call:
        return not_running(request, sbx.id)
    bind(request, sbx)
    return None


def add_routes(app: web.Application) -> None:
    app[FAILURES] = TokenBucket(FAILURE_RATE, FAILURE_BURST)
    app.router.add_get(SIGNED_PATH, download)
    app.router.add_post(SIGNED_PATH, upload)
