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
``fork_sandbox``    copy a sandbox, live, into n new ones (when the SDK offers ``fork``)
``close_sandbox``   delete a sandbox and everything in it
``list_sandboxes``  the caller's sandboxes

A failing cell is a normal result (``status: "error"`` with the traceback); failures of the
service are tool errors (``isError``) whose text says what to do.

Install with ``pip install 'kernelhost[mcp]'``.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from kernelhost.client import AsyncSandbox, FileInfo, KernelHostError, NotFoundError, SandboxInfo

from ._ops import drive_async, stat_path
from .output import DEFAULT_BUDGET, OutputBudget, shape_execution, truncate_text

try:  # mcp and what it brings (anyio, pydantic)
    import anyio
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent, ToolAnnotations
    from pydantic import BaseModel, Field
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    if exc.name is None or exc.name.split(".")[0] not in ("mcp", "mcp_types", "anyio", "pydantic"):
        raise
    raise ModuleNotFoundError(
        "kernelhost's MCP server needs the mcp package (version 2): pip install 'kernelhost[mcp]'",
        name=exc.name) from exc

__all__ = ["DEFAULT_TIMEOUT", "Credentials", "CredentialsFor", "bearer_credentials",
           "create_server", "fixed_credentials"]

log = logging.getLogger("kernelhost.mcp")

#: Seconds a run_code call may run before it is interrupted, unless the call says otherwise.
DEFAULT_TIMEOUT = 120.0
#: Open SDK handles kept for reuse (each holds an HTTP connection pool).
MAX_HANDLES = 256
#: How long releasing (or deleting) the server's sandboxes may take when it stops.
RELEASE_TIMEOUT = 30.0
#: The most bytes read_file returns (base64 makes binary data a third larger still).
READ_MAX_BYTES = 5 * 1024 * 1024

INSTRUCTIONS = (
    "Run code in kernelhost sandboxes: VMs with a persistent Jupyter kernel. Call run_code "
    "without sandbox_id once; it returns a sandbox_id: pass it to every later call so variables, "
    "imports and files persist. Close sandboxes you no longer need with close_sandbox."
)


@dataclass(frozen=True)
class Credentials:
    """Where the kernelhost service is and which API key to act with (None: the SDK's env)."""

    url: str | None
    api_key: str | None


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


# -- structured results ------------------------------------------------------------------------


class SandboxOut(BaseModel):
    """A sandbox."""

    sandbox_id: str
    template: str
    state: str
    created_at: str | None = None
    network: str = "none"  # none, allowlist or outbound


class SandboxListOut(BaseModel):
    """Several sandboxes."""

    sandboxes: list[SandboxOut]


class ErrorOut(BaseModel):
    """An exception raised by the code."""

    name: str
    value: str
    traceback: str


class RunCodeOut(BaseModel):
    """What running the code produced (texts within the server's output budget)."""

    sandbox_id: str = Field(description="Pass it to later calls to keep the state")
    language: str
    status: str = Field(description="ok, error, timeout, interrupted or kernel_died")
    execution_count: int | None
    stdout: str
    stderr: str
    result: str | None = Field(description="The value of the last expression, as text")
    outputs: list[str] = Field(description="Other rich outputs (display()), as text")
    error: ErrorOut | None
    exit_code: int | None = Field(description="The exit status of a bash command")
    images: int = Field(description="How many images are attached as image content")
    truncated: bool = Field(description="True if some text was cut to fit the budget")
    notes: list[str]


class FileOut(BaseModel):
    """A file's content."""

    path: str
    size: int
    encoding: Literal["utf-8", "base64"]
    content: str
    truncated: bool


class WrittenOut(BaseModel):
    """A written file."""

    path: str
    size: int
    created: bool = Field(description="False if an existing file was overwritten")


class EntryOut(BaseModel):
    """A directory entry."""

    name: str
    path: str
    type: str = Field(description="file, dir, symlink or other")
    size: int


class ListingOut(BaseModel):
    """A directory's entries."""

    path: str
    entries: list[EntryOut]


class ClosedOut(BaseModel):
    """A deleted sandbox."""

    sandbox_id: str
    closed: bool


def _entry_out(info: FileInfo) -> EntryOut:
    return EntryOut(name=info.name, path=info.path, type=info.type, size=info.size)


def _sandbox_out(info: SandboxInfo) -> SandboxOut:
    created = info.created_at.isoformat() if info.created_at else None
    return SandboxOut(sandbox_id=info.id, template=info.template, state=info.state,
                      created_at=created, network=str(info.network.get("mode", "none")))


# -- sandbox handles -------------------------------------------------------------------------


