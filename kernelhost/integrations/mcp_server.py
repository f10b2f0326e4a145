"""An MCP server whose tools create kernelhost sandboxes and run code in them.

Two ways to reach it, same tools:

- ``kernelhost mcp``: over stdio, for MCP clients that launch a command (Claude Desktop, Cursor,
  the Agents SDK's ``MCPServerStdio``). It talks to a kernelhost service with
  ``KERNELHOST_URL`` / ``KERNELHOST_API_KEY`` and deletes the sandboxes it created when it exits.
- ``POST/GET/DELETE /mcp`` on the service itself (streamable HTTP), authenticated with the same
  ``Authorization: Bearer <key>`` as the REST API; each caller acts with its own key.

Tools (results are structured, with an output schema, plus a readable text block; images come
back as MCP image content):

``create_sandbox``  boot a sandbox and return its id
``run_code``        run Python (or a bash command) in a sandbox; without ``sandbox_id`` a new
                    sandbox is created and its id returned
``read_file``       read a file from a sandbox (text, or base64 for binary data)
``write_file``      write a file into a sandbox
``list_files``      list a directory of a sandbox
``fork_sandbox``    copy a sandbox, live, into n new ones
``restart_sandbox`` a fresh kernel (variables lost, files kept; a dead VM is replaced)
``close_sandbox``   delete a sandbox and everything in it
``list_sandboxes``  the caller's sandboxes
``checkpoint``      save a sandbox's whole state (variables, imports, files); returns its id
``restore``         rewind a sandbox to one of its checkpoints
``undo``            rewind a sandbox to before its last n run_code calls (the sandboxes this
                    server creates keep an automatic checkpoint before each call)

A failing cell is a normal result (``status: "error"`` with the traceback); failures of the
service are tool errors (``isError``) whose text says what to do, in terms of these tools.

Install with ``pip install 'kernelhost[mcp]'``.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from kernelhost.client import APIError, AsyncSandbox, FileTooLargeError, KernelHostError, NotFoundError

from ._ops import drive_async, stat_path
from .output import DEFAULT_BUDGET, OutputBudget, ResultKeeper, shape_execution, truncate_text

try:  # mcp and what it brings (anyio, pydantic)
    import anyio
    import pydantic  # noqa: F401  (the results' models need it)
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent, ToolAnnotations
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    if exc.name is None or exc.name.split(".")[0] not in ("mcp", "mcp_types", "anyio", "pydantic"):
        raise
    raise ModuleNotFoundError(
        "kernelhost's MCP server needs the mcp package (version 2): pip install 'kernelhost[mcp]'",
        name=exc.name,
    ) from exc

from ._checkpoint_tools import LIST_CHECKPOINTS_REMEDY
from ._mcp_checkpoints import checkpoint_tools
from ._mcp_handles import Credentials, Handles
from ._mcp_models import (
    ClosedOut,
    ErrorOut,
    FileOut,
    ListingOut,
    RestartedOut,
    RunCodeOut,
    SandboxListOut,
    SandboxOut,
    WrittenOut,
    entry_out,
    sandbox_out,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "Credentials",
    "CredentialsFor",
    "bearer_credentials",
    "create_server",
    "fixed_credentials",
]

log = logging.getLogger("kernelhost.mcp")

#: Seconds a run_code call may run before it is interrupted, unless the call says otherwise.
DEFAULT_TIMEOUT = 120.0
#: How long releasing (or deleting) the server's sandboxes may take when it stops.
RELEASE_TIMEOUT = 30.0
#: The most bytes read_file returns (base64 makes binary data a third larger still).
READ_MAX_BYTES = 5 * 1024 * 1024

INSTRUCTIONS = (
    "Run code in kernelhost sandboxes: VMs with a persistent Jupyter kernel. Call run_code "
    "without sandbox_id once; it returns a sandbox_id: pass it to every later call so variables, "
    "imports and files persist. Before a destructive or exploratory step, save the state with "
    "checkpoint: restore rewinds the sandbox to it, and undo rewinds its last run_code calls. "
    "Close sandboxes you no longer need with close_sandbox."
)


#: How the server finds the credentials for one tool call, from the call's context.
CredentialsFor = Callable[[Context], Credentials]


def fixed_credentials(url: str | None = None, api_key: str | None = None) -> CredentialsFor:
    """The same credentials for every call (stdio); None falls back to the SDK's env vars."""
    creds = Credentials(url, api_key)
    return lambda ctx: creds


def bearer_credentials(url: str) -> CredentialsFor:
    """The service at ``url`` with the key of the HTTP request that carries the call."""

    def credentials(ctx: Context) -> Credentials:
        request = ctx.request_context.request
        headers = getattr(request, "headers", None)
        header = headers.get("authorization", "") if headers is not None else ""
        scheme, _, key = header.partition(" ")
        if scheme.lower() not in ("bearer", "token") or not key.strip():
            raise ToolError("this MCP endpoint needs 'Authorization: Bearer <kernelhost API key>'")
        return Credentials(url, key.strip())

    return credentials


