"""Sandbox lifecycle: records, VMs, executions. Knows Jupyter and the channel, not HTTP."""

from .errors import (
    BackendUnavailable,
    BootFailed,
    CapacityExceeded,
    InvalidRequest,
    SandboxError,
    SandboxNotFound,
    SandboxNotRunning,
    UnknownTemplate,
)
from .manager import Sandbox, SandboxManager
from .store import SandboxRecord, Store, key_id, new_api_key

__all__ = [
    "BackendUnavailable",
    "BootFailed",
    "CapacityExceeded",
    "InvalidRequest",
    "Sandbox",
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