class _Handles:
    """Open SDK handles, per API key and sandbox id, reused across calls.

    At most ``MAX_HANDLES`` stay open (least recently used first out: a handle holds an HTTP
    connection pool). Closing the server releases every handle; with ``delete_created`` it also
    deletes the sandboxes this server created (never those it only attached to).
    """

    def __init__(self, template: str, idle_timeout_seconds: int | None) -> None:
        self.template = template
        self.idle_timeout_seconds = idle_timeout_seconds
        self._open: OrderedDict[tuple[str, str], AsyncSandbox] = OrderedDict()
        self._created: dict[tuple[str, str], Credentials] = {}

    @staticmethod
    def _key(creds: Credentials, sandbox_id: str) -> tuple[str, str]:
        owner = hashlib.sha256(f"{creds.url}\0{creds.api_key}".encode()).hexdigest()
        return owner, sandbox_id

    async def _keep(self, key: tuple[str, str], sbx: AsyncSandbox) -> AsyncSandbox:
        """Remember ``sbx`` (or keep the handle already there); evict the oldest past the cap."""
        if key in self._open and self._open[key] is not sbx:
            await sbx.detach()  # a concurrent call opened one first
        else:
            self._open[key] = sbx
        self._open.move_to_end(key)
        while len(self._open) > MAX_HANDLES:
            _, oldest = self._open.popitem(last=False)
            await oldest.detach()
        return self._open[key]

    async def create(self, creds: Credentials, template: str | None,
                     idle_timeout_seconds: int | None,
                     network: str | dict[str, Any] | None = None) -> AsyncSandbox:
        sbx = await AsyncSandbox.create(
            template=template or self.template, url=creds.url, api_key=creds.api_key,
            idle_timeout_seconds=idle_timeout_seconds or self.idle_timeout_seconds,
            metadata={"created_by": "kernelhost-mcp"}, network=network)
        key = self._key(creds, sbx.id)
        self._created[key] = creds
        return await self._keep(key, sbx)

    async def get(self, creds: Credentials, sandbox_id: str) -> AsyncSandbox:
        key = self._key(creds, sandbox_id)
        if key in self._open:
            self._open.move_to_end(key)
            return self._open[key]
        sbx = await AsyncSandbox.connect(sandbox_id, url=creds.url, api_key=creds.api_key)
        return await self._keep(key, sbx)

    async def adopt(self, creds: Credentials, sbx: AsyncSandbox) -> None:
        key = self._key(creds, sbx.id)
        self._created[key] = creds
        await self._keep(key, sbx)

    async def forget(self, creds: Credentials, sandbox_id: str) -> None:
        """Drop the handle of a sandbox that is gone (deleted elsewhere, expired)."""
        key = self._key(creds, sandbox_id)
        self._created.pop(key, None)
        sbx = self._open.pop(key, None)
        if sbx is not None:
            await sbx.detach()

    async def close(self, creds: Credentials, sandbox_id: str) -> None:
        key = self._key(creds, sandbox_id)
        self._created.pop(key, None)
        sbx = self._open.pop(key, None) or await AsyncSandbox.connect(
            sandbox_id, url=creds.url, api_key=creds.api_key)
        await sbx.close()

    async def release(self, delete_created: bool) -> None:
        handles, self._open = self._open, OrderedDict()
        created, self._created = self._created, {}
        for key, sbx in handles.items():
            try:
                if delete_created and created.pop(key, None) is not None:
                    await sbx.close()
                else:
                    await sbx.detach()
            except KernelHostError as exc:
                log.warning("could not release sandbox %s: %s", sbx.id, exc)
        if delete_created:  # created sandboxes whose handle was evicted
            for (_, sandbox_id), creds in created.items():
                try:
                    await (await AsyncSandbox.connect(sandbox_id, url=creds.url,
                                                      api_key=creds.api_key)).close()
                except NotFoundError:
                    pass
                except KernelHostError as exc:
                    log.warning("could not delete sandbox %s: %s", sandbox_id, exc)


# -- the server --------------------------------------------------------------------------------

_READ_ONLY = ToolAnnotations(read_only_hint=True, open_world_hint=False)
_WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
_DESTROYS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)


def _tool_error(exc: Exception, sandbox_id: str | None = None) -> ToolError:
    """A tool error that tells the model what happened and what it can do."""
    if isinstance(exc, NotFoundError) and exc.code == "sandbox_not_found":
        return ToolError(f"sandbox {sandbox_id} does not exist (closed, expired after being idle, "
                         "or never created): create a new one with create_sandbox")
    if isinstance(exc, NotFoundError):  # a path in the sandbox
        return ToolError(exc.message)
    return ToolError(f"kernelhost failed: {exc}")


