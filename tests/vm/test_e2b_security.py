"""An attacker holding one API key (or none) against the E2B surface, through a real service and
real VMs (issue 35): forged and stale access tokens, credential-less in-sandbox calls, an
existence oracle, unbounded background processes, a directory listing without end, bodies held
back. Each test mounts the attack the review showed and checks the refusal, and that the
victim (the owner of the sandbox) is unaffected.

The service here runs with small limits so the attacks are cheap: 12 requests per key, 3
background processes per sandbox and 4 per key, 40 entries per listing, a 2 s body deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from kernelhost.api.e2b.common import NO_SUCH_SANDBOX

from ..harness import Service, running_service

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]

MAX_REQUESTS = 12
BODY_TIMEOUT = 2


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(
        tmp_path_factory.mktemp("e2b-security"),
        "vm-e2b-security",
        KERNELHOST_MAX_REQUESTS_PER_KEY=str(MAX_REQUESTS),
        KERNELHOST_MAX_PROCESSES_PER_SANDBOX="3",
        KERNELHOST_MAX_PROCESSES_PER_KEY="4",
        KERNELHOST_MAX_LIST_ENTRIES="40",
        KERNELHOST_BODY_TIMEOUT=str(BODY_TIMEOUT),
        KERNELHOST_POOL_SIZE="1",
    ) as service:
        yield service


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def _create(http: aiohttp.ClientSession, svc: Service, key: str) -> dict[str, Any]:
    r = await http.post(f"{svc.url}/e2b/v2/sandboxes", json={}, headers={"X-API-KEY": key})
    assert r.status == 201, await r.text()
    made: dict[str, Any] = await r.json()
    return made


async def _kill(http: aiohttp.ClientSession, svc: Service, made: dict[str, Any], key: str) -> None:
    await http.delete(f"{svc.url}/e2b/sandboxes/{made['sandboxID']}", headers={"X-API-KEY": key})


def _as(made: dict[str, Any], token: str | None = "", sandbox_id: str | None = None) -> dict[str, str]:
    """The headers of an in-sandbox call for ``made`` with ``token`` ("": its own; None: none)."""
    headers = {"E2b-Sandbox-Id": sandbox_id or made["sandboxID"]}
    if token is not None:
        headers["X-Access-Token"] = token or made["envdAccessToken"]
    return headers


async def _run(http: aiohttp.ClientSession, svc: Service, headers: dict[str, str], code: str) -> Any:
    """The ``text`` of the main result of ``code`` run through the code interpreter's execute."""
    r = await http.post(f"{svc.url}/e2b/sandbox/execute", json={"code": code}, headers=headers)
    assert r.status == 200, (r.status, await r.text())
    lines = [json.loads(line) for line in (await r.text()).splitlines() if line.strip()]
    errors = [line for line in lines if line["type"] == "error"]
    assert not errors, errors
    return next((line.get("text") for line in lines if line["type"] == "result"), None)


# -- finding 8: in-sandbox calls without a credential ------------------------------------------


async def _held_back(svc: Service, sandbox_id: str, path: str) -> tuple[asyncio.StreamWriter, bytes]:
    """A request with only the sandbox id, whose body is announced and never sent: the status
    line it gets within 10 s (b"" if none)."""
    url = urlsplit(svc.url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nE2b-Sandbox-Id: {sandbox_id}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode()
    )
    await writer.drain()
    try:
        status = await asyncio.wait_for(reader.readline(), 10)
    except TimeoutError:
        status = b""
    return writer, status


async def test_credential_less_context_calls_are_refused_and_the_owner_is_unaffected(
    svc: Service, http: aiohttp.ClientSession
) -> None:
    owner = await _create(http, svc, svc.api_key)
    try:
        assert await _run(http, svc, _as(owner), "x = 41; x") == "41"
        # with the sandbox id alone: no restart of the owner's kernel, no listing
        for method, path in (
            ("POST", "/e2b/sandbox/contexts/python/restart"),
            ("GET", "/e2b/sandbox/contexts"),
            ("POST", "/e2b/sandbox/contexts"),
            ("DELETE", "/e2b/sandbox/contexts/python"),
        ):
            r = await http.request(method, svc.url + path, headers=_as(owner, None), json={})
            assert r.status == 404, (method, path, r.status, await r.text())
        # more credential-less requests than the owner's key may have open, their bodies held
        # back: each is refused at once, and none is counted against the owner
        held = await asyncio.gather(
            *[_held_back(svc, owner["sandboxID"], "/e2b/sandbox/contexts") for _ in range(MAX_REQUESTS + 4)]
        )
        try:
            assert [status[:12] for _, status in held] == [b"HTTP/1.1 404"] * len(held), held
            # the owner: not 429, and its kernel was never restarted (x is still there)
            assert await _run(http, svc, _as(owner), "x + 1") == "42"
        finally:
            for writer, _ in held:
                writer.close()
        # the SDKs' context calls carry the traffic token: the owner's work
        traffic = {
            "E2b-Sandbox-Id": owner["sandboxID"],
            "E2B-Traffic-Access-Token": owner["trafficAccessToken"],
        }
        r = await http.get(f"{svc.url}/e2b/sandbox/contexts", headers=traffic)
        assert r.status == 200 and {c["id"] for c in await r.json()} == {"python", "bash"}
    finally:
        await _kill(http, svc, owner, svc.api_key)


