"""Unit tests of the checkpoint tools (``checkpoint``, ``restore``, ``undo``) of the adapters and
the MCP server, no VM needed: fake sandboxes (``integration_fakes``) answer the SDK's checkpoint
methods like the service; the MCP server is driven in-process by the ``mcp`` library's client,
with the SDK's ``AsyncSandbox`` replaced by a fake in its handle cache."""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

import pytest
from agents import FunctionTool
from mcp import Client

from kernelhost import AsyncSandbox, AuthenticationError, Execution, Sandbox, TransportError
from kernelhost.integrations import _mcp_handles
from kernelhost.integrations import anthropic as anthropic_adapter
from kernelhost.integrations._checkpoint_tools import (
    CHECKPOINT_DESCRIPTION,
    LIST_CHECKPOINTS_REMEDY,
    RESTORE_DESCRIPTION,
    input_schema,
    tool_specs,
)
from kernelhost.integrations.mcp_server import create_server, fixed_credentials
from kernelhost.integrations.openai_agents import checkpoint_tools, code_interpreter_tool

from .integration_fakes import AsyncFakeSandbox, FakeSandbox, as_sandbox, handle_both

pytestmark = pytest.mark.unit

NAMES = ["checkpoint", "restore", "undo"]


# -- what the tools tell a model --------------------------------------------------------------


