"""pydantic-ai, unmodified, runs kernelhost's MCP tools at ``/mcp`` on a real VM.

The agent's toolset is pydantic-ai's own ``MCPToolset`` on the service's URL with the key as its
bearer token; its model is pydantic-ai's ``FunctionModel`` (no network): a scripted model that
reads what the tools sent back, as a model would. Step 1 defines a variable and writes a file in
a new sandbox, step 2 uses both in the same sandbox (whose id step 1 returned), step 3 closes it;
the final answer is made of the value the VM computed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from kernelhost import AsyncSandbox

from ...harness import Service

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

STEP_1 = "total = 40\nopen('/tmp/step1.txt', 'w').write('2')\nprint('stored')"
STEP_2 = "total + int(open('/tmp/step1.txt').read())"


def structured(part: ToolReturnPart) -> dict[str, Any]:
    """The MCP tool's structured result, as pydantic-ai handed it to the model."""
    content = part.content
    if isinstance(content, str):
        content = json.loads(content)
    assert isinstance(content, dict), content
    return content


class ScriptedRunner:
    """The model: three tool calls, each built from the previous call's return, then text."""

    def __init__(self) -> None:
        self.returns: list[ToolReturnPart] = []
        self.tool_names: set[str] = set()

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.tool_names = {tool.name for tool in info.function_tools}
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        self.returns += [part for part in last.parts if isinstance(part, ToolReturnPart)]
        step = len(self.returns)
        if step == 0:
            return ModelResponse(parts=[ToolCallPart("run_code", {"code": STEP_1}, tool_call_id="c1")])
        sandbox_id = structured(self.returns[0])["sandbox_id"]
        if step == 1:
            args = {"code": STEP_2, "sandbox_id": sandbox_id}
            return ModelResponse(parts=[ToolCallPart("run_code", args, tool_call_id="c2")])
        if step == 2:
            args = {"sandbox_id": sandbox_id}
            return ModelResponse(parts=[ToolCallPart("close_sandbox", args, tool_call_id="c3")])
        return ModelResponse(parts=[TextPart(f"total is {structured(self.returns[1])['result']}")])


async def test_agent_defines_then_uses_state_in_one_sandbox_over_mcp(agents_service: Service) -> None:
    script = ScriptedRunner()
    toolset = MCPToolset(f"{agents_service.url}/mcp", auth=agents_service.api_key, read_timeout=300)
    agent = Agent(FunctionModel(script), toolsets=[toolset])
    async with agent:
        result = await agent.run("Store 40 and 2 in the sandbox, then add them up.")
    assert {"run_code", "close_sandbox", "create_sandbox", "read_file"} <= script.tool_names
    first, second, closed = (structured(part) for part in script.returns)
    assert first["status"] == "ok" and first["stdout"] == "stored\n", first
    assert second["sandbox_id"] == first["sandbox_id"]
    assert second["status"] == "ok" and second["result"] == "42", second  # computed in the VM
    assert closed == {"sandbox_id": first["sandbox_id"], "closed": True}
    assert result.output == "total is 42"
    remaining = await AsyncSandbox.list(url=agents_service.url, api_key=agents_service.api_key)
    assert first["sandbox_id"] not in {info.id for info in remaining}
