"""Anthropic Messages API: answer code-execution tool calls with a kernelhost sandbox.

The model asks for code to be run with a block in its response; ``handle_code_execution_tool_use``
runs it in the sandbox and returns the block that answers it. The shape of the answer follows
the block's ``name`` (the contracts of Anthropic's code execution tool, version 20250825):

=====================================================  ==========================================
block                                                  answer
=====================================================  ==========================================
``tool_use`` of your own tool, ``{"code": ...}``       ``tool_result``: text output, plots as
(e.g. ``code_execution_tool()``), or ``{"command"}``   ``image`` blocks, ``is_error`` on failure
``bash_code_execution`` ``{"command"}``                ``bash_code_execution_tool_result``
``text_editor_code_execution`` view/create/            ``text_editor_code_execution_tool_result``
str_replace
``server_tool_use`` ``code_execution`` ``{"code"}``    ``code_execution_tool_result``
=====================================================  ==========================================

A ``tool_result`` goes first in the next ``user`` message. The other three are the server tool's
own result blocks: in Messages API history each follows its ``server_tool_use`` block in the same
``assistant`` message; they are what a gateway emulating Anthropic's code execution on your own
sandboxes returns, with the error codes the API uses (``invalid_tool_input``, ``unavailable``,
``too_many_requests``, ``execution_time_exceeded``, ``file_not_found``).

The loop from Anthropic's tool-use docs, with a sandbox::

    import anthropic
    from kernelhost import Sandbox
    from kernelhost.integrations.anthropic import code_execution_tool, handle_code_execution_tool_use

    client = anthropic.Anthropic()
    messages = [{"role": "user", "content": "What is the 20th Fibonacci number?"}]
    with Sandbox() as sbx:
        while True:
            response = client.messages.create(model=..., max_tokens=1024,
                                              tools=[code_execution_tool()], messages=messages)
            messages.append({"role": "assistant", "content": response.content})
            if response.stop_reason != "tool_use":
                break
            messages.append({"role": "user", "content": [
                handle_code_execution_tool_use(block, sbx)
                for block in response.content if block.type == "tool_use"]})

``ahandle_code_execution_tool_use`` is the same for an ``AsyncSandbox``. Neither needs the
``anthropic`` package: blocks may be its objects or plain dicts, and answers are plain dicts.
A failing cell is an answer (``is_error``), never an exception; errors of the service (sandbox
gone, service unreachable) are answered too, except a bad API key, which raises.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from kernelhost.client import (
    APIError,
    AsyncSandbox,
    Execution,
    ExecutionStatus,
    KernelHostError,
    NotFoundError,
    RateLimitError,
    Sandbox,
)

from ._ops import (
    PathStat,
    Plan,
    ToolOutput,
    drive_async,
    drive_sync,
    files_list,
    files_read,
    files_write,
    run_code,
    run_for_model,
    service_failure,
    stat_path,
)
from .output import DEFAULT_BUDGET, OutputBudget, fit_texts, shape_execution, truncate_text

__all__ = [
    "DEFAULT_TIMEOUT",
    "ahandle_code_execution_tool_use",
    "code_execution_tool",
    "handle_code_execution_tool_use",
    "server_code_execution_tool",
]

#: Seconds a cell or command may run before it is interrupted, unless ``timeout=`` says otherwise.
DEFAULT_TIMEOUT = 120.0
#: The largest file ``view`` reads (bytes); images and PDFs are sent whole, so keep it modest.
VIEW_MAX_BYTES = 10 * 1024 * 1024

DEFAULT_DESCRIPTION = (
    "Run Python code in a persistent Jupyter kernel inside an isolated VM. Variables, imports "
    "and files persist between calls, as in a notebook. Returns stdout, stderr, the value of the "
    "last expression and any error with its traceback; plots and images come back as images. "
    "Use print() to see values, and !shell or subprocess for shell commands."
)

_EDITOR_COMMANDS = ("view", "create", "str_replace")
_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image"),
    (b"\xff\xd8\xff", "image"),
    (b"GIF8", "image"),
    (b"%PDF-", "pdf"),
)


def code_execution_tool(name: str = "run_python", description: str = DEFAULT_DESCRIPTION) -> dict[str, Any]:
    """The definition of a client tool that runs Python, for ``tools=`` of ``messages.create``.

    Its ``tool_use`` blocks carry ``{"code": ...}``. The default name is not ``code_execution``
    on purpose: that name belongs to Anthropic's own server tool, and a request may not carry two
    tools of one name.
    """
    return {
        "name": name,
        "description": description,
        "input_schema": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source to run in the kernel"}},
            "required": ["code"],
        },
    }


def server_code_execution_tool(version: str = "20250825") -> dict[str, Any]:
    """The definition of Anthropic's code execution server tool (``code_execution_<version>``).

    With Anthropic's API the code then runs in Anthropic's containers; give it to a gateway that
    emulates the tool with ``handle_code_execution_tool_use`` to run it in kernelhost instead.
    """
    if not (len(version) == 8 and version.isdigit()):
        raise ValueError(f"version={version!r}: use a date such as '20250825'")
    return {"type": f"code_execution_{version}", "name": "code_execution"}


def handle_code_execution_tool_use(
    block: Any,
    sbx: Sandbox,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    budget: OutputBudget = DEFAULT_BUDGET,
) -> dict[str, Any]:
    """Run a code-execution block from a Messages API response in ``sbx``; return the answer.

    ``block`` is a ``tool_use`` or ``server_tool_use`` block (an ``anthropic`` SDK object or a
    dict); see the module docstring for which answer each gets. ``timeout`` (seconds) stops code
    that runs longer; ``budget`` caps the text returned to the model.
    """
    return drive_sync(_plan(block, timeout, budget), sbx)


async def ahandle_code_execution_tool_use(
    block: Any,
    sbx: AsyncSandbox,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
    budget: OutputBudget = DEFAULT_BUDGET,
) -> dict[str, Any]:
    """``handle_code_execution_tool_use`` for an ``AsyncSandbox``."""
    return await drive_async(_plan(block, timeout, budget), sbx)


# -- the block ---------------------------------------------------------------------------------


def _as_dict(block: Any) -> dict[str, Any]:
    if isinstance(block, Mapping):
        data = dict(block)
    elif hasattr(block, "model_dump"):
        data = block.model_dump(mode="json")
    else:
        raise TypeError(
            f"expected a tool_use block (an anthropic SDK object or a dict), got "
            f"{type(block).__name__}: pass the items of response.content whose type is 'tool_use'"
        )
    kind = data.get("type")
    if kind not in ("tool_use", "server_tool_use"):
        raise ValueError(
            f"block type {kind!r} is not a tool call: pass only blocks whose type is 'tool_use' "
            "(or 'server_tool_use'); text and result blocks need no answer"
        )
    for key in ("id", "name"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"the {kind} block has no string {key!r}: {data!r:.200}")
    return data


def _plan(block: Any, timeout: float | None, budget: OutputBudget) -> Plan[dict[str, Any]]:
    data = _as_dict(block)
    name, tool_use_id = data["name"], data["id"]
    raw_input = data.get("input")
    args: dict[str, Any] = dict(raw_input) if isinstance(raw_input, Mapping) else {}
    if name == "bash_code_execution":
        return (yield from _bash_result(tool_use_id, args, timeout, budget))
    if name == "text_editor_code_execution":
        return (yield from _editor_result(tool_use_id, args, budget))
    if data["type"] == "server_tool_use":
        if name != "code_execution":
            raise ValueError(
                f"server tool {name!r} is not code execution; kernelhost answers code_execution, "
                "bash_code_execution and text_editor_code_execution only"
            )
        return (yield from _code_result(tool_use_id, args, timeout, budget))
    return (yield from _tool_result(tool_use_id, args, timeout, budget))


def _service_error(exc: KernelHostError) -> str:
    """The server tool's error code for a failure of the service (not of the user's code)."""
    service_failure(exc)  # a bad key or a closed handle raises: the developer must act
    if isinstance(exc, RateLimitError):
        return "too_many_requests"
    return "unavailable"


# -- client tools: tool_result -------------------------------------------------------------------


def _tool_result(
    tool_use_id: str, args: dict[str, Any], timeout: float | None, budget: OutputBudget
) -> Plan[dict[str, Any]]:
    code, command = args.get("code"), args.get("command")
    if isinstance(code, str):
        output = yield from run_for_model(code, "python", timeout, budget)
    elif isinstance(command, str):
        output = yield from run_for_model(command, "bash", timeout, budget)
    else:
        output = ToolOutput(
            f"Invalid input with keys {sorted(args)}: pass 'code' (a string of Python source) to "
            "run code, or 'command' (a string) to run a shell command.",
            [],
            True,
        )
    content: list[dict[str, Any]] = [{"type": "text", "text": output.text}]
    content += [
        {"type": "image", "source": {"type": "base64", "media_type": image.mime_type, "data": image.data}}
        for image in output.images
    ]
    return {
        "type": "tool_result",
        "tool_use_id": tool_use_id,
        "content": content,
        "is_error": output.is_error,
    }


# -- server tool shapes ------------------------------------------------------------------------


def _code_result(
    tool_use_id: str, args: dict[str, Any], timeout: float | None, budget: OutputBudget
) -> Plan[dict[str, Any]]:
    def answer(content: dict[str, Any]) -> dict[str, Any]:
        return {"type": "code_execution_tool_result", "tool_use_id": tool_use_id, "content": content}

    def error(code: str) -> dict[str, Any]:
        return answer({"type": "code_execution_tool_result_error", "error_code": code})

    code = args.get("code")
    if not isinstance(code, str):
        return error("invalid_tool_input")
    try:
        execution: Execution = yield run_code(code, "python", timeout)
    except KernelHostError as exc:
        return error(_service_error(exc))
    if execution.status == ExecutionStatus.TIMEOUT:
        return error("execution_time_exceeded")
    shaped = shape_execution(execution, budget)
    # stdout carries everything but stderr: prints, the cell's value, the traceback.
    (stdout, stderr), _ = fit_texts(
        [shaped.to_text(stderr=False, empty=""), shaped.stderr], budget.max_chars, budget.head_fraction
    )
    return answer(
        {
            "type": "code_execution_result",
            "stdout": stdout,
            "stderr": stderr,
            "return_code": 1 if shaped.is_error else 0,
            "content": [],
        }
    )


def _bash_result(
    tool_use_id: str, args: dict[str, Any], timeout: float | None, budget: OutputBudget
) -> Plan[dict[str, Any]]:
    def answer(content: dict[str, Any]) -> dict[str, Any]:
        return {"type": "bash_code_execution_tool_result", "tool_use_id": tool_use_id, "content": content}

    def error(code: str) -> dict[str, Any]:
        return answer({"type": "bash_code_execution_tool_result_error", "error_code": code})

    command = args.get("command")
    if not isinstance(command, str) or not command.strip():
        return error("invalid_tool_input")
    try:
        execution: Execution = yield run_code(command, "bash", timeout)
    except KernelHostError as exc:
        return error(_service_error(exc))
    if execution.status == ExecutionStatus.TIMEOUT:
        return error("execution_time_exceeded")
    if execution.exit_code is None:  # the command was cut off (its processes killed, VM lost)
        return error("unavailable")
    (stdout, stderr), _ = fit_texts(
        [execution.stdout, execution.stderr], budget.max_chars, budget.head_fraction
    )
    return answer(
        {
            "type": "bash_code_execution_result",
            "stdout": stdout,
            "stderr": stderr,
            "return_code": execution.exit_code,
            "content": [],
        }
    )


class _BadInput(Exception):
    """The model's input cannot be carried out; the message says why (``invalid_tool_input``)."""


