"""libvirt/QEMU layer of kernelhost: domain XML, start, destroy, reconcile, acceleration probe.

Knows nothing of Jupyter or HTTP; raises the errors of ``hypervisor.errors``.
"""

from .accel import choose_accel, probe_kvm
from .domain import CHANNEL_NAME, MEM_ID, DomainSpec, device_model
from .errors import (
    DomainNotFound,
    DomainStartFailed,
    HypervisorError,
    ImageNotFound,
    LibvirtUnavailable,
)
from .forkram import PageForkUnavailable
from .host import DomainInfo, Hypervisor
from .images import GuestImage, ImageStore
from .migration import LiveSaveUnavailable, MigrationFailed
from .ramdiff import DiffStats, StreamNotUnderstood, diff_stream
from .stats import DomainStats

__all__ = [
    "CHANNEL_NAME",
    "MEM_ID",
    "DiffStats",
    "DomainInfo",
    "DomainNotFound",
    "DomainSpec",
    "DomainStartFailed",
    "DomainStats",
    "GuestImage",
    "Hypervisor",
    "HypervisorError",
    "ImageNotFound",
    "ImageStore",
    "LibvirtUnavailable",
    "LiveSaveUnavailable",
    "MigrationFailed",
    "PageForkUnavailable",
    "StreamNotUnderstood",
    "choose_accel",
    "device_model",
    "diff_stream",
    "probe_kvm",
]
