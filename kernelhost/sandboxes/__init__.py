"""The sandbox layer: sandboxes, their VMs, channels and executions. Knows Jupyter and the
channel, not HTTP. ``SandboxManager`` is its public API; docs/architecture.md maps its modules.
"""

from .cluster import FORWARDED_RESERVATION, HOST_FAILED, ClusterNode, Location, Node, Placement
from .db import Database, StoreUnavailable, open_database
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
from .network import INDEX_HOST, HostNetwork
from .processes import Process
from .sandbox import Sandbox
from .session import KernelSession, SessionClient, SessionEnd
from .states import ExecutionStatus, Recovery, SandboxState
from .store import SandboxRecord, Store, key_id, new_api_key
from .template_views import TemplateView

__all__ = [
    "FORWARDED_RESERVATION",
    "HOST_FAILED",
    "INDEX_HOST",
    "AgentUnresponsive",
    "BackendUnavailable",
    "BootFailed",
    "CapacityExceeded",
    "CheckpointNotFound",
    "CheckpointUnusable",
    "ClearOutput",
    "ClusterNode",
    "Database",
    "End",
    "Error",
    "Event",
    "ExecutionStatus",
    "FileOperationFailed",
    "FileTooLarge",
    "HostFailed",
    "HostNetwork",
    "InvalidRequest",
    "KernelSession",
    "Location",
    "Node",
    "NodeFull",
    "NodeRefused",
    "NodeUnreachable",
    "NotSupportedByImage",
    "PathNotFound",
    "Placement",
    "Process",
    "ProcessNotFound",
    "Recovery",
    "Remedy",
    "Result",
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
    "StoreUnavailable",
    "Stream",
    "TemplateConflict",
    "TemplateNotFound",
    "TemplateView",
    "UnknownTemplate",
    "key_id",
    "new_api_key",
    "open_database",
]