class _FileNotFound(Exception):
    """The path does not exist (``file_not_found``); the message names it."""


def _editor_result(tool_use_id: str, args: dict[str, Any], budget: OutputBudget) -> Plan[dict[str, Any]]:
    def answer(content: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "text_editor_code_execution_tool_result",
            "tool_use_id": tool_use_id,
            "content": content,
        }

    def error(code: str, message: str | None = None) -> dict[str, Any]:
        content: dict[str, Any] = {"type": "text_editor_code_execution_tool_result_error", "error_code": code}
        if message is not None:
            content["error_message"] = message
        return answer(content)

    command, path = args.get("command"), args.get("path")
    try:
        if command not in _EDITOR_COMMANDS:
            raise _BadInput(f"command {command!r} is not one of {', '.join(_EDITOR_COMMANDS)}")
        if not isinstance(path, str) or not path:
            raise _BadInput("'path' must be a non-empty string (a file path)")
        if command == "create":
            text = args.get("file_text")
            if not isinstance(text, str):
                raise _BadInput("create needs 'file_text' (a string)")
            before = yield from stat_path(path)
            if before.kind == "dir":
                raise _BadInput(f"{path} is a directory; name a file to create")
            yield from _call(files_write(path, text.encode()), path)
            return answer(
                {
                    "type": "text_editor_code_execution_create_result",
                    "is_file_update": before.kind != "missing",
                }
            )
        if command == "view":
            return answer((yield from _view(path, args.get("view_range"), budget)))
        return answer((yield from _str_replace(path, args)))
    except _BadInput as exc:
        return error("invalid_tool_input", str(exc))
    except _FileNotFound as exc:
        return error("file_not_found", str(exc))
    except KernelHostError as exc:
        return error(_service_error(exc), str(exc))


