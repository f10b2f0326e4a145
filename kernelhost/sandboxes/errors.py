"""Errors of the sandbox layer. Each has a ``code`` (stable, snake_case), a ``message`` that says
what happened in words every interface can show, ``details`` (the values it names) and, where
the caller can act, a ``remedy``: what to do, which each interface words in its own terms (the
REST API names its route, the Kernel Gateway says "restart the kernel", the MCP server names
its tool). ``kernelhost/api/errors.py`` maps each error to an HTTP status in one table.

    SandboxError
    ├── InvalidRequest          bad input; names the field and the fix
    │   └── UnknownTemplate     template not built or not defined, names the valid ones
    ├── SandboxNotFound         absent, or owned by another key
    ├── ProcessNotFound         no such background process in the sandbox (ended, or never ran)
    ├── ContextNotFound         no such code context in the sandbox (removed, or never started)
    ├── TemplateNotFound        no such template for this key (another key's is absent too)
    ├── TemplateConflict        in use, being built, not built yet, or not this key's
    ├── CheckpointNotFound      no such checkpoint of this key's sandbox
    ├── CheckpointUnusable      a checkpoint whose base snapshot is gone
    ├── SandboxBusy             a call runs that the operation must not cut short
    ├── SandboxNotRunning       dead or being deleted
    ├── CapacityExceeded        a limit was reached, names the setting
    │   └── NodeFull            no live node of the cluster has room for what is asked
    ├── HostFailed              the cluster node that held the sandbox's VM died: state lost
    ├── NodeUnreachable         the node that holds the sandbox did not answer
    │   └── NodeRefused         that node's row is not to be believed: nothing is sent there
    ├── StoreRowRefused         a store row names a file outside this node's directories
    ├── BootFailed              the VM did not reach a ready kernel
    ├── BackendUnavailable      libvirt cannot be reached
    ├── AgentUnresponsive       the guest agent did not answer in time
    ├── NotSupportedByImage     the sandbox's guest image predates the feature
    ├── PathNotFound            no such file or directory in the sandbox, names the path
    ├── PortNotOpen             nothing in the sandbox accepts connections on the routed port
    ├── FileTooLarge            over max_file_bytes, names the limit and the setting
    ├── SandboxDiskFull         the guest's RAM-backed disk is full
    └── FileOperationFailed     any other refusal of the guest's filesystem, with errno
"""

from __future__ import annotations

import enum


class Remedy(enum.StrEnum):
    """What the caller of a failed operation can do next."""

    RESTART = "restart"  # restart the kernel; a silent or dead VM is replaced (state lost)
    RECREATE = "recreate"  # delete the sandbox and create a new one
    LIST_SANDBOXES = "list_sandboxes"  # look up the sandboxes this key holds
    LIST_DIRECTORY = "list_directory"  # the path is a directory: list it instead
    LIST_TEMPLATES = "list_templates"  # look up the templates this key may use
    LIST_CHECKPOINTS = "list_checkpoints"  # look up the sandbox's checkpoints


class SandboxError(Exception):
    code = "sandbox_error"
    remedy: Remedy | None = None

    def __init__(self, message: str, *, remedy: Remedy | None = None, **details: object) -> None:
        super().__init__(message)
        self.message = message
        if remedy is not None:
            self.remedy = remedy
        self.details = details

    @property
    def sandbox_id(self) -> str | None:
        value = self.details.get("sandbox_id")
        return value if isinstance(value, str) else None


class InvalidRequest(SandboxError):
    code = "invalid_request"


class UnknownTemplate(InvalidRequest):
    code = "unknown_template"


class SandboxNotFound(SandboxError):
    code = "sandbox_not_found"
    remedy = Remedy.LIST_SANDBOXES

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"no sandbox {sandbox_id!r} for this API key", sandbox_id=sandbox_id)


class ProcessNotFound(SandboxError):
    code = "process_not_found"

    def __init__(self, sandbox_id: str, pid: object) -> None:
        super().__init__(
            f"no process {pid!r} runs in sandbox {sandbox_id} (it ended, or never started)",
            sandbox_id=sandbox_id,
            pid=pid,
        )


class ContextNotFound(SandboxError):
    code = "context_not_found"

    def __init__(self, sandbox_id: str, context_id: object) -> None:
        super().__init__(
            f"no code context {context_id!r:.80} in sandbox {sandbox_id} (it was removed, its VM "
            "was replaced, or it never existed); list the contexts, or create one",
            sandbox_id=sandbox_id,
            context=str(context_id)[:80],
        )


class TemplateNotFound(SandboxError):
    code = "template_not_found"
    remedy = Remedy.LIST_TEMPLATES

    def __init__(self, name: str, visible: list[str], build_id: str | None = None) -> None:
        shown = ", ".join(visible) or "none"
        what = f"no build {build_id!r} of template {name!r}" if build_id else f"no template {name!r}"
        super().__init__(f"{what} for this API key (yours and the shared ones: {shown})", template=name)


class TemplateConflict(SandboxError):
    code = "template_conflict"


class CheckpointNotFound(SandboxError):
    code = "checkpoint_not_found"
    remedy = Remedy.LIST_CHECKPOINTS

    def __init__(self, checkpoint_id: str, why: str = "") -> None:
        super().__init__(
            why or f"no checkpoint {checkpoint_id!r} for this API key", checkpoint_id=checkpoint_id
        )


class CheckpointUnusable(SandboxError):
    code = "checkpoint_unusable"


class SandboxBusy(SandboxError):
    code = "sandbox_busy"


class SandboxNotRunning(SandboxError):
    code = "sandbox_not_running"


class PortNotOpen(SandboxError):
    """Nothing in the sandbox accepts connections on the port a request was routed to."""

    code = "port_not_open"


class CapacityExceeded(SandboxError):
    code = "capacity_exceeded"


class NodeFull(CapacityExceeded):
    """No live node of the cluster (or not the one asked for) has room for what is asked."""

    code = "cluster_full"


class HostFailed(SandboxError):
    """The cluster node that held the sandbox's VM died: its state is lost."""

    code = "host_failed"


class NodeUnreachable(SandboxError):
    """The live node that holds the sandbox did not answer the node the client called."""

    code = "node_unreachable"


class NodeRefused(NodeUnreachable):
    """The node that holds the sandbox has a row this node must not believe (an unregistered or
    malformed URL): nothing is sent there."""

    code = "node_refused"


class StoreRowRefused(SandboxError):
    """A row of the store names a file outside this node's own directories: refused, logged."""

    code = "store_row_refused"


class BootFailed(SandboxError):
    code = "boot_failed"


class BackendUnavailable(SandboxError):
    code = "backend_unavailable"


class AgentUnresponsive(SandboxError):
    code = "agent_unresponsive"
    remedy = Remedy.RESTART


class NotSupportedByImage(SandboxError):
    code = "not_supported_by_image"


class PathNotFound(SandboxError):
    code = "file_not_found"


class FileTooLarge(SandboxError):
    code = "file_too_large"


class SandboxDiskFull(SandboxError):
    code = "sandbox_disk_full"


class FileOperationFailed(SandboxError):
    code = "file_operation_failed"
