"""LangChain's MCP adapters (``langchain-mcp-adapters``, unmodified) load kernelhost's tools from
``/mcp`` and a fake chat model of langchain-core calls them, against a real VM.

The adapters need ``mcp<2`` and the service serves ``/mcp`` with ``mcp`` 2, so they run in a
virtualenv of their own (isolated.py) with ``drive_langchain_mcp.py``: an MCP 1.x client against
the service's server. Step 1 defines a variable and writes a file in a new sandbox, step 2 uses
both in the same sandbox (the id step 1 returned), step 3 closes it.
"""

from __future__ import annotations

import pytest

from kernelhost import Sandbox

from ...harness import Service
from .isolated import LANGCHAIN_MCP, framework_python, run_driver

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]


def test_adapters_tools_keep_state_across_calls_in_one_sandbox(agents_service: Service) -> None:
    python = framework_python("langchain-mcp", LANGCHAIN_MCP)
    seen = run_driver(python, "drive_langchain_mcp.py", agents_service)
    assert {"run_code", "create_sandbox", "close_sandbox", "fork_sandbox"} <= set(seen["tools"])
    first, second, closed = seen["results"]
    assert first["status"] == "ok" and first["stdout"] == "stored\n", first
    assert second["sandbox_id"] == first["sandbox_id"]
    assert second["status"] == "ok" and second["result"] == "42", second  # computed in the VM
    assert f"[sandbox_id: {first['sandbox_id']}]" in str(seen["texts"][1])  # the model's text
    assert closed == {"sandbox_id": first["sandbox_id"], "closed": True}
    assert seen["final"] == "total is 42"
    remaining = Sandbox.list(url=agents_service.url, api_key=agents_service.api_key)
    assert first["sandbox_id"] not in {info.id for info in remaining}
