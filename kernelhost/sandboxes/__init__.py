"""The sandbox layer: sandboxes, their VMs, channels and executions. Knows Jupyter and the
channel, not HTTP. ``SandboxManager`` is its public API; docs/architecture.md maps its modules.

This face exports what the callers outside the layer use (the API, the CLI, the integrations),
and the vocabulary every interface renders: the error tree, the events, the states, the views.
The families are packages with a face of their own: ``lifecycle/``, ``vm/``, ``checkpoints/``,
``templates/``, ``store/``, ``execution/``, ``network/``, ``cluster/``.
"""

from .cluster import FORWARDED_RESERVATION, HOST_FAILED
from .errors import (
    AgentUnresponsive,
    BackendUnavailable,
    BootFailed,
    CapacityExceeded,
    CheckpointNotFound,
    CheckpointUnusable,
    FileOperationFailed,
    FileTooLarge,
    HostFailed,
    InvalidRequest,
    NodeFull,
    NodeRefused,
    NodeUnreachable,
    NotSupportedByImage,
    PathNotFound,
    PortNotOpen,
    ProcessNotFound,
    Remedy,
    SandboxBusy,
    SandboxDiskFull,
    SandboxError,
    SandboxNotFound,
    SandboxNotRunning,
    StoreRowRefused,
    TemplateConflict,
    TemplateNotFound,
    UnknownTemplate,
)
from .execution import ClearOutput, End, Error, Event, Result, Stream
from .manager import SandboxManager
from .processes import Process
from .registry import ADMITTED, MAX_WAIT
from .sampler import Sample, UsageSampler
from .sandbox import Sandbox, sandbox_view
from .session import KernelSession, SessionClient, SessionEnd
from .states import ExecutionStatus, Recovery, SandboxState
from .store.db import open_database
from .store.keys import key_id, new_api_key
from .store.sandboxes import SandboxRecord, Store
from .templates.views import TemplateView

__all__ = [
    "ADMITTED",
    "FORWARDED_RESERVATION",
    "HOST_FAILED",
    "MAX_WAIT",
    "AgentUnresponsive",
    "BackendUnavailable",
    "BootFailed",
    "CapacityExceeded",
    "CheckpointNotFound",
    "CheckpointUnusable",
    "ClearOutput",
    "End",
    "Error",
    "Event",
    "ExecutionStatus",
    "FileOperationFailed",
    "FileTooLarge",
    "HostFailed",
    "InvalidRequest",
    "KernelSession",
    "NodeFull",
    "NodeRefused",
    "NodeUnreachable",
    "NotSupportedByImage",
    "PathNotFound",
    "PortNotOpen",
    "Process",
    "ProcessNotFound",
    "Recovery",
    "Remedy",
    "Result",
    "Sample",
    "Sandbox",
    "SandboxBusy",
    "SandboxDiskFull",
    "SandboxError",
    "SandboxManager",
    "SandboxNotFound",
    "SandboxNotRunning",
    "SandboxRecord",
    "SandboxState",
    "SessionClient",
    "SessionEnd",
    "Store",
    "StoreRowRefused",
    "Stream",
    "TemplateConflict",
    "TemplateNotFound",
    "TemplateView",
    "UnknownTemplate",
    "UsageSampler",
    "key_id",
    "new_api_key",
    "open_database",
    "sandbox_view",
]