# -- the server --------------------------------------------------------------------------------

_READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
_WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
_DESTROYS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)

#: each remedy the service names (kernelhost.sandboxes.errors.Remedy), in this server's terms
REMEDIES = {
    "restart": "restart it with restart_sandbox (variables are lost, files are kept; a sandbox "
    "whose VM stopped gets a fresh one)",
    "recreate": "close it with close_sandbox and create a new one with create_sandbox",
    "list_sandboxes": "see yours with list_sandboxes",
    "list_directory": "list it with list_files",
    "list_templates": "pass one of the templates this error names as create_sandbox's template",
    "list_checkpoints": LIST_CHECKPOINTS_REMEDY,
}


def _tool_error(exc: Exception, sandbox_id: str | None = None) -> ToolError:
    """A tool error that tells the model what happened and what it can do, with these tools."""
    if isinstance(exc, NotFoundError) and exc.code == "sandbox_not_found":
        return ToolError(
            f"sandbox {sandbox_id} does not exist (closed, expired after being idle, "
            "or never created): create a new one with create_sandbox"
        )
    if isinstance(exc, APIError) and exc.remedy in REMEDIES:
        return ToolError(f"kernelhost: {exc.reason}; {REMEDIES[exc.remedy]}")
    if isinstance(exc, NotFoundError):  # a path in the sandbox
        return ToolError(exc.message)
    return ToolError(f"kernelhost failed: {exc}")


class _Calls:
    """What the tools share: the credentials of a call, the open handles, the defaults."""

    def __init__(
        self, credentials: CredentialsFor, handles: Handles, timeout: float | None, budget: OutputBudget
    ) -> None:
        self.credentials = credentials
        self.handles = handles
        self.timeout = timeout
        self.budget = budget

    async def failure(self, exc: Exception, creds: Credentials, sandbox_id: str | None) -> ToolError:
        if isinstance(exc, NotFoundError) and exc.code == "sandbox_not_found" and sandbox_id is not None:
            await self.handles.forget(creds, sandbox_id)  # gone: do not keep its handle
        return _tool_error(exc, sandbox_id)

    async def sandbox_for(self, ctx: Context, sandbox_id: str) -> tuple[Credentials, AsyncSandbox]:
        creds = self.credentials(ctx)
        try:
            return creds, await self.handles.get(creds, sandbox_id)
        except KernelHostError as exc:
            raise await self.failure(exc, creds, sandbox_id) from exc

    async def run(
        self, ctx: Context, code: str, language: str, sandbox_id: str | None, timeout: float | None
    ) -> CallToolResult:
        creds = self.credentials(ctx)
        try:
            if sandbox_id is None:
                sbx = await self.handles.create(creds, None, None)
            else:
                sbx = await self.handles.get(creds, sandbox_id)
        except KernelHostError as exc:
            raise await self.failure(exc, creds, sandbox_id) from exc
        limit = timeout if timeout is not None else self.timeout
        # this server may run inside the service: keep only what the answer can use
        keeper = ResultKeeper(self.budget)
        try:
            execution = await sbx.run_code(
                code, language=language, timeout=limit, on_result=keeper, keep_results=False
            )
        except KernelHostError as exc:
            raise await self.failure(exc, creds, sbx.id) from exc
        shaped = shape_execution(execution, self.budget, keeper)
        fields = shaped.to_dict()
        error = fields.pop("error")
        out = RunCodeOut(
            sandbox_id=sbx.id, language=language, error=ErrorOut(**error) if error else None, **fields
        )
        text = shaped.to_text() + f"\n[sandbox_id: {sbx.id}]"
        content: list[ContentBlock] = [TextContent(type="text", text=text)]
        content += [
            ImageContent(type="image", data=image.data, mime_type=image.mime_type) for image in shaped.images
        ]
        return CallToolResult(content=content, structured_content=out.model_dump(mode="json"))

    async def read(self, ctx: Context, sandbox_id: str, path: str) -> CallToolResult:
        creds, sbx = await self.sandbox_for(ctx, sandbox_id)
        try:
            stat = await drive_async(stat_path(path), sbx)
            if stat.kind == "dir":
                raise ToolError(f"{stat.path} is a directory: use list_files")
            # the listing's size is the link's for a symlink: the read itself is bounded
            raw = await sbx.files.read(path, max_bytes=READ_MAX_BYTES)
        except FileTooLargeError as exc:
            raise ToolError(
                f"{path} is over the {READ_MAX_BYTES}-byte limit of read_file; read parts of it with run_code"
            ) from exc
        except KernelHostError as exc:
            raise await self.failure(exc, creds, sandbox_id) from exc
        where = stat.path if stat.kind != "missing" else path
        content: list[ContentBlock] = []
        try:
            text = raw.decode("utf-8")
            short = truncate_text(text, self.budget.max_chars, self.budget.head_fraction)
            out = FileOut(path=where, size=len(raw), encoding="utf-8", content=short, truncated=short != text)
            content.append(TextContent(type="text", text=short))
        except UnicodeDecodeError:
            data = base64.b64encode(raw).decode("ascii")
            out = FileOut(path=where, size=len(raw), encoding="base64", content=data, truncated=False)
            mime = _image_mime(raw)
            if mime:
                content.append(ImageContent(type="image", data=data, mime_type=mime))
            content.append(
                TextContent(
                    type="text",
                    text=(f"{where}: {len(raw)} bytes of binary data, base64 in the structured result"),
                )
            )
        return CallToolResult(content=content, structured_content=out.model_dump(mode="json"))


