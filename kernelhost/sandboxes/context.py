"""What every part of the sandbox layer works with: settings, libvirt, images, the registry of
sandboxes, the VM factory, metrics, the network, and the owner of background tasks. One
``Context`` is made by ``SandboxManager`` and handed to each part."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hypervisor import GuestImage, Hypervisor, ImageStore

from ..config import Settings
from ..metrics import Metrics
from ..tasks import TaskSet
from .network import SandboxNetwork
from .registry import Registry, VmShape
from .store import SandboxRecord
from .vms import VmFactory


@dataclass
class Context:
    settings: Settings
    hv: Hypervisor
    images: ImageStore
    registry: Registry
    vms: VmFactory
    metrics: Metrics
    network: SandboxNetwork
    tasks: TaskSet
    accel: str

    def shape_for(self, image: GuestImage) -> VmShape:
        """The machine new sandboxes of ``image`` get: its template's size, or the service's."""
        memory, vcpus, _ = self.vms.snapshots.shape_of(image)
        return VmShape(memory, vcpus, self.accel)

    def hibernation_file(self, rec: SandboxRecord) -> Path:
        return self.settings.hibernate_dir / f"{rec.id}.state"

    def image_of(self, rec: SandboxRecord) -> GuestImage:
        """The exact image build the sandbox's VM runs (its disk must not change under it)."""
        return self.images.get_by_key(rec.template, rec.image_key)

    def console_tail(self, domain: str, lines: int = 20) -> str:
        path = self.hv.vm_dir(domain) / "console.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
