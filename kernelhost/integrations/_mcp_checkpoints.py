"""The MCP server's checkpoint tools: ``checkpoint``, ``restore`` and ``undo``.

They act on the sandbox named by ``sandbox_id``, like the server's other sandbox tools, and say
what they did in the words of ``_checkpoint_tools`` (shared with the other adapters), with a
structured result. Imported by ``mcp_server`` once ``mcp`` is known to be installed.
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent, ToolAnnotations

from kernelhost.client import AsyncSandbox, KernelHostError

from ._checkpoint_tools import (
    CHECKPOINT_DESCRIPTION,
    RESTORE_DESCRIPTION,
    UNDO_HEAD,
    auto_reach,
    checkpoint_text,
    keeps_no_auto_checkpoints,
    no_undo_text,
    rewound_text,
)
from ._mcp_handles import Credentials
from ._mcp_models import CheckpointOut, RewoundOut, checkpoint_out


class _Calls(Protocol):
    """What the checkpoint tools use of the server's shared state (``mcp_server._Calls``)."""

    async def failure(self, exc: Exception, creds: Credentials, sandbox_id: str | None) -> ToolError: ...

    async def sandbox_for(self, ctx: Context, sandbox_id: str) -> tuple[Credentials, AsyncSandbox]: ...


_SAVES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
_REWINDS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)


def undo_terms(auto_checkpoint: bool | int) -> tuple[str, str]:
    """``undo``'s description, and what its refusal says about turning undo on, for a server
    whose sandboxes are created with ``auto_checkpoint``."""
    reach = auto_reach(auto_checkpoint)
    if reach is None:
        return (
            f"{UNDO_HEAD} This server creates sandboxes without automatic checkpoints, so undo works "
            "only in a sandbox created elsewhere with auto_checkpoint; use checkpoint and restore "
            "instead. sandbox_id: the sandbox to rewind.",
            "(This MCP server creates sandboxes without them: its auto_checkpoint option is off.)",
        )
    return (
        f"{UNDO_HEAD} Sandboxes this server creates (create_sandbox, or run_code without "
        f"sandbox_id) keep an automatic checkpoint before each run_code call, so n can be 1 to "
        f"{reach}; forks and sandboxes created elsewhere keep none. To return to a point of your "
        "choosing, use checkpoint and restore. sandbox_id: the sandbox to rewind.",
        "(Sandboxes this server creates with create_sandbox or run_code keep them; forks and "
        "sandboxes created elsewhere do not.)",
    )


def _answer(text: str, out: CheckpointOut | RewoundOut) -> CallToolResult:
    return CallToolResult(
        content=[TextContent(type="text", text=text)], structured_content=out.model_dump(mode="json")
    )


def checkpoint_tools(mcp: MCPServer[Any], calls: _Calls, auto_checkpoint: bool | int) -> None:
    undo_description, enable = undo_terms(auto_checkpoint)

    @mcp.tool(
        annotations=_SAVES,
        description=f"{CHECKPOINT_DESCRIPTION} sandbox_id: the sandbox to save; label: optional.",
    )
    async def checkpoint(
        ctx: Context, sandbox_id: str, label: str | None = None
    ) -> Annotated[CallToolResult, CheckpointOut]:
        creds, sbx = await calls.sandbox_for(ctx, sandbox_id)
        try:
            cp = await sbx.checkpoint(label)
        except KernelHostError as exc:
            raise await calls.failure(exc, creds, sandbox_id) from exc
        return _answer(checkpoint_text(cp, sandbox_id_arg=True), checkpoint_out(cp))

    @mcp.tool(
        annotations=_REWINDS,
        description=f"{RESTORE_DESCRIPTION} sandbox_id: the sandbox the checkpoint was taken of; "
        "checkpoint_id: the id checkpoint returned (cp_...).",
    )
    async def restore(
        ctx: Context, sandbox_id: str, checkpoint_id: str
    ) -> Annotated[CallToolResult, RewoundOut]:
        creds, sbx = await calls.sandbox_for(ctx, sandbox_id)
        try:
            cp = await sbx.restore(checkpoint_id)
        except (KernelHostError, ValueError) as exc:
            raise await calls.failure(exc, creds, sandbox_id) from exc
        out = RewoundOut(sandbox_id=sandbox_id, checkpoint=checkpoint_out(cp))
        return _answer(rewound_text(cp), out)

    @mcp.tool(annotations=_REWINDS, description=undo_description)
    async def undo(ctx: Context, sandbox_id: str, n: int = 1) -> Annotated[CallToolResult, RewoundOut]:
        creds, sbx = await calls.sandbox_for(ctx, sandbox_id)
        try:
            cp = await sbx.undo(n)
        except (KernelHostError, ValueError) as exc:
            if keeps_no_auto_checkpoints(exc):
                raise ToolError(no_undo_text(enable, sandbox_id)) from exc
            raise await calls.failure(exc, creds, sandbox_id) from exc
        out = RewoundOut(sandbox_id=sandbox_id, checkpoint=checkpoint_out(cp))
        return _answer(rewound_text(cp, n), out)
