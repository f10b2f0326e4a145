"""Anthropic Messages API: answer code-execution tool calls with a kernelhost sandbox.

The model asks for code to be run with a block in its response; ``handle_code_execution_tool_use``
runs it in the sandbox and returns the block that answers it. The shape of the answer follows
the block's ``name`` (the contracts of Anthropic's code execution tool, version 20250825):

=====================================================  ==========================================
block                                                  answer
=====================================================  ==========================================
``tool_use`` of your own tool, ``{"code": ...}``       ``tool_result``: text output, plots as
(e.g. ``code_execution_tool()``), or ``{"command"}``   ``image`` blocks, ``is_error`` on failure
``tool_use`` named ``checkpoint``, ``restore`` or      ``tool_result``: what was saved or rewound
``undo`` (``checkpoint_tools()``)
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
    from kernelhost.integrations.anthropic import (
        checkpoint_tools, code_execution_tool, handle_code_execution_tool_use)

    client = anthropic.Anthropic()
    messages = [{"role": "user", "content": "What is the 20th Fibonacci number?"}]
    with Sandbox() as sbx:
        while True:
            response = client.messages.create(model=..., max_tokens=1024,
                                              tools=[code_execution_tool(), *checkpoint_tools()],
                                              messages=messages)
            messages.append({"role": "assistant", "content": response.content})
            if response.stop_reason != "tool_use":
                break
            messages.append({"role": "user", "content": [
                handle_code_execution_tool_use(block, sbx)
                for block in response.content if block.type == "tool_use"]})

``checkpoint_tools()`` adds ``checkpoint``, ``restore`` and ``undo`` (the model saves the state
before a risky step and rewinds to it; ``undo`` needs a sandbox created with ``auto_checkpoint``).
``ahandle_code_execution_tool_use`` is the same for an ``AsyncSandbox``. Neither needs the
``anthropic`` package: blocks may be its objects or plain dicts, and answers are plain dicts.
A failing cell is an answer (``is_error``), never an exception; errors of the service (sandbox
gone, service unreachable) are answered too, except a bad API key, which raises.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelhost.client import AsyncSandbox, Execution, ExecutionStatus, KernelHostError, Sandbox

from ._anthropic_editor import VIEW_MAX_BYTES as VIEW_MAX_BYTES  # the limit of view, documented here
from ._anthropic_editor import editor_result, service_error
from ._checkpoint_tools import NAMES, run_checkpoint_tool, tool_specs
from ._ops import Plan, ToolOutput, drive_async, drive_sync, run_code, run_for_model
from .output import DEFAULT_BUDGET, OutputBudget, fit_texts, shape_execution

__all__ = [
    "DEFAULT_TIMEOUT",
    "ahandle_code_execution_tool_use",
    "checkpoint_tools",
    "code_execution_tool",
    "handle_code_execution_tool_use",
    "server_code_execution_tool",
]

#: Seconds a cell or command may run before it is interrupted, unless ``timeout=`` says otherwise.
DEFAULT_TIMEOUT = 120.0

DEFAULT_DESCRIPTION = (
    "Run Python code in a persistent Jupyter kernel inside an isolated VM. Variables, imports "
    "and files persist between calls, as in a notebook. Returns stdout, stderr, the value of the "
    "last expression and any error with its traceback; plots and images come back as images. "
    "Use print() to see values, and !shell or subprocess for shell commands."
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


#: what an undo in a sandbox without automatic checkpoints tells the model about turning them on
UNDO_ENABLE = "(Undo needs a sandbox created with auto_checkpoint=True, e.g. Sandbox(auto_checkpoint=True).)"


def checkpoint_tools(auto_checkpoint: bool | int = False) -> list[dict[str, Any]]:
    """The definitions of the ``checkpoint``, ``restore`` and ``undo`` client tools, for ``tools=``.

    ``handle_code_execution_tool_use`` answers their blocks on the sandbox it is given.
    ``auto_checkpoint``: what that sandbox was created with; it words ``undo``'s description
    (with False, undo is described as working only if the sandbox keeps automatic checkpoints).
    """
    specs = tool_specs(auto_checkpoint)
    return [{"name": name, "description": text, "input_schema": schema} for name, text, schema in specs]


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
        return (yield from editor_result(tool_use_id, args, budget))
    if data["type"] == "server_tool_use":
        if name != "code_execution":
            raise ValueError(
                f"server tool {name!r} is not code execution; kernelhost answers code_execution, "
                "bash_code_execution and text_editor_code_execution only"
            )
        return (yield from _code_result(tool_use_id, args, timeout, budget))
    if name in NAMES:
        return _answer(tool_use_id, (yield from run_checkpoint_tool(name, args, UNDO_ENABLE)))
    return (yield from _tool_result(tool_use_id, args, timeout, budget))


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
    return _answer(tool_use_id, output)


def _answer(tool_use_id: str, output: ToolOutput) -> dict[str, Any]:
    """A ``tool_result`` block carrying ``output``."""
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
        return error(service_error(exc))
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
        return error(service_error(exc))
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
