"""One error, three interfaces: each words the remedy in its own terms (REST routes, the Kernel
Gateway's "restart the kernel", the MCP server's tools), and none gives another's advice."""

from __future__ import annotations

import pytest

from kernelhost.api.errors import error_body, status_for
from kernelhost.api.gateway.connection import closed_for
from kernelhost.client import APIError, ConflictError
from kernelhost.integrations.mcp_server import _tool_error
from kernelhost.sandboxes import AgentUnresponsive, Remedy, SandboxNotRunning

pytestmark = pytest.mark.unit


def _dead() -> SandboxNotRunning:
    return SandboxNotRunning(
        "sandbox sbx_1 is dead: the VM stopped", remedy=Remedy.RESTART, state="dead", sandbox_id="sbx_1"
    )


def test_rest_names_its_route_and_says_the_remedy_for_programs() -> None:
    body = error_body(_dead())
    assert status_for(_dead()) == 409
    assert body["remedy"] == "restart" and body["reason"] == "sandbox sbx_1 is dead: the VM stopped"
    assert "POST /v1/sandboxes/sbx_1/restart" in body["hint"]
    assert body["message"] == f"{body['reason']}; {body['hint']}"


def test_the_gateway_says_restart_the_kernel() -> None:
    closed = closed_for(_dead())
    assert closed.code == 4009
    assert "restart the kernel" in str(closed) and "/v1/" not in str(closed)


def test_mcp_names_its_own_tool() -> None:
    body = error_body(AgentUnresponsive("the agent of sandbox sbx_2 did not answer", sandbox_id="sbx_2"))
    exc = ConflictError(body["message"], status=503, code=body["code"], details=body)
    text = str(_tool_error(exc, "sbx_2"))
    assert "restart_sandbox" in text and "POST" not in text and "did not answer" in text


def test_an_error_without_a_remedy_is_passed_on_as_it_is() -> None:
    exc = APIError("over the limit", status=429, code="capacity_exceeded", details={})
    assert "over the limit" in str(_tool_error(exc)) and exc.remedy is None
