"""The structured results of the MCP server's tools (their output schemas)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kernelhost.client import Checkpoint, FileInfo, SandboxInfo


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


class RestartedOut(BaseModel):
    """A restarted sandbox."""

    sandbox_id: str
    recovery: str = Field(
        description="kernel_restarted (files kept) or vm_replaced (a fresh VM: files lost too)"
    )


class CheckpointOut(BaseModel):
    """A checkpoint: a sandbox's whole state (variables, imports, files), kept to rewind it to."""

    checkpoint_id: str = Field(description="Pass it to restore, with this sandbox_id, to rewind to it")
    sandbox_id: str
    label: str
    created_at: str | None = None
    bytes: int = Field(description="What it takes on the server's disk, compressed")
    auto: bool = Field(description="True for the automatic checkpoints undo rewinds to")
    before_call: int | None = Field(default=None, description="The run_code call an automatic one preceded")


class RewoundOut(BaseModel):
    """A sandbox rewound to one of its checkpoints."""

    sandbox_id: str
    checkpoint: CheckpointOut = Field(description="The state it is back at")


def checkpoint_out(cp: Checkpoint) -> CheckpointOut:
    return CheckpointOut(
        checkpoint_id=cp.id,
        sandbox_id=cp.sandbox_id,
        label=cp.label,
        created_at=cp.created_at.isoformat() if cp.created_at else None,
        bytes=cp.bytes,
        auto=cp.auto,
        before_call=cp.before_call,
    )


def entry_out(info: FileInfo) -> EntryOut:
    return EntryOut(name=info.name, path=info.path, type=info.type, size=info.size)


def sandbox_out(info: SandboxInfo) -> SandboxOut:
    created = info.created_at.isoformat() if info.created_at else None
    return SandboxOut(
        sandbox_id=info.id,
        template=info.template,
        state=info.state,
        created_at=created,
        network=str(info.network.get("mode", "none")),
    )