async def test_a_body_held_back_by_a_token_holder_meets_the_body_timeout(
    svc: Service, http: aiohttp.ClientSession
) -> None:
    owner = await _create(http, svc, svc.api_key)
    try:
        url = urlsplit(svc.url)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        try:
            writer.write(
                f"POST /e2b/sandbox/contexts HTTP/1.1\r\nHost: {url.netloc}\r\n"
                f"E2b-Sandbox-Id: {owner['sandboxID']}\r\nX-Access-Token: {owner['envdAccessToken']}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode()
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BODY_TIMEOUT + 20)
            assert head.startswith(b"HTTP/1.1 408"), head
            length = int(
                next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))[15:]
            )
            said = json.loads(await reader.readexactly(length))
            assert f"body_timeout={BODY_TIMEOUT}s" in said["message"], said
        finally:
            writer.close()
    finally:
        await _kill(http, svc, owner, svc.api_key)


# -- finding 11: no existence oracle -----------------------------------------------------------


async def test_a_wrong_token_and_an_unknown_id_get_the_same_404(
    svc: Service, http: aiohttp.ClientSession
) -> None:
    owner = await _create(http, svc, svc.api_key)
    other = await _create(http, svc, svc.other_key)
    try:
        cases = {
            "wrong token": _as(owner, "kh_sbx_" + "A" * 43),
            "no token": _as(owner, None),
            "another sandbox's token": _as(owner, other["envdAccessToken"]),
            "unknown id": _as(owner, "kh_sbx_" + "A" * 43, sandbox_id="sbx_00000000deadbeef"),
            "unknown id, a real token": _as(owner, sandbox_id="sbx_00000000deadbeef"),
        }
        for method, path, body in (
            ("GET", "/e2b/sandbox/contexts", None),
            ("POST", "/e2b/sandbox/execute", {"code": "1"}),
            ("GET", "/e2b/sandbox/files?path=/etc/hostname", None),
            ("POST", "/e2b/sandbox/filesystem.Filesystem/Stat", {"path": "/"}),
            ("POST", "/e2b/sandbox/process.Process/List", {}),
        ):
            seen = {}
            for case, headers in cases.items():
                r = await http.request(method, svc.url + path, headers=headers, json=body)
                seen[case] = (r.status, r.content_type, await r.read())
            assert len(set(seen.values())) == 1, (path, seen)
            status, _, answer = next(iter(seen.values()))
            assert status == 404 and json.loads(answer)["message"] == NO_SUCH_SANDBOX, (path, seen)
        assert await _run(http, svc, _as(owner), "'still mine'") == "still mine"
    finally:
        await _kill(http, svc, owner, svc.api_key)
        await _kill(http, svc, other, svc.other_key)


# -- finding 9: background processes are bounded ------------------------------------------------


