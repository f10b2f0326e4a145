"""A tenant with a valid key against the service and the other tenants, through a real service
and real VMs: per-key limits that concurrent calls cannot overbook, limits on what one key may
hold open, on unauthenticated connections, on metadata, on the MCP endpoint, and a second
service started by mistake on the same state.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent

from kernelhost import AsyncSandbox
from kernelhost.client import InvalidRequestError, RateLimitError

from ..harness import REPO, Service, running_service

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(
        tmp_path_factory.mktemp("limited"),
        "vm-limited",
        KERNELHOST_MAX_SANDBOXES_PER_KEY="3",
        KERNELHOST_MAX_MEMORY_MIB_PER_KEY="1024",  # two running 512 MiB sandboxes
        KERNELHOST_MAX_HIBERNATED_MIB_PER_KEY="600",  # one hibernated sandbox's worth
        KERNELHOST_MAX_REQUESTS_PER_KEY="8",
        KERNELHOST_MAX_CONNECTIONS="40",
        KERNELHOST_HEADER_TIMEOUT="3",
        KERNELHOST_POOL_SIZE="1",
    ) as svc:
        yield svc


async def _mine(svc: Service, key: str) -> list[str]:
    return [s.id for s in await AsyncSandbox.list(url=svc.url, api_key=key)]


async def _close_all(svc: Service) -> None:
    for key in (svc.api_key, svc.other_key):
        for sandbox_id in await _mine(svc, key):
            sbx = await AsyncSandbox.connect(sandbox_id, url=svc.url, api_key=key)
            await sbx.close()


@pytest.fixture
async def clean(limited: Service) -> AsyncIterator[Service]:
    await _close_all(limited)
    yield limited
    await _close_all(limited)


async def _create(svc: Service, key: str, **kwargs: Any) -> AsyncSandbox | RateLimitError:
    try:
        return await AsyncSandbox.create(url=svc.url, api_key=key, **kwargs)
    except RateLimitError as exc:
        return exc


# -- quotas reserved before any work starts ---------------------------------------------


async def test_concurrent_creates_cannot_pass_the_key_limits(clean: Service) -> None:
    made = await asyncio.gather(*[_create(clean, clean.api_key) for _ in range(5)])
    created = [m for m in made if isinstance(m, AsyncSandbox)]
    refused = [m for m in made if isinstance(m, RateLimitError)]
    assert len(created) == 2 and len(refused) == 3, made  # 1024 MiB: two 512 MiB VMs
    assert {r.details.get("limit") for r in refused} <= {"max_memory_mib_per_key", "max_sandboxes_per_key"}
    assert len(await _mine(clean, clean.api_key)) == 2
    for sbx in created:
        await sbx.close()


async def test_forks_queued_behind_a_cell_cannot_pass_the_key_limits(clean: Service) -> None:
    parent = await AsyncSandbox.create(url=clean.url, api_key=clean.api_key)
    await parent.run_code("x = 41")
    busy = asyncio.ensure_future(parent.run_code("import time; time.sleep(8)"))
    await asyncio.sleep(1)

    async def fork() -> Any:
        try:
            return await parent.fork(1)
        except RateLimitError as exc:
            return exc

    outcomes = await asyncio.gather(*[fork() for _ in range(3)])  # all wait for the cell
    await busy
    children = [c for o in outcomes if isinstance(o, list) for c in o]
    assert len(children) == 1, outcomes  # the parent and one child fill 1024 MiB
    assert sum(isinstance(o, RateLimitError) for o in outcomes) == 2
    assert (await children[0].run_code("x + 1")).text == "42"
    for sbx in (parent, *children):
        await sbx.close()


# -- waking counts again; hibernation has a disk budget ----------------------------------


async def test_a_woken_sandbox_counts_against_its_key_again(clean: Service) -> None:
    headers = {"Authorization": f"Bearer {clean.api_key}"}
    a = await AsyncSandbox.create(url=clean.url, api_key=clean.api_key)
    b = await AsyncSandbox.create(url=clean.url, api_key=clean.api_key)
    await a.run_code("kept = 'yes'")
    async with aiohttp.ClientSession(headers=headers) as http:
        r = await http.post(f"{clean.url}/v1/sandboxes/{a.id}/hibernate")
        assert r.status == 200 and (await r.json())["state"] == "hibernated"
        c = await AsyncSandbox.create(url=clean.url, api_key=clean.api_key)  # room again
        with pytest.raises(RateLimitError) as err:  # waking a would pass the memory limit
            await a.run_code("kept")
        assert err.value.details.get("limit") == "max_memory_mib_per_key"
        assert (await a.info()).state == "hibernated"  # nothing was woken
        r = await http.post(f"{clean.url}/v1/sandboxes/{b.id}/hibernate")
        assert r.status == 429  # a's saved state plus b's would pass the disk budget
        assert (await r.json())["error"]["limit"] == "max_hibernated_mib_per_key"
        await c.close()
    assert (await a.run_code("kept")).text == "'yes'"  # with room, it wakes, state intact
    await a.close()
    await b.close()


# -- findings 8, 12: what one key may hold open, and send ----------------------------------------


async def test_one_key_cannot_hold_every_request(clean: Service) -> None:
    sbx = await AsyncSandbox.create(url=clean.url, api_key=clean.api_key)
    calls = [asyncio.ensure_future(sbx.run_code("import time; time.sleep(6)")) for _ in range(8)]
    await asyncio.sleep(2)  # eight requests open (one runs, seven queue behind it)
    with pytest.raises(RateLimitError) as err:
        await sbx.info()
    assert err.value.details.get("limit") == "max_requests_per_key"
    assert await _mine(clean, clean.other_key) == []  # another key is served meanwhile
    for call in calls:  # the clients go away: their calls end, and the key has room again
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            await sbx.info()
            break
        except RateLimitError:
            assert time.monotonic() < deadline, "the abandoned calls still count against the key"
            await asyncio.sleep(0.5)
    await sbx.close()


async def test_metadata_has_a_size_limit(clean: Service) -> None:
    with pytest.raises(InvalidRequestError) as err:
        await AsyncSandbox.create(url=clean.url, api_key=clean.api_key, metadata={"blob": "x" * (512 << 10)})
    assert "max_metadata_bytes" in str(err.value)
    small = await AsyncSandbox.create(url=clean.url, api_key=clean.api_key, metadata={"team": "a"})
    assert (await small.info()).metadata == {"team": "a"}
    await small.close()


def _limits_of(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files limit")


async def test_slow_and_surplus_connections_are_closed_before_auth(limited: Service) -> None:
    assert limited.proc is not None
    soft, hard = _limits_of(limited.proc.pid)
    assert soft == hard, "the service did not raise its descriptor limit"
    host, port = limited.url.removeprefix("http://").split(":")
    socks = []
    for _ in range(60):  # a head that never ends
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.monotonic()
    closed = 0
    for s in socks:
        s.settimeout(max(0.1, 15 - (time.monotonic() - t0)))
        try:
            closed += s.recv(1024) == b""
        except ConnectionResetError:  # closed with our head unread: the kernel answers RST
            closed += 1
        except OSError:  # still open at the deadline
            pass
        s.close()
    assert closed == 60, f"{60 - closed} slow connections were still open 15 s later"
    async with aiohttp.ClientSession() as http, http.get(f"{limited.url}/healthz") as r:
        assert r.status == 200 and r.headers["X-Content-Type-Options"] == "nosniff"


# -- findings 5, 10: the MCP endpoint --------------------------------------------------------------


def _rss_mib(service: Service) -> float:
    assert service.proc is not None
    with open(f"/proc/{service.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_mcp_sessions_are_limited_per_key(limited: Service) -> None:
    opening = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    accept = {"Accept": "application/json, text/event-stream"}

    opened: list[tuple[str, str]] = []

    async def open_session(http: aiohttp.ClientSession, key: str) -> int:
        headers = {**accept, "Authorization": f"Bearer {key}"}
        async with http.post(f"{limited.url}/mcp", json=opening, headers=headers) as r:
            await r.read()
            if "mcp-session-id" in r.headers:
                opened.append((key, r.headers["mcp-session-id"]))
            return r.status

    async with aiohttp.ClientSession() as http:
        try:
            statuses = [await open_session(http, limited.api_key) for _ in range(33)]
            assert statuses[:32] == [200] * 32 and statuses[32] == 429, statuses
            assert await open_session(http, limited.other_key) == 200  # other keys are not shut out
        finally:
            for key, session_id in opened:
                headers = {"Authorization": f"Bearer {key}", "mcp-session-id": session_id}
                async with http.delete(f"{limited.url}/mcp", headers=headers) as r:
                    assert r.status in (200, 204, 404)


async def test_mcp_keeps_only_what_its_answer_can_use(clean: Service) -> None:
    headers = {"Authorization": f"Bearer {clean.api_key}"}
    before = _rss_mib(clean)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(300)) as http,
        Client(streamable_http_client(f"{clean.url}/mcp", http_client=http), read_timeout_seconds=300) as mcp,
    ):
        created = await mcp.call_tool("create_sandbox", {})
        sandbox_id = created.structured_content["sandbox_id"]
        code = (
            "import os\nfrom IPython.display import Image, display\n"
            "png = b'\\x89PNG\\r\\n\\x1a\\n'\n"
            "for _ in range(1500):\n    display(Image(data=png + os.urandom(48 << 10)))\n"
            "os.symlink('/tmp/big', 'link')\nopen('/tmp/big', 'wb').truncate(64 << 20)"
        )
        ran = await mcp.call_tool("run_code", {"code": code, "sandbox_id": sandbox_id, "timeout": 240})
        assert not ran.is_error, ran.content
        notes = " ".join(ran.structured_content["notes"])
        assert "not shown" in notes and ran.structured_content["images"] <= 4
        grown = _rss_mib(clean) - before
        assert grown < 60, f"1500 displayed images (96 MiB) grew the service by {grown:.0f} MiB"
        read = await mcp.call_tool("read_file", {"sandbox_id": sandbox_id, "path": "link"})
        [text] = [c.text for c in read.content if isinstance(c, TextContent)]
        assert read.is_error and "limit" in text  # 64 MiB behind a small link
        assert _rss_mib(clean) - before < 60


# -- one service per state ---------------------------------------------------------------


async def test_a_second_service_on_the_same_state_refuses_before_touching_a_vm(limited: Service) -> None:
    hv = limited.hypervisor()
    try:
        before = sorted(d.name for d in hv.domains())
        env = {**limited.env, "KERNELHOST_PORT": str(_free_port())}
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "kernelhost.cli", "serve"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert limited.proc is not None
        assert f"pid {limited.proc.pid}" in proc.stderr and "KERNELHOST_STATE_DIR" in proc.stderr
        # nothing of the first was touched (its pool may have added a VM meanwhile)
        assert set(before) <= {d.name for d in hv.domains()}
    finally:
        hv.close()
    async with aiohttp.ClientSession() as http, http.get(f"{limited.url}/healthz") as r:
        assert r.status == 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