def _call(request: Any, path: str) -> Plan[Any]:
    """Make one files.* call; turn the errors that concern the path into the tool's own."""
    try:
        return (yield request)
    except NotFoundError as exc:
        if exc.code == "file_not_found":
            raise _FileNotFound(f"{path} does not exist") from None
        raise
    except APIError as exc:
        if exc.code in ("file_operation_failed", "file_too_large", "invalid_request"):
            raise _BadInput(exc.message) from None
        raise


def _read_file(path: str, stat: PathStat | None = None) -> Plan[bytes]:
    """The bytes of a file of at most ``VIEW_MAX_BYTES``; a directory or larger file is bad
    input, a missing one ``_FileNotFound``. ``stat``: the path's, if already known."""
    if stat is None:
        stat = yield from stat_path(path)
    if stat.kind == "dir":
        raise _BadInput(f"{path} is a directory, not a file")
    if stat.size > VIEW_MAX_BYTES:
        raise _BadInput(
            f"{path} is {stat.size} bytes, over the {VIEW_MAX_BYTES}-byte limit "
            "here; work on it with a bash command instead"
        )
    data: bytes = yield from _call(files_read(path), path)
    return data


def _view(path: str, view_range: Any, budget: OutputBudget) -> Plan[dict[str, Any]]:
    result: dict[str, Any] = {"type": "text_editor_code_execution_view_result"}
    stat = yield from stat_path(path)
    if stat.kind == "dir":
        entries = yield from _call(files_list(path), path)
        listing = "\n".join(e.name + ("/" if e.type == "dir" else "") for e in entries)
        count = len(listing.splitlines())
        return {
            **result,
            "file_type": "text",
            "content": listing,
            "num_lines": count,
            "start_line": 1,
            "total_lines": count,
        }
    raw = yield from _read_file(path, stat)
    for magic, file_type in _IMAGE_MAGIC:
        if raw.startswith(magic):
            return {**result, "file_type": file_type, "content": base64.b64encode(raw).decode("ascii")}
    lines = raw.decode("utf-8", "replace").splitlines(keepends=True)
    start, end = 1, len(lines)
    if isinstance(view_range, list) and len(view_range) == 2 and all(isinstance(v, int) for v in view_range):
        start = max(1, view_range[0])
        end = len(lines) if view_range[1] == -1 else min(len(lines), view_range[1])
    shown = "".join(lines[start - 1 : end])
    return {
        **result,
        "file_type": "text",
        "content": truncate_text(shown, budget.max_chars, budget.head_fraction),
        "num_lines": max(0, end - start + 1),
        "start_line": start,
        "total_lines": len(lines),
    }