@pytest.fixture
def e2b_env(svc: Service, monkeypatch: pytest.MonkeyPatch) -> Service:
    monkeypatch.setenv("E2B_API_URL", f"{svc.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{svc.url}/e2b/sandbox")
    monkeypatch.setenv("E2B_API_KEY", svc.api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return svc


async def test_background_processes_are_capped_per_sandbox_and_per_key(e2b_env: Service) -> None:
    from e2b import RateLimitException
    from e2b_code_interpreter import AsyncSandbox

    first = await AsyncSandbox.create()
    second = await AsyncSandbox.create()
    try:
        # a request of 300 KB per process: the host keeps a summary of it, not the request
        big = "x" * 300_000
        for _ in range(3):
            await first.commands.run(f"sleep 600 # {big}", background=True)
        with pytest.raises(RateLimitException) as refused:
            await first.commands.run("sleep 600", background=True)
        assert "max_processes_per_sandbox=3" in str(refused.value) and "kill" in str(refused.value)
        listed = await first.commands.list()
        assert len(listed) == 3 and all(len(a) <= 120 for p in listed for a in p.args), [
            [len(a) for a in p.args] for p in listed
        ]
        await second.commands.run("sleep 600", background=True)  # the key's fourth
        with pytest.raises(RateLimitException) as refused:
            await second.commands.run("sleep 600", background=True)
        assert "max_processes_per_key=4" in str(refused.value), refused.value
        # ending one makes room again
        assert await first.commands.kill(listed[0].pid) is True
        for _ in range(50):
            if len(await first.commands.list()) == 2:
                break
            await asyncio.sleep(0.2)
        done = await second.commands.run("echo room again")
        assert done.stdout == "room again\n"
    finally:
        await first.kill()
        await second.kill()


# -- finding 10: ListDir stops at a cap ---------------------------------------------------------


async def test_list_dir_stops_at_max_list_entries_and_says_so(
    e2b_env: Service, http: aiohttp.ClientSession
) -> None:
    from e2b_code_interpreter import AsyncSandbox

    sbx = await AsyncSandbox.create()
    try:
        made = await sbx.commands.run(
            "mkdir -p /home/user/tree && cd /home/user/tree && "
            "for d in $(seq 10); do mkdir d$d; for f in $(seq 10); do : > d$d/f$f; done; done"
        )
        assert made.exit_code == 0
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": str(sbx._envd_access_token)}
        r = await http.post(
            f"{e2b_env.url}/e2b/sandbox/filesystem.Filesystem/ListDir",
            json={"path": "/home/user/tree", "depth": 2},
            headers=headers,
        )
        got = await r.json()
        assert r.status == 200 and len(got["entries"]) == 40 and got["truncated"] is True, (
            r.status,
            len(got.get("entries", [])),
        )
        small = await http.post(
            f"{e2b_env.url}/e2b/sandbox/filesystem.Filesystem/ListDir",
            json={"path": "/home/user/tree", "depth": 1},
            headers=headers,
        )
        assert "truncated" not in await small.json()  # 10 entries: the whole answer
        # E2B's SDK takes the truncated answer as a listing
        entries = await sbx.files.list("/home/user/tree", depth=2)
        # depth first, each directory by name, as envd walks: d1 and its files come first
        assert len(entries) == 40 and [e.path for e in entries[:2]] == [
            "/home/user/tree/d1",
            "/home/user/tree/d1/f1",
        ], [e.path for e in entries[:3]]
    finally:
        await sbx.kill()


# -- finding 7: tokens are random, kept across restarts, and die with the owner key ----------------


def _old_forged_token(sandbox_id: str) -> str:
    """The token the service used to derive for a sandbox of a key it no longer knew: an HMAC
    under the empty string, which anyone can compute."""
    mac = hmac.new(b"", f"e2b-envd:{sandbox_id}".encode(), hashlib.sha256)
    return "kh_" + mac.hexdigest()[:40]


async def _status(http: aiohttp.ClientSession, svc: Service, headers: dict[str, str]) -> int:
    r = await http.get(f"{svc.url}/e2b/sandbox/contexts", headers=headers)
    return r.status


async def test_a_forged_token_for_a_removed_keys_sandbox_is_a_404_and_tokens_survive_a_restart(
    svc: Service, http: aiohttp.ClientSession
) -> None:
    """Last in the module: it restarts the service (twice)."""
    theirs = await _create(http, svc, svc.other_key)
    both_keys = svc.env["KERNELHOST_API_KEYS"]
    try:
        assert await _run(http, svc, _as(theirs), "secret = 'theirs'; secret") == "theirs"
        svc.stop()
        svc.env["KERNELHOST_API_KEYS"] = svc.api_key  # the other key is removed
        svc.start(timeout=120)
        forged = _old_forged_token(theirs["sandboxID"])
        assert await _status(http, svc, _as(theirs, forged)) == 404
        r = await http.post(
            f"{svc.url}/e2b/sandbox/execute", json={"code": "secret"}, headers=_as(theirs, forged)
        )
        assert r.status == 404, await r.text()
        # the sandbox's own token is worthless too while its key is not configured
        assert await _status(http, svc, _as(theirs)) == 404
        svc.stop()
        svc.env["KERNELHOST_API_KEYS"] = both_keys
        svc.start(timeout=120)
        # kept as a hash in the store: the token create gave works after the restarts
        assert await _status(http, svc, _as(theirs)) == 200
        assert await _run(http, svc, _as(theirs), "secret") == "theirs"
        # connect gives a new token and the first stays valid
        r = await http.post(
            f"{svc.url}/e2b/sandboxes/{theirs['sandboxID']}/connect",
            json={},
            headers={"X-API-KEY": svc.other_key},
        )
        again = await r.json()
        assert r.status == 200 and again["envdAccessToken"] != theirs["envdAccessToken"]
        assert await _status(http, svc, _as(theirs, again["envdAccessToken"])) == 200
        assert await _status(http, svc, _as(theirs)) == 200
    finally:
        if svc.env["KERNELHOST_API_KEYS"] != both_keys:
            svc.stop()
            svc.env["KERNELHOST_API_KEYS"] = both_keys
            svc.start(timeout=120)
        await _kill(http, svc, theirs, svc.other_key)
