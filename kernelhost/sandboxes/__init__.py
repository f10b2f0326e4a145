"""Sandbox lifecycle: records, VMs, executions. Knows Jupyter and the channel, not HTTP."""

from .errors import (
    AgentUnresponsive,
    BackendUnavailable,
    BootFailed,
    CapacityExceeded,
    FileOperationFailed,
    FileTooLarge,
    InvalidRequest,
    NotSupportedByImage,
    PathNotFound,
    SandboxDiskFull,
    SandboxError,
    SandboxNotFound,
    SandboxNotRunning,
    UnknownTemplate,
)
from .manager import Sandbox, SandboxManager
from .store import SandboxRecord, Store, key_id, new_api_key

__all__ = [
    "AgentUnresponsive",
    "BackendUnavailable",
    "BootFailed",
    "CapacityExceeded",
    "FileOperationFailed",
    "FileTooLarge",
    "InvalidRequest",
    "NotSupportedByImage",
    "PathNotFound",
    "Sandbox",
    "SandboxDiskFull",
    "SandboxError",
    "SandboxManager",
    "SandboxNotFound",
    "SandboxNotRunning",
    "SandboxRecord",
    "Store",
    "UnknownTemplate",
    "key_id",
    "new_api_key",
]
