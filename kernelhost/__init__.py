"""kernelhost: a self-hosted code interpreter whose sandboxes are VMs running Jupyter kernels.

This package root exposes the client SDK only, and stays light: importing it loads neither the
server (``kernelhost.api`` and friends) nor libvirt or jupyter_client.
"""

from kernelhost.client import (
    APIError,
    AsyncFiles,
    AsyncSandbox,
    AuthenticationError,
    ConflictError,
    Execution,
    ExecutionError,
    ExecutionStatus,
    FileInfo,
    Files,
    FileTooLargeError,
    InvalidRequestError,
    KernelHostError,
    KernelHostTimeout,
    NotFoundError,
    RateLimitError,
    Recovery,
    Result,
    Sandbox,
    SandboxInfo,
    SandboxState,
    ServerError,
    TransportError,
)

__all__ = [
    "APIError",
    "AsyncFiles",
    "AsyncSandbox",
    "AuthenticationError",
    "ConflictError",
    "Execution",
    "ExecutionError",
    "ExecutionStatus",
    "FileInfo",
    "FileTooLargeError",
    "Files",
    "InvalidRequestError",
    "KernelHostError",
    "KernelHostTimeout",
    "NotFoundError",
    "RateLimitError",
    "Recovery",
    "Result",
    "Sandbox",
    "SandboxInfo",
    "SandboxState",
    "ServerError",
    "TransportError",
]