@pytest.mark.parametrize("method", ["checkpoint", "checkpoints", "restore", "undo", "delete_checkpoint"])
def test_the_fakes_have_the_sdks_checkpoint_methods(method: str) -> None:
    def params(fn: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(getattr(FakeSandbox, method)) == params(getattr(Sandbox, method))
    assert params(getattr(AsyncFakeSandbox, method)) == params(getattr(AsyncSandbox, method))


def test_the_specs_name_three_tools_with_their_schemas() -> None:
    specs = tool_specs(False)
    assert [name for name, _, _ in specs] == NAMES
    schemas = {name: schema for name, _, schema in specs}
    assert schemas["checkpoint"]["properties"]["label"]["type"] == "string"
    assert schemas["checkpoint"]["required"] == [] and schemas["undo"]["required"] == []
    assert schemas["restore"]["required"] == ["checkpoint_id"]
    assert schemas["undo"]["properties"]["n"]["type"] == "integer"
    assert all(s["additionalProperties"] is False for s in schemas.values())
    strict = input_schema("checkpoint", strict=True)  # OpenAI: all required, optional ones nullable
    assert strict["required"] == ["label"] and strict["properties"]["label"]["type"] == ["string", "null"]
    assert input_schema("restore", strict=True)["properties"]["checkpoint_id"]["type"] == "string"


def test_the_descriptions_say_when_and_what() -> None:
    assert "before a destructive or exploratory step" in CHECKPOINT_DESCRIPTION
    assert "variables, imports and" in RESTORE_DESCRIPTION and "same sandbox" in RESTORE_DESCRIPTION
    off = tool_specs(False)[2][1]
    assert "works only if the sandbox keeps automatic checkpoints" in off
    assert "n can be 1 to 5" in tool_specs(True)[2][1]
    assert "n can be 1 to 3" in tool_specs(3)[2][1]


# -- the Anthropic adapter -----------------------------------------------------------------------


def tool_use(name: str, **args: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_c", "name": name, "input": args}


def text_of(answer: dict[str, Any]) -> str:
    assert answer["type"] == "tool_result" and answer["tool_use_id"] == "toolu_c"
    return str(answer["content"][0]["text"])


def test_anthropic_checkpoint_tools_are_client_tool_definitions() -> None:
    tools = anthropic_adapter.checkpoint_tools()
    assert [t["name"] for t in tools] == NAMES
    assert tools[1]["input_schema"]["required"] == ["checkpoint_id"]
    assert tools[0]["description"] == CHECKPOINT_DESCRIPTION
    assert "n can be 1 to 5" in anthropic_adapter.checkpoint_tools(auto_checkpoint=True)[2]["description"]


def test_anthropic_checkpoint_restore_and_undo_call_the_sandbox() -> None:
    fake = FakeSandbox(auto_checkpoint=True)

    def handle(block: dict[str, Any]) -> dict[str, Any]:
        return anthropic_adapter.handle_code_execution_tool_use(block, as_sandbox(fake))

    saved = handle(tool_use("checkpoint", label="before cleanup"))
    assert not saved["is_error"]
    assert 'checkpoint cp_1 "before cleanup"' in text_of(saved)
    assert 'call restore with checkpoint_id "cp_1"' in text_of(saved)
    restored = handle(tool_use("restore", checkpoint_id="cp_1"))
    assert not restored["is_error"] and "Sandbox sbx_fake is back at checkpoint cp_1" in text_of(restored)
    undone = handle(tool_use("undo", n=2))
    assert "Undid the last 2 code execution(s)" in text_of(undone)
    assert handle(tool_use("undo"))["is_error"] is False  # n defaults to 1
    assert fake.checkpoint_calls == [
        ("checkpoint", "before cleanup"),
        ("restore", "cp_1"),
        ("undo", 2),
        ("undo", 1),
    ]
    assert fake.calls == []  # no code ran


def test_anthropic_checkpoint_tools_answer_failures_for_the_model() -> None:
    no_auto = handle_both(tool_use("undo"), FakeSandbox)
    assert no_auto["is_error"]
    assert "undo is not available: this sandbox keeps no automatic checkpoints" in text_of(no_auto)
    assert "checkpoint before risky steps" in text_of(no_auto) and "auto_checkpoint=True" in text_of(no_auto)
    unknown = handle_both(tool_use("restore", checkpoint_id="cp_9"), FakeSandbox)
    assert unknown["is_error"] and LIST_CHECKPOINTS_REMEDY in text_of(unknown)
    assert "GET /v1" not in text_of(unknown)  # the REST advice is not the model's

    def down() -> FakeSandbox:
        fake = FakeSandbox()
        fake.checkpoint_failure = TransportError("cannot reach kernelhost")
        return fake

    failed = handle_both(tool_use("checkpoint"), down)
    assert failed["is_error"] and text_of(failed) == "checkpoint failed: cannot reach kernelhost"
    for block, message in [
        (tool_use("restore"), "Missing 'checkpoint_id'"),
        (tool_use("undo", n=0), "n must be a positive integer"),
        (tool_use("undo", n=True), "n must be a positive integer"),
        (tool_use("checkpoint", label=3), "label must be a string"),
    ]:
        fake = FakeSandbox(auto_checkpoint=True)
        answer = anthropic_adapter.handle_code_execution_tool_use(block, as_sandbox(fake))
        assert answer["is_error"] and message in text_of(answer)
        assert fake.checkpoint_calls == []  # bad input calls nothing
    bad_key = FakeSandbox()
    bad_key.checkpoint_failure = AuthenticationError("bad key", status=401, code="unauthorized")
    with pytest.raises(AuthenticationError):
        anthropic_adapter.handle_code_execution_tool_use(tool_use("checkpoint"), as_sandbox(bad_key))


# -- the OpenAI Agents adapter -------------------------------------------------------------------


def invoke(tool: FunctionTool, **args: Any) -> str:
    raw = json.dumps(args)
    return str(asyncio.run(tool.on_invoke_tool(None, raw)))  # type: ignore[arg-type]  # context unused


def test_openai_agents_checkpoint_tools_share_the_interpreters_sandbox() -> None:
    fake = FakeSandbox(Execution(stdout="1\n"), auto_checkpoint=True)
    interpreter = code_interpreter_tool(Sandbox.__new__(Sandbox))
    interpreter._holder._sandbox = AsyncFakeSandbox(fake)  # type: ignore[assignment]
    tools = checkpoint_tools(interpreter)
    assert [t.name for t in tools] == NAMES
    assert all(isinstance(t, FunctionTool) and t.strict_json_schema for t in tools)
    checkpoint, restore, undo = tools
    assert checkpoint.params_json_schema["required"] == ["label"]
    assert checkpoint.params_json_schema["properties"]["label"]["type"] == ["string", "null"]
    assert restore.params_json_schema["required"] == ["checkpoint_id"]
    assert "works only if the sandbox keeps automatic checkpoints" in undo.description  # not known
    assert 'checkpoint_id "cp_1"' in invoke(checkpoint, label=None)
    assert "back at checkpoint cp_1" in invoke(restore, checkpoint_id="cp_1")
    assert "Undid the last 1 code execution(s)" in invoke(undo, n=None)
    assert fake.checkpoint_calls == [("checkpoint", None), ("restore", "cp_1"), ("undo", 1)]
    assert "not valid JSON" in str(asyncio.run(restore.on_invoke_tool(None, "{no")))  # type: ignore[arg-type]
    assert "Missing 'checkpoint_id'" in invoke(restore, checkpoint_id=None)


def test_openai_agents_undo_needs_the_auto_checkpoint_option() -> None:
    fake = FakeSandbox()
    interpreter = code_interpreter_tool(Sandbox.__new__(Sandbox))
    interpreter._holder._sandbox = AsyncFakeSandbox(fake)  # type: ignore[assignment]
    text = invoke(checkpoint_tools(interpreter)[2], n=1)
    assert text.startswith("undo is not available")
    assert "code_interpreter_tool(auto_checkpoint=True)" in text
    owned = code_interpreter_tool(auto_checkpoint=True)  # creates its sandbox on first use, so
    assert owned._holder._options["auto_checkpoint"] is True  # this goes to Sandbox(...)
    assert "n can be 1 to 5" in checkpoint_tools(owned)[2].description
    assert code_interpreter_tool()._holder._options["auto_checkpoint"] is False


# -- the MCP server ------------------------------------------------------------------------------


class FakeSdk:
    """Stands for ``AsyncSandbox`` in the MCP server's handle cache: ``create`` and ``connect``
    answer fakes, kept by id, and ``created`` records each creation's options."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, AsyncFakeSandbox] = {}
        self.created: list[dict[str, Any]] = []

    def add(self, fake: FakeSandbox) -> AsyncFakeSandbox:
        self.sandboxes[fake.id] = AsyncFakeSandbox(fake)
        return self.sandboxes[fake.id]

    async def create(self, **options: Any) -> AsyncFakeSandbox:
        self.created.append(options)
        fake = FakeSandbox(
            auto_checkpoint=bool(options.get("auto_checkpoint")), sandbox_id=f"sbx_{len(self.created)}"
        )
        return self.add(fake)

    async def connect(
        self, sandbox_id: str, url: str | None = None, api_key: str | None = None
    ) -> AsyncFakeSandbox:
        return self.sandboxes[sandbox_id]


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> FakeSdk:
    fake = FakeSdk()
    monkeypatch.setattr(_mcp_handles, "AsyncSandbox", fake)
    return fake


def mcp_client(**options: Any) -> Client:
    return Client(create_server(fixed_credentials("http://kernelhost.invalid", "key"), **options))


async def test_mcp_lists_the_checkpoint_tools_with_their_schemas(sdk: FakeSdk) -> None:
    async with mcp_client(auto_checkpoint=True) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(NAMES) <= set(tools) and len(tools) == 12
    checkpoint, restore, undo = (tools[name] for name in NAMES)
    assert (
        checkpoint.input_schema["required"] == ["sandbox_id"]
        and "label" in checkpoint.input_schema["properties"]
    )
    assert set(restore.input_schema["required"]) == {"sandbox_id", "checkpoint_id"}
    assert undo.input_schema["required"] == ["sandbox_id"]
    assert undo.input_schema["properties"]["n"]["default"] == 1
    assert checkpoint.output_schema is not None and "checkpoint_id" in checkpoint.output_schema["properties"]
    assert restore.output_schema is not None and "checkpoint" in restore.output_schema["properties"]
    assert checkpoint.description and "before a destructive or exploratory step" in checkpoint.description
    assert restore.description and "variables, imports and" in restore.description
    assert undo.description and "Sandboxes this server creates" in undo.description
    assert undo.annotations is not None and undo.annotations.destructive_hint is True


async def test_mcp_checkpoint_restore_and_undo(sdk: FakeSdk) -> None:
    async with mcp_client(auto_checkpoint=True) as client:
        created = await client.call_tool("create_sandbox", {})
        sandbox_id = created.structured_content["sandbox_id"]
        assert sdk.created[0]["auto_checkpoint"] is True  # asked for: undo works
        saved = await client.call_tool("checkpoint", {"sandbox_id": sandbox_id, "label": "before"})
        assert not saved.is_error
        assert saved.structured_content is not None and saved.structured_content["checkpoint_id"] == "cp_1"
        assert saved.structured_content["label"] == "before" and saved.structured_content["auto"] is False
        text = saved.content[0].text  # type: ignore[union-attr]
        assert f'call restore with sandbox_id "{sandbox_id}" and checkpoint_id "cp_1"' in text
        back = await client.call_tool("restore", {"sandbox_id": sandbox_id, "checkpoint_id": "cp_1"})
        assert back.structured_content == {"sandbox_id": sandbox_id, "checkpoint": saved.structured_content}
        undone = await client.call_tool("undo", {"sandbox_id": sandbox_id, "n": 1})
        assert not undone.is_error and undone.structured_content is not None
        assert undone.structured_content["checkpoint"]["auto"] is True
        assert "Undid the last 1 code execution(s)" in undone.content[0].text  # type: ignore[union-attr]
    fake = sdk.sandboxes[sandbox_id].sync
    assert fake.checkpoint_calls == [("checkpoint", "before"), ("restore", "cp_1"), ("undo", 1)]


async def test_mcp_checkpoint_failures_are_tool_errors_in_its_terms(sdk: FakeSdk) -> None:
    sdk.add(FakeSandbox(sandbox_id="sbx_elsewhere"))  # created without auto_checkpoint
    sdk.add(FakeSandbox(sandbox_id="sbx_auto", auto_checkpoint=True))
    async with mcp_client(auto_checkpoint=True) as client:
        no_auto = await client.call_tool("undo", {"sandbox_id": "sbx_elsewhere"})
        unknown = await client.call_tool("restore", {"sandbox_id": "sbx_elsewhere", "checkpoint_id": "cp_7"})
        bad_n = await client.call_tool("undo", {"sandbox_id": "sbx_auto", "n": 0})
    assert no_auto.is_error
    text = no_auto.content[0].text  # type: ignore[union-attr]
    assert "undo is not available: sandbox sbx_elsewhere keeps no automatic checkpoints" in text
    assert "forks and sandboxes created elsewhere do not" in text
    assert unknown.is_error
    assert LIST_CHECKPOINTS_REMEDY in unknown.content[0].text  # type: ignore[union-attr]
    assert "GET /v1" not in unknown.content[0].text  # type: ignore[union-attr]
    assert bad_n.is_error and "n must be a positive int" in bad_n.content[0].text  # type: ignore[union-attr]


async def test_mcp_auto_checkpoint_can_be_turned_off(sdk: FakeSdk) -> None:
    async with mcp_client(auto_checkpoint=False) as client:
        undo = next(t for t in (await client.list_tools()).tools if t.name == "undo")
        assert undo.description and "creates sandboxes without automatic checkpoints" in undo.description
        ran = await client.call_tool("create_sandbox", {})
        sandbox_id = ran.structured_content["sandbox_id"]
        refused = await client.call_tool("undo", {"sandbox_id": sandbox_id})
    assert sdk.created[0]["auto_checkpoint"] is False
    assert refused.is_error and "its auto_checkpoint option is off" in refused.content[0].text  # type: ignore[union-attr]
