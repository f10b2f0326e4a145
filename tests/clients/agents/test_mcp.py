"""The ``mcp`` library's client lists and calls kernelhost's MCP tools, over stdio (``kernelhost
mcp`` as a subprocess) and over streamable HTTP (``/mcp`` on the service), against real VMs."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from kernelhost import AsyncSandbox

from ...harness import REPO, Service
from .conftest import SHOW_PNG

pytestmark = pytest.mark.clients

TOOLS = {
    "create_sandbox",
    "run_code",
    "read_file",
    "write_file",
    "list_files",
    "fork_sandbox",
    "restart_sandbox",
    "close_sandbox",
    "list_sandboxes",
    "checkpoint",
    "restore",
    "undo",
}


def stdio_client(service: Service, *extra: str) -> Client:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "kernelhost.cli", "mcp", *extra],
        cwd=str(REPO),
        env={"KERNELHOST_URL": service.url, "KERNELHOST_API_KEY": service.api_key},
    )
    return Client(params, read_timeout_seconds=120)


@asynccontextmanager
async def http_client(service: Service, key: str | None = None) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {key or service.api_key}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(120)) as http:
        async with Client(
            streamable_http_client(f"{service.url}/mcp", http_client=http), read_timeout_seconds=120
        ) as client:
            yield client


async def call(client: Client, tool: str, **arguments: Any) -> Any:
    """Call a tool; return its result, which must not be an error."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    return result


def text_of(result: Any, index: int = 0) -> str:
    """The text of a result's content block (which must be text)."""
    block = result.content[index]
    assert block.type == "text", block
    return str(block.text)


async def sandbox_ids(service: Service) -> set[str]:
    infos = await AsyncSandbox.list(url=service.url, api_key=service.api_key)
    return {info.id for info in infos}


