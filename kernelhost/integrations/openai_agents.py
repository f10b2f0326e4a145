"""OpenAI Agents SDK: a function tool that runs code in a kernelhost sandbox.

::

    from agents import Agent, Runner
    from kernelhost.integrations.openai_agents import code_interpreter_tool

    tool = code_interpreter_tool(template="python")      # the sandbox boots on the first call
    agent = Agent(name="analyst", instructions="Use run_code to compute.", tools=[tool])
    try:
        result = await Runner.run(agent, "What is 2**100?")
    finally:
        await tool.aclose()                              # deletes the sandbox it created

The tool takes ``code`` and ``language`` (``python`` runs in the persistent Jupyter kernel,
``bash`` runs a shell command from it) and returns the output shaped for the model
(``kernelhost.integrations.output``): text within a budget, and plots as image outputs. Code that
fails returns its traceback as the tool's output, so the run goes on; only a misconfiguration
(a bad API key, a closed sandbox) raises.

``checkpoint_tools(tool)`` adds ``checkpoint``, ``restore`` and ``undo`` on the same sandbox
(``tools=[tool, *checkpoint_tools(tool)]``): the model saves the state before a risky step and
rewinds to it. ``undo`` needs automatic checkpoints: ``code_interpreter_tool(auto_checkpoint=True)``.

Install with ``pip install 'kernelhost[openai-agents]'``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kernelhost.client import AsyncSandbox, Sandbox

from ._checkpoint_tools import run_checkpoint_tool, tool_specs
from ._ops import LANGUAGES, drive, run_for_model
from .output import DEFAULT_BUDGET, OutputBudget

try:
    from agents import FunctionTool, ToolOutputImage, ToolOutputText
    from agents.tool_context import ToolContext
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    if exc.name != "agents":
        raise
    raise ModuleNotFoundError(
        "kernelhost.integrations.openai_agents needs the OpenAI Agents SDK: "
        "pip install 'kernelhost[openai-agents]'",
        name=exc.name,
    ) from exc

__all__ = [
    "DEFAULT_DESCRIPTION",
    "DEFAULT_TIMEOUT",
    "KernelhostCodeInterpreter",
    "checkpoint_tools",
    "code_interpreter_tool",
]

#: Seconds a call may run before the sandbox interrupts it, unless ``timeout=`` says otherwise.
DEFAULT_TIMEOUT = 120.0

DEFAULT_DESCRIPTION = (
    "Run code in a persistent Jupyter kernel inside an isolated VM. With language 'python' the "
    "code runs in the kernel: variables, imports and files persist between calls, as in a "
    "notebook. With language 'bash' it is run as a shell command. Returns stdout, stderr, the "
    "value of the last expression and any error with its traceback; plots come back as images."
)

PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "Python source, or a bash command"},
        "language": {
            "type": "string",
            "enum": list(LANGUAGES),
            "description": "'python' (the kernel) or 'bash' (a shell command)",
        },
    },
    "required": ["code", "language"],
    "additionalProperties": False,
}

#: what an undo in a sandbox without automatic checkpoints tells the model about turning them on
UNDO_ENABLE = (
    "(Undo needs automatic checkpoints: build the tool with code_interpreter_tool(auto_checkpoint=True), "
    "or give it a sandbox created with auto_checkpoint=True.)"
)


class _SandboxHolder:
    """The tool's sandbox: the caller's, or one it creates on first use and later deletes.

    A sandbox the tool creates is a blocking ``Sandbox`` driven from worker threads: it has its
    own event loop, so the tool works from any loop (``Runner.run_sync`` makes a new one per run).
    """

    def __init__(self, sandbox: AsyncSandbox | Sandbox | None, options: dict[str, Any]) -> None:
        self._sandbox = sandbox
        self._owned: Sandbox | None = None
        self._options = options
        self._lock = threading.Lock()

    @property
    def sandbox(self) -> AsyncSandbox | Sandbox | None:
        return self._sandbox if self._sandbox is not None else self._owned

    @property
    def auto_checkpoint(self) -> bool | int:
        """What the sandbox it creates is created with (False for the caller's: not known)."""
        return self._options.get("auto_checkpoint", False) if self._sandbox is None else False

    def _ensure_owned(self) -> Sandbox:
        with self._lock:
            if self._owned is None:
                self._owned = Sandbox(**self._options)
            return self._owned

    async def get(self) -> AsyncSandbox | Sandbox:
        if self._sandbox is not None:
            return self._sandbox
        return await asyncio.to_thread(self._ensure_owned)

    def close(self) -> None:
        with self._lock:
            owned, self._owned = self._owned, None
        if owned is not None:
            owned.close()


class KernelhostCodeInterpreter(FunctionTool):
    """An Agents SDK ``FunctionTool`` backed by a kernelhost sandbox.

    Build it with ``code_interpreter_tool()``. ``sandbox`` is the sandbox in use (None before
    the first call when the tool creates its own); ``close()`` / ``await aclose()`` delete a
    sandbox the tool created (a sandbox passed in is left to its owner).
    """

    def __init__(
        self,
        holder: _SandboxHolder,
        *,
        name: str,
        description: str,
        timeout: float | None,
        budget: OutputBudget,
    ) -> None:
        self._holder = holder
        self._timeout = timeout
        self._budget = budget
        super().__init__(
            name=name,
            description=description,
            params_json_schema=PARAMETERS,
            on_invoke_tool=self._invoke,
            strict_json_schema=True,
        )

    @property
    def sandbox(self) -> AsyncSandbox | Sandbox | None:
        """The sandbox the tool runs code in (None until the first call if it creates one)."""
        return self._holder.sandbox

    def close(self) -> None:
        """Delete the sandbox the tool created, if any; safe to call more than once."""
        self._holder.close()

    async def aclose(self) -> None:
        """``close()`` without blocking the event loop."""
        await asyncio.to_thread(self._holder.close)

    async def _invoke(self, context: ToolContext[Any], arguments: str) -> Any:
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return f'The arguments are not valid JSON ({exc}); send {{"code": ..., "language": ...}}.'
        if not isinstance(args, Mapping) or not isinstance(args.get("code"), str):
            return "Missing 'code': pass the source to run as a string."
        language = args.get("language") or "python"
        sbx = await self._holder.get()
        output = await drive(run_for_model(args["code"], str(language), self._timeout, self._budget), sbx)
        if not output.images:
            return output.text
        return [
            ToolOutputText(text=output.text),
            *(ToolOutputImage(image_url=image.data_url()) for image in output.images),
        ]


def code_interpreter_tool(
    sandbox: AsyncSandbox | Sandbox | None = None,
    template: str = "python",
    *,
    name: str = "run_code",
    description: str = DEFAULT_DESCRIPTION,
    timeout: float | None = DEFAULT_TIMEOUT,
    budget: OutputBudget = DEFAULT_BUDGET,
    idle_timeout_seconds: int | None = None,
    url: str | None = None,
    api_key: str | None = None,
    auto_checkpoint: bool | int = False,
) -> KernelhostCodeInterpreter:
    """An Agents SDK tool that runs code in a kernelhost sandbox; state persists between calls.

    With ``sandbox=None`` the tool creates a sandbox of ``template`` on its first call (``url``
    and ``api_key`` default to ``KERNELHOST_URL`` / ``KERNELHOST_API_KEY``) and deletes it on
    ``close()``/``aclose()`` (or the server does, after ``idle_timeout_seconds`` unused). Pass an
    ``AsyncSandbox`` or ``Sandbox`` to use yours instead. ``timeout`` (seconds) interrupts code
    that runs longer; ``budget`` caps what the model reads. The default name is ``run_code``,
    not ``code_interpreter``, which is OpenAI's hosted tool. ``auto_checkpoint``: the sandbox it
    creates keeps its state before each of its last 5 calls (an int: that many), for the ``undo``
    of ``checkpoint_tools``; it costs a short pause after each call and disk on the server.
    """
    if sandbox is not None and not isinstance(sandbox, AsyncSandbox | Sandbox):
        raise TypeError(
            f"sandbox must be a kernelhost AsyncSandbox or Sandbox, got {type(sandbox).__name__}; "
            "or pass None to let the tool create one"
        )
    options: dict[str, Any] = {
        "template": template,
        "idle_timeout_seconds": idle_timeout_seconds,
        "url": url,
        "api_key": api_key,
        "metadata": {"created_by": "kernelhost-openai-agents"},
        "auto_checkpoint": auto_checkpoint,
    }
    return KernelhostCodeInterpreter(
        _SandboxHolder(sandbox, options), name=name, description=description, timeout=timeout, budget=budget
    )


def checkpoint_tools(interpreter: KernelhostCodeInterpreter) -> list[FunctionTool]:
    """The ``checkpoint``, ``restore`` and ``undo`` tools, on the sandbox ``interpreter`` runs code in.

    Give them to the agent with it: ``tools=[tool, *checkpoint_tools(tool)]``. ``undo`` rewinds
    the last calls only in a sandbox with automatic checkpoints (``code_interpreter_tool(
    auto_checkpoint=True)``, or a sandbox you created so); otherwise it tells the model it is off.
    Closing ``interpreter`` is all the cleanup they need.
    """
    holder = interpreter._holder
    return [
        FunctionTool(
            name=name,
            description=text,
            params_json_schema=schema,
            on_invoke_tool=_checkpoint_invoker(holder, name),
            strict_json_schema=True,
        )
        for name, text, schema in tool_specs(holder.auto_checkpoint, strict=True)
    ]


def _checkpoint_invoker(
    holder: _SandboxHolder, name: str
) -> Callable[[ToolContext[Any], str], Awaitable[str]]:
    async def invoke(context: ToolContext[Any], arguments: str) -> str:
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return f"The arguments are not valid JSON ({exc}); send a JSON object."
        if not isinstance(args, Mapping):
            return "The arguments must be a JSON object."
        sbx = await holder.get()
        output = await drive(run_checkpoint_tool(name, dict(args), UNDO_ENABLE), sbx)
        return output.text

    return invoke