def create_server(
    credentials: CredentialsFor,
    *,
    template: str = "python",
    timeout: float | None = DEFAULT_TIMEOUT,
    budget: OutputBudget = DEFAULT_BUDGET,
    idle_timeout_seconds: int | None = None,
    delete_on_exit: bool = False,
    name: str = "kernelhost",
    auto_checkpoint: bool | int = False,
) -> MCPServer[Any]:
    """Build the MCP server. ``credentials`` says which service and key each call uses.

    ``template`` is the default for new sandboxes; ``timeout`` (seconds) stops ``run_code`` calls
    that run longer unless a call sets its own; ``budget`` caps the text (and images) returned.
    With ``delete_on_exit`` the sandboxes this server created are deleted when it stops.
    ``auto_checkpoint``: the sandboxes it creates keep their state before each of their last 5
    ``run_code`` calls (an int: that many), so the ``undo`` tool works: after each call the VM
    pauses briefly while its state is saved, and the kept states take disk within the key's
    ``max_checkpoint_bytes_per_key``; each save also maps a whole VM state in the service for
    a moment, so it is off by default. With False, ``undo`` answers that it is off (and how to do
    without it); ``checkpoint`` and ``restore`` work either way.
    """
    handles = Handles(template, idle_timeout_seconds, auto_checkpoint)

    @asynccontextmanager
    async def lifespan(server: MCPServer[Any]) -> AsyncIterator[None]:
        try:
            yield
        finally:
            # Runs on cancellation too (Ctrl-C, SIGTERM): shielded, with a deadline.
            with anyio.move_on_after(RELEASE_TIMEOUT, shield=True):
                await handles.release(delete_created=delete_on_exit)

    mcp: MCPServer[Any] = MCPServer(name, instructions=INSTRUCTIONS, lifespan=lifespan)
    calls = _Calls(credentials, handles, timeout, budget)
    _code_tools(mcp, calls)
    _sandbox_tools(mcp, calls)
    _file_tools(mcp, calls)
    checkpoint_tools(mcp, calls, auto_checkpoint)
    return mcp


def _code_tools(mcp: MCPServer[Any], calls: _Calls) -> None:
    @mcp.tool(annotations=_WRITES)
    async def run_code(
        ctx: Context,
        code: str,
        language: Literal["python", "bash"] = "python",
        sandbox_id: str | None = None,
        timeout: float | None = None,
    ) -> Annotated[CallToolResult, RunCodeOut]:
        """Run code in a sandbox and return its output; state persists between calls.

        language 'python' runs in the Jupyter kernel (variables, imports and files persist);
        'bash' runs a shell command. Without sandbox_id a new sandbox is created: pass the
        returned sandbox_id to later calls. timeout: seconds before the code is interrupted.
        """
        return await calls.run(ctx, code, language, sandbox_id, timeout)