def _str_replace(path: str, args: dict[str, Any]) -> Plan[dict[str, Any]]:
    old, new = args.get("old_str"), args.get("new_str", "")
    if not isinstance(old, str) or not old or not isinstance(new, str):
        raise _BadInput("str_replace needs 'old_str' (a non-empty string) and 'new_str' (a string)")
    raw = yield from _read_file(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _BadInput(f"{path} is not UTF-8 text") from None
    count = text.count(old)
    if count != 1:
        raise _BadInput(
            f"old_str was not found in {path}"
            if count == 0
            else f"old_str occurs {count} times in {path}; include more surrounding "
            "lines so that it occurs exactly once"
        )
    yield from _call(files_write(path, text.replace(old, new, 1).encode()), path)
    # The hunk, in whole lines: the lines old_str touched, before and after the replacement.
    at = text.index(old)
    line_start = text.rfind("\n", 0, at) + 1
    newline = text.find("\n", at + len(old))
    line_end = len(text) if newline < 0 else newline
    before = text[line_start:line_end].split("\n")
    after = (text[line_start:at] + new + text[at + len(old) : line_end]).split("\n")
    start = text.count("\n", 0, at) + 1
    return {
        "type": "text_editor_code_execution_str_replace_result",
        "old_start": start,
        "old_lines": len(before),
        "new_start": start,
        "new_lines": len(after),
        "lines": [f"-{line}" for line in before] + [f"+{line}" for line in after],
    }
