"""The ``anthropic`` SDK drives the real service through ``kernelhost.integrations.anthropic``.

The SDK talks to a scripted local Messages API (``messages_api.py``) whose replies carry
``tool_use`` blocks; the loop of Anthropic's tool-use docs runs until ``end_turn``, each answer is
produced by the adapter from a real sandbox, and every block, sent or received, is validated
with the SDK's own types (``construct()`` does not validate, so ``TypeAdapter`` does).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import anthropic
import pytest
from anthropic import types
from pydantic import TypeAdapter

from kernelhost import AsyncSandbox, KernelHostError, Sandbox
from kernelhost.integrations.anthropic import (
    ahandle_code_execution_tool_use,
    code_execution_tool,
    handle_code_execution_tool_use,
    server_code_execution_tool,
)
from kernelhost.integrations.output import OutputBudget

from ...harness import Service
from .conftest import SHOW_PNG
from .messages_api import ScriptedMessagesAPI

pytestmark = pytest.mark.clients

CONTENT_BLOCK = TypeAdapter(types.ContentBlock)
TOOL_RESULT = TypeAdapter(types.ToolResultBlockParam)
MESSAGE_PARAM = TypeAdapter(types.MessageParam)
BLOCK_PARAM = TypeAdapter(types.ContentBlockParam)


def tool_use(id_: str, code: str, name: str = "run_python") -> dict[str, Any]:
    return {"type": "tool_use", "id": id_, "name": name, "input": {"code": code}}


def validated_tool_result(block: dict[str, Any]) -> dict[str, Any]:
    """The block checked against ``ToolResultBlockParam`` (lazy iterables forced)."""
    checked = TOOL_RESULT.validate_python(block)
    content = checked["content"]
    items = [content] if isinstance(content, str) else list(content)
    assert items, block
    return block


def test_docs_tool_use_loop_with_the_sync_sdk(agents_sync_sandbox: Sandbox) -> None:
    script = [
        {
            "content": [
                {"type": "text", "text": "Let me compute that."},
                tool_use("toolu_01", "y = 6 * 7\nprint('y is', y)"),
                tool_use("toolu_02", SHOW_PNG),
            ],
            "stop_reason": "tool_use",
        },
        {"content": [tool_use("toolu_03", "y / 0")], "stop_reason": "tool_use"},
        {"content": [{"type": "text", "text": "y is 42."}], "stop_reason": "end_turn"},
    ]
    with (
        ScriptedMessagesAPI(script) as api,
        anthropic.Anthropic(base_url=api.url, api_key="test-key", max_retries=0) as client,
    ):
        messages: list[Any] = [{"role": "user", "content": "What is 6 * 7?"}]
        # The loop from Anthropic's tool-use documentation, with the adapter as the tool.
        while True:
            response = client.messages.create(
                model="scripted",
                max_tokens=1024,
                tools=[code_execution_tool()],  # type: ignore[list-item]
                messages=messages,
            )
            for block in response.content:
                CONTENT_BLOCK.validate_python(block.model_dump(mode="json"))
            messages.append({"role": "assistant", "content": response.content})
            if response.stop_reason != "tool_use":
                break
            messages.append(
                {
                    "role": "user",
                    "content": [
                        validated_tool_result(handle_code_execution_tool_use(block, agents_sync_sandbox))
                        for block in response.content
                        if block.type == "tool_use"
                    ],
                }
            )
    assert response.stop_reason == "end_turn"
    assert len(api.requests) == 3
    assert api.requests[0]["tools"] == [code_execution_tool()]  # sent as given
    first, second = api.requests[1]["messages"][-1]["content"]
    assert first == {
        "type": "tool_result",
        "tool_use_id": "toolu_01",
        "content": [{"type": "text", "text": "y is 42"}],
        "is_error": False,
    }
    assert second["content"][0]["text"] == "<image 1: image/png, attached>"
    image = second["content"][1]
    assert image["type"] == "image" and image["source"]["media_type"] == "image/png"
    assert image["source"]["data"].startswith("iVBORw0KGgo")  # a PNG, base64
    failed = api.requests[2]["messages"][-1]["content"][0]
    assert failed["is_error"] is True and "ZeroDivisionError" in failed["content"][0]["text"]
    for message in api.requests[2]["messages"]:
        MESSAGE_PARAM.validate_python(message)


async def test_async_loop_with_bash_client_tool_and_budget(agents_sandbox: AsyncSandbox) -> None:
    bash_tool = {
        "name": "bash",
        "description": "Run a shell command",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    }
    script = [
        {
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_b1",
                    "name": "bash",
                    "input": {"command": "seq 1 20000; echo done >&2; exit 5"},
                }
            ],
            "stop_reason": "tool_use",
        },
        {
            "content": [{"type": "tool_use", "id": "toolu_b2", "name": "bash", "input": {"cmd": "typo"}}],
            "stop_reason": "tool_use",
        },
        {"content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn"},
    ]
    budget = OutputBudget(max_chars=500)
    with ScriptedMessagesAPI(script) as api:
        async with anthropic.AsyncAnthropic(base_url=api.url, api_key="test-key", max_retries=0) as client:
            messages: list[Any] = [{"role": "user", "content": "count"}]
            while True:
                response = await client.messages.create(
                    model="scripted",
                    max_tokens=256,
                    tools=[bash_tool],  # type: ignore[list-item]
                    messages=messages,
                )
                messages.append({"role": "assistant", "content": response.content})
                if response.stop_reason != "tool_use":
                    break
                messages.append(
                    {
                        "role": "user",
                        "content": [
                            validated_tool_result(
                                await ahandle_code_execution_tool_use(block, agents_sandbox, budget=budget)
                            )
                            for block in response.content
                            if block.type == "tool_use"
                        ],
                    }
                )
    counted = api.requests[1]["messages"][-1]["content"][0]
    text = counted["content"][0]["text"]
    assert counted["is_error"] is True  # exit status 5
    assert len(text) <= 500
    assert text.startswith("1\n2\n3\n")
    assert "characters truncated ...]" in text
    assert text.endswith("19999\n20000\n[stderr]\ndone\n[exit code 5]")
    invalid = api.requests[2]["messages"][-1]["content"][0]
    assert invalid["is_error"] is True
    assert "pass 'code'" in invalid["content"][0]["text"]


async def test_gateway_emulates_the_code_execution_server_tool(
    agents_sync_sandbox: Sandbox, agents_service: Service
) -> None:
    """The scripted API is a gateway that answers Anthropic's code execution tool (20250825)
    with kernelhost: its responses carry server_tool_use blocks paired with the adapter's result
    blocks. The SDK parses them, the client sends them back verbatim (pause_turn), and every
    block validates against the SDK's own types, error codes included."""

    ids = itertools.count(1)

    async def run_tools(
        calls: list[tuple[str, dict[str, Any]]], stop: str, timeout: float = 30
    ) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        for name, args in calls:
            block = {
                "type": "server_tool_use",
                "id": f"srvtoolu_{next(ids):04d}",
                "name": name,
                "input": args,
            }
            result = await asyncio.to_thread(
                handle_code_execution_tool_use, block, agents_sync_sandbox, timeout=timeout
            )
            CONTENT_BLOCK.validate_python(result)  # exactly the server tool's result type
            content += [block, result]
        return {
            "content": content,
            "stop_reason": stop,
            "server_tool_use": {"code_execution_requests": len(calls)},
        }

    script = [
        lambda body: run_tools(
            [
                (
                    "bash_code_execution",
                    {"command": "mkdir -p /tmp/gw && cd /tmp/gw && printf 'a = 1\\nb = 2\\n' > m.py && ls"},
                ),
                (
                    "text_editor_code_execution",
                    {"command": "create", "path": "/tmp/gw/n.py", "file_text": "x = 1\n"},
                ),
                (
                    "text_editor_code_execution",
                    {"command": "create", "path": "/tmp/gw/n.py", "file_text": "x = 2\n"},
                ),
            ],
            "pause_turn",
        ),
        lambda body: run_tools(
            [
                (
                    "text_editor_code_execution",
                    {
                        "command": "str_replace",
                        "path": "/tmp/gw/m.py",
                        "old_str": "b = 2",
                        "new_str": "b = 3\nc = 4",
                    },
                ),
                ("text_editor_code_execution", {"command": "view", "path": "/tmp/gw/m.py"}),
                ("text_editor_code_execution", {"command": "view", "path": "/tmp/gw"}),
                ("text_editor_code_execution", {"command": "view", "path": "/tmp/gw/none.py"}),
                (
                    "text_editor_code_execution",
                    {"command": "str_replace", "path": "/tmp/gw/m.py", "old_str": "zzz", "new_str": ""},
                ),
                ("text_editor_code_execution", {"command": "rename", "path": "/tmp/gw/m.py"}),
                ("bash_code_execution", {"command": "python3 -c 'import sys; sys.exit(3)'"}),
                ("bash_code_execution", {}),
                (
                    "code_execution",
                    {"code": "import sys; print('out'); print('err', file=sys.stderr); 6 * 7"},
                ),
            ],
            "pause_turn",
        ),
        lambda body: run_tools([("bash_code_execution", {"command": "sleep 30"})], "end_turn", timeout=1),
    ]
    with ScriptedMessagesAPI(script) as api:
        async with anthropic.AsyncAnthropic(base_url=api.url, api_key="test-key", max_retries=0) as client:
            messages: list[Any] = [{"role": "user", "content": "Edit m.py"}]
            received: list[Any] = []
            while True:
                response = await client.messages.create(
                    model="scripted",
                    max_tokens=1024,
                    messages=messages,
                    tools=[server_code_execution_tool()],  # type: ignore[list-item]
                    extra_headers={"anthropic-beta": "code-execution-2025-08-25"},
                )
                received += response.content
                messages.append({"role": "assistant", "content": response.content})
                if response.stop_reason != "pause_turn":
                    break
    assert response.stop_reason == "end_turn"
    assert api.requests[0]["tools"] == [{"type": "code_execution_20250825", "name": "code_execution"}]
    # every block the SDK returned validates against its type; results keep their pairing
    results = []
    for block in received:
        CONTENT_BLOCK.validate_python(block.model_dump(mode="json"))
        if block.type != "server_tool_use":
            results.append(block.model_dump(mode="json", exclude_none=True)["content"])
    (
        bash_ls,
        created,
        updated,
        replaced,
        viewed,
        listed,
        missing,
        absent,
        bad_cmd,
        exit3,
        no_cmd,
        code,
        timed_out,
    ) = results
    assert bash_ls == {
        "type": "bash_code_execution_result",
        "stdout": "m.py\n",
        "stderr": "",
        "return_code": 0,
        "content": [],
    }
    assert created == {"type": "text_editor_code_execution_create_result", "is_file_update": False}
    assert updated["is_file_update"] is True
    assert replaced == {
        "type": "text_editor_code_execution_str_replace_result",
        "old_start": 2,
        "old_lines": 1,
        "new_start": 2,
        "new_lines": 2,
        "lines": ["-b = 2", "+b = 3", "+c = 4"],
    }
    assert viewed == {
        "type": "text_editor_code_execution_view_result",
        "file_type": "text",
        "content": "a = 1\nb = 3\nc = 4\n",
        "num_lines": 3,
        "start_line": 1,
        "total_lines": 3,
    }
    assert listed["content"] == "m.py\nn.py"
    assert missing == {
        "type": "text_editor_code_execution_tool_result_error",
        "error_code": "file_not_found",
        "error_message": "/tmp/gw/none.py does not exist",
    }
    assert absent["error_code"] == "invalid_tool_input"
    assert "not found" in absent["error_message"]
    assert bad_cmd["error_code"] == "invalid_tool_input"
    assert exit3["return_code"] == 3
    assert no_cmd == {"type": "bash_code_execution_tool_result_error", "error_code": "invalid_tool_input"}
    assert code["type"] == "code_execution_result" and code["stderr"] == "err\n"
    assert code["stdout"].startswith("out\nOut[") and code["stdout"].endswith("]: 42")
    assert timed_out == {
        "type": "bash_code_execution_tool_result_error",
        "error_code": "execution_time_exceeded",
    }
    # the history sent back held every server block, paired (the fake API checks it too)
    history = api.requests[-1]["messages"]
    sent = [b for m in history if m["role"] == "assistant" for b in m["content"]]
    assert len(sent) == 2 * (3 + 9)
    for block in sent:
        BLOCK_PARAM.validate_python(block)  # nested contents are checked eagerly here
    for ok in (bash_ls, replaced, viewed):
        assert "error_code" not in ok


async def test_bad_blocks_and_closed_sandboxes_raise(agents_service: Service) -> None:
    sbx = await AsyncSandbox.create(url=agents_service.url, api_key=agents_service.api_key)
    await sbx.close()
    with pytest.raises(ValueError, match="is not a tool call"):
        await ahandle_code_execution_tool_use({"type": "text", "text": "hi"}, sbx)
    with pytest.raises(TypeError, match="expected a tool_use block"):
        await ahandle_code_execution_tool_use(42, sbx)
    with pytest.raises(ValueError, match="kernelhost answers code_execution"):
        await ahandle_code_execution_tool_use(
            {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}, sbx
        )
    # A closed handle is the developer's mistake: raised, not handed to the model.
    with pytest.raises(KernelHostError, match="is closed"):
        await ahandle_code_execution_tool_use(tool_use("toolu_x", "1"), sbx)
    with pytest.raises(KernelHostError, match="is closed"):
        await ahandle_code_execution_tool_use(
            {
                "type": "server_tool_use",
                "id": "s",
                "name": "bash_code_execution",
                "input": {"command": "true"},
            },
            sbx,
        )
