"""Issue 35, finding 12: the receiving end of node-to-node calls over real HTTP (``peers.py`` in
the service's auth middleware): a create's body is bound by its digest, a streamed one by its
length, the owner must be a key the node has, and a call for the cluster itself reaches only
the cluster routes. No VM, no cluster (tests/cluster/test_between_nodes.py has those)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kernelhost.api.auth import KeyRing, key_id
from kernelhost.api.cluster.peers import OPERATOR, setup_peers
from kernelhost.api.cluster.signing import body_binding, sign
from kernelhost.api.middleware import auth_middleware
from kernelhost.api.state import KEY_ID, KEYS, SETTINGS
from kernelhost.config import Settings

pytestmark = pytest.mark.unit

SECRET = secrets.token_hex(32)
KEY = "peer-auth-key-" + secrets.token_hex(8)
Client = TestClient[web.Request, web.Application]


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(
        {"owner": request[KEY_ID], "operator": bool(request.get(OPERATOR)), "body": body.decode()}
    )


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[Client]:
    settings = Settings(state_dir=tmp_path, node_id="node-b", cluster_secret=SECRET, api_keys=(KEY,))
    app = web.Application(middlewares=[auth_middleware])
    app[SETTINGS] = settings
    app[KEYS] = KeyRing.from_settings(settings)
    setup_peers(app)
    app.router.add_post("/v1/echo", _echo)
    app.router.add_post("/v1/cluster/echo", _echo)
    async with TestClient(TestServer(app)) as c:
        yield c


def _headers(path: str, body: str, owner: str | None = None) -> dict[str, str]:
    return sign(
        SECRET,
        "POST",
        path,
        owner=key_id(KEY) if owner is None else owner,
        from_node="node-a",
        to_node="node-b",
        body=body,
    )


async def test_a_signed_create_body_passes_and_an_altered_one_is_refused(client: Client) -> None:
    body = b'{"template": "python"}'
    digest = body_binding(body, streamed=False, length=len(body))
    r = await client.post("/v1/echo", data=body, headers=_headers("/v1/echo", digest))
    assert r.status == 200, await r.text()
    assert await r.json() == {"owner": key_id(KEY), "operator": False, "body": body.decode()}
    r = await client.post("/v1/echo", data=b'{"template": "pythoX"}', headers=_headers("/v1/echo", digest))
    assert r.status == 401 and "the body was altered" in await r.text()


async def test_a_streamed_body_is_bound_by_its_length(client: Client) -> None:
    r = await client.post("/v1/echo", data=b"12345", headers=_headers("/v1/echo", "stream:5"))
    assert r.status == 200, await r.text()
    r = await client.post("/v1/echo", data=b"123456", headers=_headers("/v1/echo", "stream:5"))
    assert r.status == 401 and "length was altered" in await r.text()
    r = await client.post("/v1/echo", data=b"x", headers=_headers("/v1/echo", "none"))
    assert r.status == 401 and "says none" in await r.text()


async def test_who_a_peer_call_may_act_for(client: Client) -> None:
    unknown = "key_" + hashlib.sha256(b"nobody").hexdigest()[:12]
    r = await client.post("/v1/echo", headers=_headers("/v1/echo", "none", owner=unknown))
    assert r.status == 401 and "a key this node does not have" in await r.text()
    r = await client.post("/v1/echo", headers=_headers("/v1/echo", "none", owner=""))
    assert r.status == 401 and "only /v1/cluster/ routes" in await r.text()
    r = await client.post("/v1/cluster/echo", headers=_headers("/v1/cluster/echo", "none", owner=""))
    assert r.status == 200 and (await r.json())["operator"] is True
    r = await client.post("/v1/cluster/echo", headers=_headers("/v1/cluster/echo", "none"))
    assert r.status == 200 and (await r.json())["operator"] is False, "a key's call is no operator's"


async def test_the_old_secret_header_is_no_credential(client: Client) -> None:
    r = await client.post(
        "/v1/echo", headers={"X-Kernelhost-Cluster-Secret": SECRET, "X-Kernelhost-Owner": ""}
    )
    assert r.status == 401 and "missing API key" in await r.text()
