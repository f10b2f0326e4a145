"""Unit tests of the agent-framework adapters (``kernelhost.integrations``), no VM needed.

Output shaping (budget, truncation marker, images) is tested on values; the adapters' logic is
driven with fake sandboxes (``integration_fakes``) that answer ``run_code`` from a script and keep
files in a dict, once through the blocking surface and once through the async one (both drive
the same plans). The checkpoint tools are tested in ``test_integrations_checkpoints``.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agents import ToolOutputImage, ToolOutputText
from anthropic import types as anthropic_types
from hypothesis import given
from hypothesis import strategies as st

from kernelhost import (
    AuthenticationError,
    Execution,
    ExecutionError,
    ExecutionStatus,
    KernelHostError,
    RateLimitError,
    Result,
    Sandbox,
    TransportError,
)
from kernelhost.integrations import anthropic as anthropic_adapter
from kernelhost.integrations._ops import drive_async, drive_sync, stat_path
from kernelhost.integrations.openai_agents import PARAMETERS, code_interpreter_tool
from kernelhost.integrations.output import (
    MIN_MAX_CHARS,
    OutputBudget,
    fit_texts,
    shape_execution,
    strip_ansi,
    truncate_text,
)

from .integration_fakes import AsyncFakeSandbox, FakeSandbox, as_sandbox, handle_both

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"\n\[\.\.\. (\d+) of (\d+) characters truncated \.\.\.\]\n")


# -- output shaping ----------------------------------------------------------------------------


def test_text_that_fits_is_unchanged() -> None:
    assert truncate_text("abc", 100) == "abc"
    assert truncate_text("x" * 100, 100) == "x" * 100


@given(st.text(min_size=0, max_size=3000), st.integers(MIN_MAX_CHARS, 2000), st.floats(0, 1))
def test_truncation_keeps_head_and_tail_within_the_budget(text: str, limit: int, head: float) -> None:
    out = truncate_text(text, limit, head)
    assert len(out) <= limit
    if len(text) <= limit:
        assert out == text
        return
    match = MARKER.search(out)
    assert match, out
    omitted, total = int(match[1]), int(match[2])
    assert total == len(text)
    kept_head, kept_tail = out[: match.start()], out[match.end() :]
    assert omitted == len(text) - len(kept_head) - len(kept_tail)
    assert text.startswith(kept_head) and text.endswith(kept_tail)
    assert len(out) >= limit - 1  # the budget is used, not wasted


def test_head_fraction_and_tiny_limits() -> None:
    text = "h" * 500 + "t" * 500
    assert truncate_text(text, 200, 1.0).endswith("truncated ...]\n")
    assert truncate_text(text, 200, 0.0).startswith("\n[... ")
    assert re.fullmatch(r"h+\[\.\.\.\d+ cut\.\.\.\]t+", truncate_text(text, 40))
    assert truncate_text(text, 5) == "hhhhh"
    with pytest.raises(ValueError, match="use 0 or more"):
        truncate_text(text, -1)


def test_fit_texts_shares_the_budget() -> None:
    texts = ["short", "y" * 10_000, "z" * 10_000]
    out, cut = fit_texts(texts, 1000)
    assert cut and out[0] == "short"
    assert sum(map(len, out)) <= 1000
    assert min(len(out[1]), len(out[2])) >= 490
    assert fit_texts(["a", "b"], 100) == (["a", "b"], False)


def test_budget_errors_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"max_chars=99\): use an int of at least 100"):
        OutputBudget(max_chars=99)
    with pytest.raises(ValueError, match=r"head_fraction=1.5\): use a number from 0"):
        OutputBudget(head_fraction=1.5)
    with pytest.raises(ValueError, match="use 0 or more"):
        OutputBudget(max_images=-1)


def png_result(main: bool = False) -> Result:
    return Result(data={"image/png": "iVBORw0K\nGgo=", "text/plain": "<Figure>"}, is_main_result=main)


def test_shape_execution_renders_everything_a_model_needs() -> None:
    execution = Execution(
        stdout="out\n",
        stderr="warn\n",
        results=[
            Result(data={"text/html": "<b>x</b>", "text/plain": "X"}),
            png_result(),
            Result(data={"text/plain": "42"}, is_main_result=True),
        ],
        error=ExecutionError("ValueError", "bad", ["\x1b[31mTraceback\x1b[0m", "ValueError: bad"]),
        execution_count=3,
        status=ExecutionStatus.ERROR,
    )
    shaped = shape_execution(execution)
    assert shaped.to_text() == (
        "out\n[stderr]\nwarn\nX\n<image 1: image/png, attached>\nOut[3]: 42\nTraceback\nValueError: bad"
    )
    assert shaped.images[0].data == "iVBORw0KGgo="  # base64 line breaks removed
    assert shaped.images[0].data_url() == "data:image/png;base64,iVBORw0KGgo="
    assert shaped.is_error
    fields = shaped.to_dict()
    assert fields["error"] == {
        "name": "ValueError",
        "value": "bad",
        "traceback": "Traceback\nValueError: bad",
    }
    assert fields["result"] == "42" and fields["images"] == 1 and not fields["truncated"]


def test_shape_execution_image_budget_timeout_and_bash_exit_code() -> None:
    many = Execution(results=[png_result() for _ in range(3)])
    shaped = shape_execution(many, OutputBudget(max_images=2))
    assert len(shaped.images) == 2 and shaped.omitted_images == 1
    assert "[1 more image(s) not shown" in shaped.to_text()
    assert shape_execution(Execution(status=ExecutionStatus.TIMEOUT)).to_text().startswith("[timed out: ")
    assert shape_execution(Execution()).to_text() == "[no output]"
    bash = Execution(
        stdout="x\n",
        status=ExecutionStatus.ERROR,
        exit_code=3,
        error=ExecutionError("CommandFailed", "the command exited with code 3"),
    )
    assert shape_execution(bash).to_text() == "x\n[exit code 3]"
    assert shape_execution(bash).to_dict()["exit_code"] == 3
    budget = OutputBudget(max_chars=200)
    long = shape_execution(Execution(stdout="a" * 1000, stderr="b" * 1000), budget)
    assert len(long.to_text()) <= 200
    assert long.to_dict()["truncated"] is True
    assert strip_ansi("\x1b[1;32mok\x1b[0m") == "ok"


# -- the Anthropic adapter -----------------------------------------------------------------------


def test_client_tool_python_answers_with_text_and_images() -> None:
    block = {"type": "tool_use", "id": "toolu_1", "name": "run_python", "input": {"code": "x"}}
    answer = handle_both(
        block, lambda: FakeSandbox(Execution(stdout="hi\n", results=[png_result()], execution_count=1))
    )
    assert answer == {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "is_error": False,
        "content": [
            {"type": "text", "text": "hi\n<image 1: image/png, attached>"},
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
            },
        ],
    }


def test_client_tool_bash_and_bad_input() -> None:
    bash = {"type": "tool_use", "id": "t", "name": "bash", "input": {"command": "false"}}
    answer = handle_both(
        bash,
        lambda: FakeSandbox(
            Execution(
                status=ExecutionStatus.ERROR, exit_code=1, error=ExecutionError("CommandFailed", "exit 1")
            )
        ),
    )
    assert answer["is_error"] and answer["content"][0]["text"] == "[exit code 1]"
    bad = {"type": "tool_use", "id": "t", "name": "run_python", "input": {"src": "1"}}
    answer = handle_both(bad, FakeSandbox)
    assert answer["is_error"] and "pass 'code'" in answer["content"][0]["text"]


def test_service_failures_become_answers_but_bad_keys_raise() -> None:
    block = {"type": "tool_use", "id": "t", "name": "run_python", "input": {"code": "1"}}
    down = handle_both(block, lambda: FakeSandbox(TransportError("cannot reach kernelhost")))
    assert down["is_error"] and "cannot reach kernelhost" in down["content"][0]["text"]
    server = {
        "type": "server_tool_use",
        "id": "s",
        "name": "bash_code_execution",
        "input": {"command": "true"},
    }
    busy = handle_both(
        server, lambda: FakeSandbox(RateLimitError("slow down", status=429, code="capacity_exceeded"))
    )
    assert busy["content"] == {
        "type": "bash_code_execution_tool_result_error",
        "error_code": "too_many_requests",
    }
    for exc in (
        AuthenticationError("bad key", status=401, code="unauthorized"),
        KernelHostError("sandbox sbx_1 is closed"),
    ):
        with pytest.raises(type(exc)):
            anthropic_adapter.handle_code_execution_tool_use(block, as_sandbox(FakeSandbox(exc)))


def test_bash_server_tool_result_shapes() -> None:
    block = {
        "type": "server_tool_use",
        "id": "srv",
        "name": "bash_code_execution",
        "input": {"command": "ls"},
    }
    ok = handle_both(block, lambda: FakeSandbox(Execution(stdout="a\n", stderr="", exit_code=0)))
    assert ok == {
        "type": "bash_code_execution_tool_result",
        "tool_use_id": "srv",
        "content": {
            "type": "bash_code_execution_result",
            "stdout": "a\n",
            "stderr": "",
            "return_code": 0,
            "content": [],
        },
    }
    slow = handle_both(block, lambda: FakeSandbox(Execution(status=ExecutionStatus.TIMEOUT, exit_code=130)))
    assert slow["content"]["error_code"] == "execution_time_exceeded"
    lost = handle_both(block, lambda: FakeSandbox(Execution(status=ExecutionStatus.KERNEL_DIED)))
    assert lost["content"]["error_code"] == "unavailable"
    empty = handle_both({**block, "input": {"command": " "}}, FakeSandbox)
    assert empty["content"]["error_code"] == "invalid_tool_input"


def editor(command: str, path: str, **fields: Any) -> dict[str, Any]:
    return {
        "type": "server_tool_use",
        "id": "ed",
        "name": "text_editor_code_execution",
        "input": {"command": command, "path": path, **fields},
    }


def test_text_editor_create_view_and_str_replace() -> None:
    fake = FakeSandbox()

    def handle(block: dict[str, Any], sbx: FakeSandbox) -> dict[str, Any]:
        return anthropic_adapter.handle_code_execution_tool_use(block, as_sandbox(sbx))

    created = handle(editor("create", "src/m.py", file_text="a = 1\nb = 2\nc = 3\n"), fake)
    assert created["content"] == {"type": "text_editor_code_execution_create_result", "is_file_update": False}
    again = handle(editor("create", "src/m.py", file_text="a = 1\nb = 2\nc = 3\n"), fake)
    assert again["content"]["is_file_update"] is True
    replaced = handle(editor("str_replace", "src/m.py", old_str="b = 2\nc", new_str="B = 2\nC"), fake)
    assert replaced["content"] == {
        "type": "text_editor_code_execution_str_replace_result",
        "old_start": 2,
        "old_lines": 2,
        "new_start": 2,
        "new_lines": 2,
        "lines": ["-b = 2", "-c = 3", "+B = 2", "+C = 3"],
    }
    assert fake.files.data["/home/user/src/m.py"] == b"a = 1\nB = 2\nC = 3\n"
    viewed = handle(editor("view", "src/m.py", view_range=[2, -1]), fake)
    assert viewed["content"] == {
        "type": "text_editor_code_execution_view_result",
        "file_type": "text",
        "content": "B = 2\nC = 3\n",
        "num_lines": 2,
        "start_line": 2,
        "total_lines": 3,
    }
    listing = handle(editor("view", "src"), fake)["content"]
    assert listing["content"] == "m.py"
    fake.files.write("/tmp/p.png", b"\x89PNG\r\n\x1a\n....")
    image = handle(editor("view", "/tmp/p.png"), fake)["content"]
    assert image["file_type"] == "image" and image["content"].startswith("iVBORw0KGgo")
    assert fake.calls == []  # the editor uses the files API only


@pytest.mark.parametrize(
    ("block", "code", "message"),
    [
        (editor("view", "/tmp/none"), "file_not_found", "/tmp/none does not exist"),
        (
            editor("str_replace", "/tmp/none", old_str="a", new_str="b"),
            "file_not_found",
            "/tmp/none does not exist",
        ),
        (
            editor("str_replace", "/tmp/f", old_str="zz", new_str=""),
            "invalid_tool_input",
            "old_str was not found in /tmp/f",
        ),
        (
            editor("str_replace", "/tmp/f", old_str="a", new_str=""),
            "invalid_tool_input",
            "old_str occurs 2 times in /tmp/f; include more surrounding lines",
        ),
        (editor("str_replace", "/tmp/f", old_str=""), "invalid_tool_input", "needs 'old_str'"),
        (editor("undo_edit", "/tmp/f"), "invalid_tool_input", "is not one of view, create"),
        (editor("create", "/tmp/g"), "invalid_tool_input", "create needs 'file_text'"),
        (editor("create", "/tmp", file_text=""), "invalid_tool_input", "is a directory"),
        (editor("view", ""), "invalid_tool_input", "'path' must be a non-empty string"),
    ],
)
def test_text_editor_errors(block: dict[str, Any], code: str, message: str) -> None:
    def make() -> FakeSandbox:
        fake = FakeSandbox()
        fake.files.write("/tmp/f", b"a a\n")
        return fake

    answer = handle_both(block, make)
    assert answer["type"] == "text_editor_code_execution_tool_result"
    assert answer["content"]["type"] == "text_editor_code_execution_tool_result_error"
    assert answer["content"]["error_code"] == code
    assert message in answer["content"]["error_message"]


def test_blocks_may_be_sdk_objects_and_tool_definitions() -> None:
    block = anthropic_types.ToolUseBlock(
        type="tool_use", id="toolu_9", name="run_python", input={"code": "1 + 1"}
    )
    fake = FakeSandbox(
        Execution(results=[Result({"text/plain": "2"}, is_main_result=True)], execution_count=7)
    )
    answer = anthropic_adapter.handle_code_execution_tool_use(block, as_sandbox(fake), timeout=5)
    assert answer["content"][0]["text"] == "Out[7]: 2"
    assert fake.calls == [("1 + 1", "python", 5)]
    tool = anthropic_adapter.code_execution_tool()
    assert tool["name"] == "run_python" and tool["input_schema"]["required"] == ["code"]
    with pytest.raises(ValueError, match="use a date such as '20250825'"):
        anthropic_adapter.server_code_execution_tool("latest")


def test_stat_path_reads_the_parent_listing() -> None:
    fake = FakeSandbox()
    fake.files.write("data/x.csv", b"1,2\n")
    stat = drive_sync(stat_path("data/x.csv"), as_sandbox(fake))
    assert (stat.kind, stat.size, stat.path) == ("file", 4, "/home/user/data/x.csv")
    assert drive_sync(stat_path("data"), as_sandbox(fake)).kind == "dir"
    assert drive_sync(stat_path("nope/x"), as_sandbox(fake)).kind == "missing"
    assert drive_sync(stat_path("/"), as_sandbox(fake)).kind == "dir"
    got = asyncio.run(drive_async(stat_path("data/x.csv"), AsyncFakeSandbox(fake)))  # type: ignore[arg-type]
    assert got == stat


# -- the OpenAI Agents adapter ----------------------------------------------------------------


def test_openai_agents_tool_outputs_and_bad_arguments() -> None:
    fake = FakeSandbox(Execution(stdout="plot\n", results=[png_result()]), Execution(stdout="1\n"))
    tool = code_interpreter_tool(Sandbox.__new__(Sandbox), name="py", timeout=9)
    tool._holder._sandbox = AsyncFakeSandbox(fake)  # type: ignore[assignment]
    assert tool.name == "py" and tool.params_json_schema == PARAMETERS
    with_image: Any = asyncio.run(
        tool.on_invoke_tool(
            None,  # type: ignore[arg-type]  # no run context: the tool never reads it
            json.dumps({"code": "plot()", "language": "python"}),
        )
    )
    assert isinstance(with_image[0], ToolOutputText)
    assert isinstance(with_image[1], ToolOutputImage)
    assert with_image[1].image_url == "data:image/png;base64,iVBORw0KGgo="
    text: Any = asyncio.run(
        tool.on_invoke_tool(
            None,  # type: ignore[arg-type]  # no run context: the tool never reads it
            json.dumps({"code": "echo 1", "language": "bash"}),
        )
    )
    assert text == "1"
    assert fake.calls == [("plot()", "python", 9), ("echo 1", "bash", 9)]
    bad: Any = asyncio.run(tool.on_invoke_tool(None, "{nope"))  # type: ignore[arg-type]
    assert "not valid JSON" in bad
    missing: Any = asyncio.run(tool.on_invoke_tool(None, '{"language": "python"}'))  # type: ignore[arg-type]
    assert "Missing 'code'" in missing
    with pytest.raises(TypeError, match="AsyncSandbox or Sandbox"):
        code_interpreter_tool("sbx_123")  # type: ignore[arg-type]


# -- MCP over HTTP, and the command line --------------------------------------------------------


def test_loopback_url_for_wildcard_addresses() -> None:
    from kernelhost.api.mcp_http import loopback_url
    from kernelhost.config import Settings

    assert loopback_url(Settings(host="0.0.0.0", port=8999)) == "http://127.0.0.1:8999"
    assert loopback_url(Settings(host="::", port=80)) == "http://[::1]:80"
    assert loopback_url(Settings(host="10.0.0.5", port=1)) == "http://10.0.0.5:1"


def test_mcp_command_rejects_a_budget_too_small() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kernelhost.cli", "mcp", "--max-output-chars", "5"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 2
    assert "--max-output-chars" in proc.stderr and "at least 100" in proc.stderr
