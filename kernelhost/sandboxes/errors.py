"""Errors of the sandbox layer; the API layer maps each to an HTTP status in one place.

    SandboxError
    ├── InvalidRequest          bad input (400)
    │   └── UnknownTemplate     template not built or not defined (400), names the valid ones
    ├── SandboxNotFound         absent, or owned by another key (404)
    ├── SandboxNotRunning       dead or being deleted (409)
    ├── CapacityExceeded        a limit was reached (429)
    ├── BootFailed              the VM did not reach a ready kernel (503)
    ├── BackendUnavailable      libvirt cannot be reached (503)
    ├── AgentUnresponsive       the guest agent did not answer in time (503)
    ├── NotSupportedByImage     the sandbox's guest image predates the feature (501)
    ├── PathNotFound            no such file or directory in the sandbox (404), names the path
    ├── FileTooLarge            over max_file_bytes (413), names the limit and the setting
    ├── SandboxDiskFull         the guest's RAM-backed disk is full (507)
    └── FileOperationFailed     any other refusal of the guest's filesystem (400), with errno
"""

from __future__ import annotations


class SandboxError(Exception):
    code = "sandbox_error"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidRequest(SandboxError):
    code = "invalid_request"


class UnknownTemplate(InvalidRequest):
    code = "unknown_template"


class SandboxNotFound(SandboxError):
    code = "sandbox_not_found"

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(
            f"no sandbox {sandbox_id!r} for this API key; list yours with GET /v1/sandboxes",
            sandbox_id=sandbox_id,
        )


class SandboxNotRunning(SandboxError):
    code = "sandbox_not_running"


class CapacityExceeded(SandboxError):
    code = "capacity_exceeded"


class BootFailed(SandboxError):
    code = "boot_failed"


class BackendUnavailable(SandboxError):
    code = "backend_unavailable"


class AgentUnresponsive(SandboxError):
    code = "agent_unresponsive"


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
