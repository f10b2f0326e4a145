"""Calls between the nodes of a cluster, as HTTP: the receiving end checks each one
(``signing.Verifier``) and takes the owner it acts for; the sending end signs each one. The
cluster secret never travels, and no client's credential is passed on (``forward.py`` drops
them): the peer acts for the signed owner, whose key the first node checked.

A signed call acts for a key id that this node knows too (every node has the same keys), or, with
the owner '', for the cluster itself: ``kernelhost node drain``, on the cluster routes only.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import structlog
from aiohttp import web

from ..credentials import without_token
from ..errors import error_response
from ..state import KEY_ID, KEYS, SETTINGS
from .signing import BODY, FROM, OWNER, SIGNATURE, Refused, Verifier, sign

log = structlog.get_logger("kernelhost.cluster")

VERIFIER = web.AppKey("cluster_verifier", Verifier)
# request keys (typed where aiohttp has them, as KEY_ID): the call came from another node; it
# acts for the cluster itself (kernelhost node drain)
PEER: Any = web.RequestKey("cluster_peer", bool) if hasattr(web, "RequestKey") else "cluster_peer"
OPERATOR: Any = web.RequestKey("cluster_operator", bool) if hasattr(web, "RequestKey") else "cluster_operator"
CLUSTER_ROUTES = "/v1/cluster/"
Signer = Callable[[str], Mapping[str, str]]  # a body's binding -> the headers of the signed call


async def _verifier(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    app[VERIFIER] = Verifier(settings.cluster_secret, settings.node_id)
    yield


def setup_peers(app: web.Application) -> None:
    app.cleanup_ctx.append(_verifier)


def _refuse(request: web.Request, why: str) -> web.StreamResponse:
    log.warning(
        "cluster.peer_call_refused",
        reason=why,
        method=request.method,
        path=request.path[:200],
        peer=request.headers.get(FROM, "")[:64],
        remote=request.remote,
    )
    return error_response(401, "unauthorized", f"node-to-node call refused: {why}")


async def _check_body(request: web.Request) -> str:
    """Why the body does not match its signed binding ('' when it does)."""
    binding = request.headers[BODY]
    if binding == "none":
        return "" if not request.body_exists else "a body came where the signature says none"
    if binding.startswith("stream:"):
        length = request.content_length
        want = binding.removeprefix("stream:")
        return (
            ""
            if want == (str(length) if length is not None else "chunked")
            else "the body's length was altered"
        )
    if binding.startswith("sha256:"):
        body = await request.read()  # a create's small JSON: read here, kept for the handler
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        return "" if hmac.compare_digest(digest, binding) else "the body was altered"
    return "unknown body binding"


async def peer_auth(request: web.Request) -> web.StreamResponse | None:
    """For a call from another node: verify it and take the owner it acts for; the response
    that refuses it, or None (also when the call is no node's: the usual key check follows)."""
    if SIGNATURE not in request.headers:
        return None
    try:
        request.app[VERIFIER].verify(request.method, request.rel_url.raw_path_qs, request.headers)
    except Refused as exc:
        return _refuse(request, str(exc))
    why = await _check_body(request)
    if why:
        return _refuse(request, why)
    owner = request.headers.get(OWNER, "")
    if owner == "":
        if not request.path.startswith(CLUSTER_ROUTES):
            return _refuse(request, "a call for the cluster itself reaches only /v1/cluster/ routes")
        request[OPERATOR] = True
    elif owner not in request.app[KEYS].digests:
        return _refuse(request, "it acts for a key this node does not have (every node needs the same keys)")
    request[KEY_ID] = owner
    request[PEER] = True
    structlog.contextvars.bind_contextvars(key_id=owner, peer=request.headers.get(FROM, ""))
    return None


def signer(request: web.Request, owner: str, from_node: str, to_node: str, reservation: str = "") -> Signer:
    """What signs the call that forwards ``request`` to ``to_node``, once its body's binding is
    known."""
    secret = request.app[SETTINGS].cluster_secret
    path_qs = without_token(request.rel_url.raw_path_qs)  # as forward.py sends it

    def headers(body: str) -> Mapping[str, str]:
        return sign(
            secret,
            request.method,
            path_qs,
            owner=owner,
            from_node=from_node,
            to_node=to_node,
            body=body,
            reservation=reservation,
        )

    return headers