def _sandbox_tools(mcp: MCPServer[Any], calls: _Calls) -> None:
    @mcp.tool(annotations=_WRITES)
    async def create_sandbox(
        ctx: Context,
        template: str | None = None,
        idle_timeout_seconds: int | None = None,
        network: Literal["none", "allowlist", "outbound"] = "none",
        allow: list[str] | None = None,
    ) -> SandboxOut:
        """Create a sandbox: a VM with a persistent Jupyter kernel. Returns its sandbox_id.

        template: the image to boot (default: the server's). idle_timeout_seconds: delete it
        after this long unused (default: the service's). network: "none" (no network, the
        default), "allowlist" (the server's package index, so pip install works, plus the
        host[:port] entries of allow) or "outbound" (any public host).
        """
        creds = calls.credentials(ctx)
        spec: str | dict[str, Any] = {"mode": network, "allow": allow} if allow else network
        try:
            sbx = await calls.handles.create(creds, template, idle_timeout_seconds, spec)
            return sandbox_out(await sbx.info())
        except KernelHostError as exc:
            raise _tool_error(exc) from exc

    @mcp.tool(annotations=_WRITES)
    async def fork_sandbox(ctx: Context, sandbox_id: str, n: int = 1) -> SandboxListOut:
        """Copy a sandbox, live, into n new sandboxes: each starts with every variable,
        import and file of the original, which goes on unchanged. Returns the new ids."""
        creds, sbx = await calls.sandbox_for(ctx, sandbox_id)
        try:
            children = await sbx.fork(n)
            for child in children:
                await calls.handles.adopt(creds, child)
            return SandboxListOut(sandboxes=[sandbox_out(await c.info()) for c in children])
        except (KernelHostError, ValueError) as exc:
            raise await calls.failure(exc, creds, sandbox_id) from exc

    @mcp.tool(annotations=_DESTROYS)
    async def restart_sandbox(ctx: Context, sandbox_id: str) -> RestartedOut:
        """Restart a sandbox's kernel: running code stops, variables and imports are lost, files
        are kept. A sandbox whose VM stopped or stays silent gets a fresh VM (files lost too)."""
        creds, sbx = await calls.sandbox_for(ctx, sandbox_id)
        try:
            recovery = await sbx.restart()
        except KernelHostError as exc:
            raise await calls.failure(exc, creds, sandbox_id) from exc
        return RestartedOut(sandbox_id=sandbox_id, recovery=str(recovery))

    @mcp.tool(annotations=_DESTROYS)
    async def close_sandbox(ctx: Context, sandbox_id: str) -> ClosedOut:
        """Delete a sandbox: its VM, variables and files are gone."""
        creds = calls.credentials(ctx)
        try:
            await calls.handles.close(creds, sandbox_id)
        except KernelHostError as exc:
            raise await calls.failure(exc, creds, sandbox_id) from exc
        return ClosedOut(sandbox_id=sandbox_id, closed=True)

    @mcp.tool(annotations=_READ_ONLY)
    async def list_sandboxes(ctx: Context) -> SandboxListOut:
        """List your sandboxes."""
        creds = calls.credentials(ctx)
        try:
            infos = await AsyncSandbox.list(url=creds.url, api_key=creds.api_key)
        except KernelHostError as exc:
            raise _tool_error(exc) from exc
        return SandboxListOut(sandboxes=[sandbox_out(i) for i in infos])


def _file_tools(mcp: MCPServer[Any], calls: _Calls) -> None:
    @mcp.tool(annotations=_READ_ONLY)
    async def read_file(ctx: Context, sandbox_id: str, path: str) -> Annotated[CallToolResult, FileOut]:
        """Read a file from a sandbox: UTF-8 text as is, other data as base64 (images are also
        attached as image content). Relative paths are under /home/user."""
        return await calls.read(ctx, sandbox_id, path)

    @mcp.tool(annotations=_WRITES)
    async def write_file(
        ctx: Context, sandbox_id: str, path: str, content: str, encoding: Literal["utf-8", "base64"] = "utf-8"
    ) -> WrittenOut:
        """Write a file into a sandbox (its directories are created; an existing file is
        replaced). encoding: 'utf-8' for text, 'base64' for binary data."""
        creds, sbx = await calls.sandbox_for(ctx, sandbox_id)
        try:
            data = content.encode() if encoding == "utf-8" else base64.b64decode(content, validate=True)
        except ValueError as exc:
            raise ToolError(f"content is not valid base64 ({exc}); send text with encoding='utf-8'") from exc
        try:
            before = await drive_async(stat_path(path), sbx)
            info = await sbx.files.write(path, data)
        except KernelHostError as exc:
            raise await calls.failure(exc, creds, sandbox_id) from exc
        return WrittenOut(path=info.path, size=info.size, created=before.kind == "missing")

    @mcp.tool(annotations=_READ_ONLY)
    async def list_files(ctx: Context, sandbox_id: str, path: str = ".") -> ListingOut:
        """List a directory of a sandbox (default /home/user, the kernel's working directory)."""
        creds, sbx = await calls.sandbox_for(ctx, sandbox_id)
        try:
            entries = await sbx.files.list(path)
        except KernelHostError as exc:
            raise await calls.failure(exc, creds, sandbox_id) from exc
        return ListingOut(path=path, entries=[entry_out(e) for e in entries])


def _image_mime(raw: bytes) -> str | None:
    for magic, mime in (
        (b"\x89PNG\r\n\x1a\n", "image/png"),
        (b"\xff\xd8\xff", "image/jpeg"),
        (b"GIF8", "image/gif"),
    ):
        if raw.startswith(magic):
            return mime
    return None