async def test_stdio_server_runs_code_files_and_forks_then_deletes_its_sandboxes(
    agents_service: Service,
) -> None:
    before = await sandbox_ids(agents_service)
    async with stdio_client(agents_service, "--max-output-chars", "1000") as client:
        listed = await client.list_tools()
        assert {tool.name for tool in listed.tools} == TOOLS
        run_code = next(tool for tool in listed.tools if tool.name == "run_code")
        assert set(run_code.input_schema["required"]) == {"code"}
        assert run_code.output_schema is not None

        first = await call(client, "run_code", code="import math\nr = 2\nprint('ready')")
        data = first.structured_content
        sandbox_id = data["sandbox_id"]
        assert data["status"] == "ok" and data["stdout"] == "ready\n"
        assert text_of(first).endswith(f"[sandbox_id: {sandbox_id}]")

        area = await call(client, "run_code", code="round(math.pi * r ** 2, 2)", sandbox_id=sandbox_id)
        assert area.structured_content["result"] == "12.57"

        plot = await call(client, "run_code", code=SHOW_PNG, sandbox_id=sandbox_id)
        assert plot.structured_content["images"] == 1
        image = plot.content[1]
        assert image.type == "image" and image.mime_type == "image/png"
        assert image.data.startswith("iVBORw0KGgo")

        failing = await call(client, "run_code", code="r / 0", sandbox_id=sandbox_id)
        assert failing.structured_content["status"] == "error"
        assert failing.structured_content["error"]["name"] == "ZeroDivisionError"

        shell = await call(
            client, "run_code", code="echo $((r=6*7)); exit 3", language="bash", sandbox_id=sandbox_id
        )
        assert shell.structured_content["stdout"] == "42\n"
        assert shell.structured_content["exit_code"] == 3

        big = await call(client, "run_code", code="print('y' * 50_000)", sandbox_id=sandbox_id)
        assert big.structured_content["truncated"] is True
        assert len(big.structured_content["stdout"]) <= 1000

        written = await call(
            client, "write_file", sandbox_id=sandbox_id, path="notes/a.txt", content="hello from mcp\n"
        )
        assert written.structured_content == {"path": "/home/user/notes/a.txt", "size": 15, "created": True}
        assert (
            await call(client, "run_code", code="open('notes/a.txt').read()", sandbox_id=sandbox_id)
        ).structured_content["result"] == "'hello from mcp\\n'"
        await call(client, "run_code", code="open('/tmp/p.png', 'wb').write(_png)", sandbox_id=sandbox_id)
        read = await call(client, "read_file", sandbox_id=sandbox_id, path="notes/a.txt")
        assert read.structured_content["content"] == "hello from mcp\n"
        binary = await call(client, "read_file", sandbox_id=sandbox_id, path="/tmp/p.png")
        assert binary.structured_content["encoding"] == "base64"
        assert binary.content[0].type == "image"
        listing = await call(client, "list_files", sandbox_id=sandbox_id, path="notes")
        assert [e["name"] for e in listing.structured_content["entries"]] == ["a.txt"]

        forked = await call(client, "fork_sandbox", sandbox_id=sandbox_id, n=1)
        child = forked.structured_content["sandboxes"][0]["sandbox_id"]
        assert (await call(client, "run_code", code="r", sandbox_id=child)).structured_content[
            "result"
        ] == "2"
        restarted = await call(client, "restart_sandbox", sandbox_id=child)
        assert restarted.structured_content == {"sandbox_id": child, "recovery": "kernel_restarted"}
        after = await call(client, "run_code", code="r", sandbox_id=child)  # variables are gone
        assert after.structured_content["error"]["name"] == "NameError"

        created = await call(client, "create_sandbox", network="allowlist", allow=["files.example.org:443"])
        extra = created.structured_content["sandbox_id"]
        assert created.structured_content["network"] == "allowlist"
        proxied = await call(client, "run_code", sandbox_id=extra, language="bash", code="echo $HTTPS_PROXY")
        assert proxied.structured_content["stdout"].strip() == "http://127.0.0.1:3128"
        bad = await client.call_tool("create_sandbox", {"network": "outbound", "allow": ["x.example.org"]})
        assert bad.is_error and "allow" in text_of(bad)
        closed = await call(client, "close_sandbox", sandbox_id=extra)
        assert closed.structured_content == {"sandbox_id": extra, "closed": True}
        gone = await client.call_tool("run_code", {"code": "1", "sandbox_id": extra})
        assert gone.is_error and "does not exist" in text_of(gone)

        mine = await call(client, "list_sandboxes")
        assert {sandbox_id, child} <= {s["sandbox_id"] for s in mine.structured_content["sandboxes"]}
    # the server deleted the sandboxes it created when it stopped
    assert await sandbox_ids(agents_service) == before


async def test_http_endpoint_needs_the_key_and_keeps_keys_apart(agents_service: Service) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{agents_service.url}/mcp", json={}) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "unauthorized"
    async with http_client(agents_service) as client:
        listed = await client.list_tools()
        assert {tool.name for tool in listed.tools} == TOOLS
        created = await call(client, "create_sandbox")
        sandbox_id = created.structured_content["sandbox_id"]
        assert created.structured_content["state"] == "running"
        await call(client, "run_code", code="secret = 'kept'", sandbox_id=sandbox_id)
        await call(
            client, "write_file", sandbox_id=sandbox_id, path="/tmp/data.json", content=json.dumps({"n": 41})
        )
        result = await call(
            client,
            "run_code",
            sandbox_id=sandbox_id,
            code="import json\njson.load(open('/tmp/data.json'))['n'] + 1",
        )
        assert result.structured_content["result"] == "42"
        assert result.content[0].type == "text"

        # another key neither sees nor reaches this key's sandbox
        async with http_client(agents_service, agents_service.other_key) as other:
            denied = await other.call_tool("run_code", {"code": "secret", "sandbox_id": sandbox_id})
            assert denied.is_error and "does not exist" in text_of(denied)
            theirs = await call(other, "list_sandboxes")
            assert sandbox_id not in {s["sandbox_id"] for s in theirs.structured_content["sandboxes"]}

        assert (await call(client, "run_code", code="secret", sandbox_id=sandbox_id)).structured_content[
            "result"
        ] == "'kept'"
        await call(client, "close_sandbox", sandbox_id=sandbox_id)
    assert sandbox_id not in await sandbox_ids(agents_service)
