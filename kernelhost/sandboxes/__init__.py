"""The sandbox layer: sandboxes, their VMs, channels and executions. Knows Jupyter and the
channel, not HTTP. ``SandboxManager`` is its public API; docs/architecture.md maps its modules.

This face exports what the callers outside the layer use (the API, the CLI), and nothing else
(``tests/unit/test_layers.py`` checks both ways: the API imports the layer by these names only,
and each name has a caller): the manager, the errors, events, states and records they render,
and the values they hand the manager typed. The service's start-up opens the store by the
store's own face. The families are packages with a face of their own: ``lifecycle/``, ``vm/``,
``checkpoints/``, ``templates/``, ``store/``, ``execution/``, ``inside/``, ``network/``,
``cluster/``.
"""

from .cluster import FORWARDED_RESERVATION, HOST_FAILED, Node
from .errors import (
    AgentUnresponsive,
    BackendUnavailable,
    BootFailed,
    CapacityExceeded,
    CheckpointNotFound,
    CheckpointUnusable,
    ContextNotFound,
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
    TemplateConflict,
    TemplateNotFound,
)
from .execution import End, Error, Event, Result, Stream
from .inside import CodeContext, Process
from .manager import SandboxManager
from .network import NetworkSpec, parse_network
from .registry import ADMITTED, MAX_WAIT
from .sampler import Sample
from .sandbox import Sandbox, iso_time, sandbox_view
from .session import KernelSession, SessionEnd
from .states import ExecutionStatus, SandboxState
from .store.checkpoints import CheckpointRecord, parse_auto_checkpoint
from .store.sandboxes import SandboxRecord
from .templates.views import TemplateView
from .trust import derive_key

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
    "CheckpointRecord",
    "CheckpointUnusable",
    "CodeContext",
    "ContextNotFound",
    "End",
    "Error",
    "Event",
    "ExecutionStatus",
    "FileOperationFailed",
    "FileTooLarge",
    "HostFailed",
    "InvalidRequest",
    "KernelSession",
    "NetworkSpec",
    "Node",
    "NodeFull",
    "NodeRefused",
    "NodeUnreachable",
    "NotSupportedByImage",
    "PathNotFound",
    "PortNotOpen",
    "Process",
    "ProcessNotFound",
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
    "SessionEnd",
    "Stream",
    "TemplateConflict",
    "TemplateNotFound",
    "TemplateView",
    "derive_key",
    "iso_time",
    "parse_auto_checkpoint",
    "parse_network",
    "sandbox_view",
]
