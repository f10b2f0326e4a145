"""What every part of the sandbox layer works with: settings, the VM backend, images, the registry of
sandboxes, the VM factory, metrics, the network, and the owner of background tasks. One
``Context`` is made by ``SandboxManager`` and handed to each part."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

from hypervisor import GuestImage, ImageStore

from ..config import Settings
from ..metrics import Metrics
from ..tasks import TaskSet
from .errors import StoreRowRefused
from .network import SandboxNetwork
from .registry import Registry, VmShape
from .store.sandboxes import SandboxRecord
from .vm.backend import VmBackend

log = structlog.get_logger("kernelhost.sandboxes")


@dataclass
class Context:
    settings: Settings
    images: ImageStore
    registry: Registry
    vms: VmBackend  # the one door to the VMs (vm/backend.py)
    metrics: Metrics
    network: SandboxNetwork
    tasks: TaskSet
    accel: str

    def shape_for(self, image: GuestImage) -> VmShape:
        """The machine new sandboxes of ``image`` get: its template's size, or the service's."""
        memory, vcpus = self.vms.shape_of(image)
        return VmShape(memory, vcpus, self.accel)

    def hibernation_file(self, rec: SandboxRecord) -> Path:
        """Where the sandbox's saved VM is: a file directly in ``hibernate_dir`` (a record from
        the store naming anything else, through its id or a link there, is refused and logged)."""
        directory = self.settings.hibernate_dir
        path = directory / f"{rec.id}.state"
        real = Path(os.path.realpath(path)) if "/" not in rec.id and "\0" not in rec.id else None
        if real is None or real != Path(os.path.realpath(directory)) / path.name:
            shown = rec.id[:100]
            log.warning("store.path_refused", what="hibernation file", sandbox_id=shown, path=str(path)[:300])
            raise StoreRowRefused(
                f"the saved VM of sandbox {shown!r} would lie outside this node's hibernate_dir; refused",
                sandbox_id=rec.id,
            )
        return path

    def drop_hibernation_file(self, rec: SandboxRecord) -> None:
        """Remove the sandbox's saved VM, if it has one this node may remove."""
        with contextlib.suppress(StoreRowRefused):
            self.hibernation_file(rec).unlink(missing_ok=True)

    def has_hibernation_file(self, rec: SandboxRecord) -> bool:
        try:
            return self.hibernation_file(rec).is_file()
        except StoreRowRefused:
            return False

    def image_of(self, rec: SandboxRecord) -> GuestImage:
        """The exact image build the sandbox's VM runs (its disk must not change under it)."""
        return self.images.get_by_key(rec.template, rec.image_key)
