"""Each API key's VMs in a CPU partition of their own (``hypervisor/cgroups.py``): a key's share
of a busy host does not grow with its number of busy sandboxes (docs/limits.md, "CPU").

A VM starts in its key's partition (``meta["key"]``, the key's id) or, when it belongs to no
key yet (a pooled clone, a fork's spare QEMU, an operator's template build), in the service's
own. A pooled clone or spare handed to a key is moved into the key's partition (cgroup v1; on
a v2 host it keeps counting in the service's). Partitions off (``cpu_weight_per_key = 0``) or
impossible here (no CPU controller, no permission): every verb is a no-op, and ``start`` has
logged once why.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from hypervisor import HypervisorError
from hypervisor.cgroups import ROOT, Partitions

log = structlog.get_logger("kernelhost.vms")


class KeyPartitions:
    """The service's CPU partitions, by key; blocking (cgroupfs), called in threads except
    ``place`` (a few directory operations on cgroupfs, before a VM starts)."""

    def __init__(self, prefix: str, weight: int, root: Path = ROOT) -> None:
        self.prefix = prefix
        self.weight = weight
        self.root = root
        self.parts: Partitions | None = None

    def start(self) -> None:
        """At service start: partitions if the setting asks and the host can; a previous run's
        partitions that still hold VMs are taken back, empty ones removed."""
        if not self.weight:
            return
        try:
            parts = Partitions.detect(self.prefix, self.weight, self.root)
            removed = parts.adopt()
        except HypervisorError as exc:
            log.warning(
                "vm.cpu_partitions_off",
                reason=str(exc),
                effect="each VM has its own CPU weight: a key's share grows with its busy sandboxes",
                remedy="run the service as root on a host with the cgroup cpu controller, "
                "or set cpu_weight_per_key = 0 to silence this",
            )
            return
        self.parts = parts
        log.info("vm.cpu_partitions", weight=self.weight, move_on_hand_over=parts.can_move, removed=removed)

    def place(self, domain: str, meta: dict[str, str]) -> str:
        """The partition ``domain`` starts in, made now if needed; "" (libvirt's default) when
        partitions are off or this one cannot be made (logged: the VM runs without)."""
        if self.parts is None:
            return ""
        try:
            return self.parts.place(domain, meta.get("key") or None) or ""
        except (HypervisorError, ValueError) as exc:
            log.warning("vm.cpu_partition_failed", domain=domain, error=str(exc))
            return ""

    def release(self, domain: str) -> None:
        """After ``domain`` stopped: its partition goes if it held the key's last VM."""
        if self.parts is None:
            return
        try:
            self.parts.release(domain)
        except HypervisorError as exc:  # removed at the next stop or start
            log.warning("vm.cpu_partition_left", domain=domain, error=str(exc))

    def move(self, domain: str, key: str) -> None:
        """A running VM handed to ``key`` (a pooled clone, a fork's spare) counts for it now."""
        if self.parts is None or not key:
            return
        try:
            moved = self.parts.move(domain, key)
        except (HypervisorError, ValueError) as exc:
            log.warning("vm.cpu_partition_move_failed", domain=domain, error=str(exc))
            return
        log.debug("vm.cpu_partition_moved", domain=domain, key=key, moved=moved)

    def close(self) -> None:
        """At service stop: the partitions of keys with no VM left go."""
        if self.parts is None:
            return
        try:
            removed = self.parts.close()
        except HypervisorError as exc:
            log.warning("vm.cpu_partitions_left", error=str(exc))
            return
        log.info("vm.cpu_partitions_removed", partitions=removed)
