"""Errors of the hypervisor layer.

    HypervisorError
    ├── LibvirtUnavailable      the libvirt daemon cannot be reached at the configured URI
    ├── ImageNotFound           no built guest image for a template
    ├── DomainNotFound          no domain of that name
    └── DomainStartFailed       libvirt or QEMU refused to start a domain

This layer knows nothing of HTTP or Jupyter; the service maps these to its own errors.
"""

from __future__ import annotations


class HypervisorError(Exception):
    """Base of every error raised by ``hypervisor``."""


class LibvirtUnavailable(HypervisorError):
    def __init__(self, uri: str, detail: str) -> None:
        super().__init__(
            f"cannot connect to libvirt at {uri!r}: {detail}; start the daemons with "
            "'scripts/start-libvirt.sh' (or your init system) or set KERNELHOST_LIBVIRT_URI"
        )
        self.uri = uri


class ImageNotFound(HypervisorError):
    def __init__(self, template: str, image_dir: str, available: list[str]) -> None:
        have = ", ".join(available) or "none"
        super().__init__(
            f"no built guest image for template {template!r} in {image_dir} (built: {have}); "
            f"run 'make image' or 'python3 guest-image/build.py {template}'"
        )
        self.template = template
        self.available = available


class DomainNotFound(HypervisorError):
    def __init__(self, name: str) -> None:
        super().__init__(f"no libvirt domain named {name!r}")
        self.name = name


class DomainStartFailed(HypervisorError):
    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"domain {name!r} failed to start: {detail}")
        self.name = name
