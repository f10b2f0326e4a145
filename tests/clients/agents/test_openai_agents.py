"""The OpenAI Agents SDK runs ``code_interpreter_tool()`` against the real service.

``Runner.run`` drives an ``Agent`` whose model is the SDK's own scripted test model
(``agents.testing.ScriptedModel``); the tool runs each call in a real sandbox, and what the model
is sent back (``function_call_output``) is read from the model's recorded calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from agents import Agent, FunctionTool, Runner, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call

from kernelhost import AsyncSandbox, Sandbox
from kernelhost.integrations.openai_agents import PARAMETERS, code_interpreter_tool
from kernelhost.integrations.output import OutputBudget

from ...harness import Service
from .conftest import SHOW_PNG, outputs_seen_by

pytestmark = pytest.mark.clients

set_tracing_disabled(True)


def call(code: str, call_id: str, language: str = "python") -> Any:
    return function_call("run_code", {"code": code, "language": language}, call_id=call_id)


async def test_runner_keeps_state_across_calls_in_a_sandbox_the_tool_creates(agents_service: Service) -> None:
    tool = code_interpreter_tool(url=agents_service.url, api_key=agents_service.api_key, timeout=60)
    assert isinstance(tool, FunctionTool)
    assert tool.params_json_schema == PARAMETERS and tool.strict_json_schema
    model = ScriptedModel(
        [
            [call("total = 40", "call_1")],
            [call("total += 2\ntotal", "call_2")],
            [call("total / 0", "call_3")],
            [assistant_message("total is 42")],
        ]
    )
    agent = Agent(name="calc", instructions="Use run_code.", model=model, tools=[tool])
    try:
        result = await Runner.run(agent, "What is 40 + 2?")
        assert result.final_output == "total is 42"
        model.assert_complete()
        assert outputs_seen_by(model, 1) == {"call_1": "[no output]"}
        assert outputs_seen_by(model, 2)["call_2"] == "Out[2]: 42"
        failed = outputs_seen_by(model, 3)["call_3"]
        assert "ZeroDivisionError" in failed and "total / 0" in failed  # an output, not a crash
        sandbox = tool.sandbox
        assert isinstance(sandbox, Sandbox)
        sandbox_id = sandbox.id
        tool_schema = model.calls[0].tools[0]
        assert isinstance(tool_schema, FunctionTool) and tool_schema.name == "run_code"
    finally:
        await tool.aclose()
    remaining = await AsyncSandbox.list(url=agents_service.url, api_key=agents_service.api_key)
    assert sandbox_id not in {info.id for info in remaining}


async def test_images_bash_and_budget_with_a_sandbox_passed_in(agents_sandbox: AsyncSandbox) -> None:
    tool = code_interpreter_tool(agents_sandbox, budget=OutputBudget(max_chars=300))
    model = ScriptedModel(
        [
            [call(SHOW_PNG, "call_img")],
            [call("echo from bash; ls /nonexistent", "call_sh", "bash")],
            [call("print('x' * 5000)", "call_big")],
            [assistant_message("done")],
        ]
    )
    agent = Agent(name="plots", instructions="Use run_code.", model=model, tools=[tool])
    result = await Runner.run(agent, "draw")
    assert result.final_output == "done"
    image_output = outputs_seen_by(model, 1)["call_img"]
    assert isinstance(image_output, list)
    kinds = [part["type"] for part in image_output]
    assert kinds == ["input_text", "input_image"]
    assert image_output[1]["image_url"].startswith("data:image/png;base64,iVBORw0KGgo")
    bash_output = outputs_seen_by(model, 2)["call_sh"]
    assert bash_output.startswith("from bash\n[stderr]\nls: cannot access '/nonexistent'")
    assert bash_output.endswith("[exit code 2]")
    big = outputs_seen_by(model, 3)["call_big"]
    assert len(big) <= 300 and "characters truncated" in big
    await tool.aclose()  # a sandbox passed in is left to its owner
    assert (await agents_sandbox.run_code("1 + 1")).text == "2"


async def test_a_blocking_sandbox_works_from_the_event_loop(agents_sync_sandbox: Sandbox) -> None:
    tool = code_interpreter_tool(agents_sync_sandbox)
    model = ScriptedModel(
        [
            [call("import os\nos.getpid() > 0", "c1"), call("'python'.upper()", "c2")],
            [assistant_message("ok")],
        ]
    )
    result = await Runner.run(Agent(name="sync", model=model, tools=[tool]), "go")
    assert result.final_output == "ok"
    seen = outputs_seen_by(model, 1)
    assert re.fullmatch(r"Out\[\d+\]: True", seen["c1"]), seen
    assert re.fullmatch(r"Out\[\d+\]: 'PYTHON'", seen["c2"]), seen


async def test_bad_arguments_come_back_as_output() -> None:
    tool = code_interpreter_tool(Sandbox.__new__(Sandbox))  # never reached: arguments are bad
    answer = await tool.on_invoke_tool(None, "{not json")  # type: ignore[arg-type]
    assert "not valid JSON" in answer
    answer = await tool.on_invoke_tool(None, json.dumps({"language": "python"}))  # type: ignore[arg-type]
    assert "Missing 'code'" in answer
    with pytest.raises(TypeError, match="AsyncSandbox or Sandbox"):
        code_interpreter_tool("sbx_123")  # type: ignore[arg-type]