def create_server(
    credentials: CredentialsFor,
    *,
    template: str = "python",
    timeout: float | None = DEFAULT_TIMEOUT,
    budget: OutputBudget = DEFAULT_BUDGET,
    idle_timeout_seconds: int | None = None,
    delete_on_exit: bool = False,
    name: str = "kernelhost",
) -> MCPServer[Any]:
    """Build the MCP server. ``credentials`` says which service and key each call uses.

    ``template`` is the default for new sandboxes; ``timeout`` (seconds) stops ``run_code`` calls
    that run longer unless a call sets its own; ``budget`` caps the text (and images) returned.
    With ``delete_on_exit`` the sandboxes this server created are deleted when it stops.
    """
    handles = _Handles(template, idle_timeout_seconds)
    default_timeout = timeout

    @asynccontextmanager
    async def lifespan(server: MCPServer[Any]) -> AsyncIterator[None]:
        try:
            yield
        finally:
            # Runs on cancellation too (Ctrl-C, SIGTERM): shielded, with a deadline.
            with anyio.move_on_after(RELEASE_TIMEOUT, shield=True):
                await handles.release(delete_created=delete_on_exit)

    mcp: MCPServer[Any] = MCPServer(name, instructions=INSTRUCTIONS, lifespan=lifespan)

    async def failure(exc: Exception, creds: Credentials, sandbox_id: str | None) -> ToolError:
        if (isinstance(exc, NotFoundError) and exc.code == "sandbox_not_found"
                and sandbox_id is not None):
            await handles.forget(creds, sandbox_id)  # gone: do not keep its handle
        return _tool_error(exc, sandbox_id)

    async def sandbox_for(ctx: Context, sandbox_id: str) -> tuple[Credentials, AsyncSandbox]:
        creds = credentials(ctx)
        try:
            return creds, await handles.get(creds, sandbox_id)
        except KernelHostError as exc:
            raise await failure(exc, creds, sandbox_id) from exc

    @mcp.tool(annotations=_WRITES)
    async def create_sandbox(ctx: Context, template: str | None = None,
                             idle_timeout_seconds: int | None = None,
                             network: Literal["none", "allowlist", "outbound"] = "none",
                             allow: list[str] | None = None) -> SandboxOut:
        """Create a sandbox: a VM with a persistent Jupyter kernel. Returns its sandbox_id.

        template: the image to boot (default: the server's). idle_timeout_seconds: delete it
        after this long unused (default: the service's). network: "none" (no network, the
        default), "allowlist" (the server's package index, so pip install works, plus the
        host[:port] entries of allow) or "outbound" (any public host).
        """
        creds = credentials(ctx)
        spec: str | dict[str, Any] = {"mode": network, "allow": allow} if allow else network
        try:
            sbx = await handles.create(creds, template, idle_timeout_seconds, spec)
            return _sandbox_out(await sbx.info())
        except KernelHostError as exc:
            raise _tool_error(exc) from exc

    @mcp.tool(annotations=_WRITES)
    async def run_code(
        ctx: Context,
        code: str,
        language: Literal["python", "bash"] = "python",
        sandbox_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the tool's input, enforced by the service
    ) -> Annotated[CallToolResult, RunCodeOut]:
        """Run code in a sandbox and return its output; state persists between calls.

        language 'python' runs in the Jupyter kernel (variables, imports and files persist);
        'bash' runs a shell command. Without sandbox_id a new sandbox is created: pass the
        returned sandbox_id to later calls. timeout: seconds before the code is interrupted.
        """
        creds = credentials(ctx)
        try:
            if sandbox_id is None:
                sbx = await handles.create(creds, None, None)
            else:
                sbx = await handles.get(creds, sandbox_id)
        except KernelHostError as exc:
            raise await failure(exc, creds, sandbox_id) from exc
        limit = timeout if timeout is not None else default_timeout
        try:
            execution = await sbx.run_code(code, language=language, timeout=limit)
        except KernelHostError as exc:
            raise await failure(exc, creds, sbx.id) from exc
        shaped = shape_execution(execution, budget)
        fields = shaped.to_dict()
        error = fields.pop("error")
        out = RunCodeOut(sandbox_id=sbx.id, language=language,
                         error=ErrorOut(**error) if error else None, **fields)
        text = shaped.to_text() + f"\n[sandbox_id: {sbx.id}]"
        content: list[ContentBlock] = [TextContent(type="text", text=text)]
        content += [ImageContent(type="image", data=image.data, mime_type=image.mime_type)
                    for image in shaped.images]
        return CallToolResult(content=content, structured_content=out.model_dump(mode="json"))

    @mcp.tool(annotations=_READ_ONLY)
    async def read_file(ctx: Context, sandbox_id: str, path: str
                        ) -> Annotated[CallToolResult, FileOut]:
        """Read a file from a sandbox: UTF-8 text as is, other data as base64 (images are also
        attached as image content). Relative paths are under /home/user."""
        creds, sbx = await sandbox_for(ctx, sandbox_id)
        try:
            stat = await drive_async(stat_path(path), sbx)
            if stat.kind == "dir":
                raise ToolError(f"{stat.path} is a directory: use list_files")
            if stat.size > READ_MAX_BYTES:
                raise ToolError(f"{stat.path} is {stat.size} bytes, over the {READ_MAX_BYTES}-"
                                "byte limit of read_file; read parts of it with run_code")
            raw = await sbx.files.read(path)
        except KernelHostError as exc:
            raise await failure(exc, creds, sandbox_id) from exc
        where = stat.path if stat.kind != "missing" else path
        content: list[ContentBlock] = []
        try:
            text = raw.decode("utf-8")
            short = truncate_text(text, budget.max_chars, budget.head_fraction)
            out = FileOut(path=where, size=len(raw), encoding="utf-8", content=short,
                          truncated=short != text)
            content.append(TextContent(type="text", text=short))
        except UnicodeDecodeError:
            data = base64.b64encode(raw).decode("ascii")
            out = FileOut(path=where, size=len(raw), encoding="base64", content=data,
                          truncated=False)
            mime = _image_mime(raw)
            if mime:
                content.append(ImageContent(type="image", data=data, mime_type=mime))
            content.append(TextContent(type="text", text=(
                f"{where}: {len(raw)} bytes of binary data, base64 in the structured result")))
        return CallToolResult(content=content, structured_content=out.model_dump(mode="json"))

    @mcp.tool(annotations=_WRITES)
    async def write_file(ctx: Context, sandbox_id: str, path: str, content: str,
                         encoding: Literal["utf-8", "base64"] = "utf-8") -> WrittenOut:
        """Write a file into a sandbox (its directories are created; an existing file is
        replaced). encoding: 'utf-8' for text, 'base64' for binary data."""
        creds, sbx = await sandbox_for(ctx, sandbox_id)
        try:
            data = content.encode() if encoding == "utf-8" else base64.b64decode(
                content, validate=True)
        except ValueError as exc:
            raise ToolError(f"content is not valid base64 ({exc}); send text with "
                            "encoding='utf-8'") from exc
        try:
            before = await drive_async(stat_path(path), sbx)
            info = await sbx.files.write(path, data)
        except KernelHostError as exc:
            raise await failure(exc, creds, sandbox_id) from exc
        return WrittenOut(path=info.path, size=info.size, created=before.kind == "missing")

    @mcp.tool(annotations=_READ_ONLY)
    async def list_files(ctx: Context, sandbox_id: str, path: str = ".") -> ListingOut:
        """List a directory of a sandbox (default /home/user, the kernel's working directory)."""
        creds, sbx = await sandbox_for(ctx, sandbox_id)
        try:
            entries = await sbx.files.list(path)
        except KernelHostError as exc:
            raise await failure(exc, creds, sandbox_id) from exc
        return ListingOut(path=path, entries=[_entry_out(e) for e in entries])

    if hasattr(AsyncSandbox, "fork"):

        @mcp.tool(annotations=_WRITES)
        async def fork_sandbox(ctx: Context, sandbox_id: str, n: int = 1) -> SandboxListOut:
            """Copy a sandbox, live, into n new sandboxes: each starts with every variable,
            import and file of the original, which goes on unchanged. Returns the new ids."""
            creds, sbx = await sandbox_for(ctx, sandbox_id)
            try:
                children = await sbx.fork(n)
                for child in children:
                    await handles.adopt(creds, child)
                return SandboxListOut(sandboxes=[_sandbox_out(await c.info()) for c in children])
            except (KernelHostError, ValueError) as exc:
                raise await failure(exc, creds, sandbox_id) from exc

    @mcp.tool(annotations=_DESTROYS)
    async def close_sandbox(ctx: Context, sandbox_id: str) -> ClosedOut:
        """Delete a sandbox: its VM, variables and files are gone."""
        creds = credentials(ctx)
        try:
            await handles.close(creds, sandbox_id)
        except KernelHostError as exc:
            raise await failure(exc, creds, sandbox_id) from exc
        return ClosedOut(sandbox_id=sandbox_id, closed=True)

    @mcp.tool(annotations=_READ_ONLY)
    async def list_sandboxes(ctx: Context) -> SandboxListOut:
        """List your sandboxes."""
        creds = credentials(ctx)
        try:
            infos = await AsyncSandbox.list(url=creds.url, api_key=creds.api_key)
        except KernelHostError as exc:
            raise _tool_error(exc) from exc
        return SandboxListOut(sandboxes=[_sandbox_out(i) for i in infos])

    return mcp


def _image_mime(raw: bytes) -> str | None:
    for magic, mime in ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
                        (b"GIF8", "image/gif")):
        if raw.startswith(magic):
            return mime
    return None
