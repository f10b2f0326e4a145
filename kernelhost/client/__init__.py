"""The kernelhost Python SDK: create sandboxes and run code in them over the HTTP API.

It speaks HTTP only and imports nothing of the server::

    from kernelhost import Sandbox

    with Sandbox() as sbx:
        print(sbx.run_code("1 + 1").text)

``AsyncSandbox`` is the asyncio original; ``Sandbox`` is derived from it.
"""

from kernelhost.client._checkpoints import Checkpoint
from kernelhost.client._exceptions import (
    APIError,
    AuthenticationError,
    ConflictError,
    FileTooLargeError,
    InvalidRequestError,
    KernelHostError,
    KernelHostTimeout,
    NotFoundError,
    RateLimitError,
    ServerError,
    TransportError,
)
from kernelhost.client._files import AsyncFiles
from kernelhost.client._metrics import SandboxMetrics
from kernelhost.client._models import (
    Execution,
    ExecutionError,
    ExecutionStatus,
    FileInfo,
    Recovery,
    Result,
    SandboxInfo,
    SandboxState,
)
from kernelhost.client._sandbox import AsyncSandbox
from kernelhost.client._sync import Files, Sandbox, Template
from kernelhost.client._templates import AsyncTemplate, BuildInfo, TemplateBuildError, TemplateInfo

__all__ = [
    "APIError",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncTemplate",
    "AuthenticationError",
    "BuildInfo",
    "Checkpoint",
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
    "SandboxMetrics",
    "SandboxState",
    "ServerError",
    "Template",
    "TemplateBuildError",
    "TemplateInfo",
    "TransportError",
]
