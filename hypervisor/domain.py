"""Domain XML for a kernelhost VM: direct kernel boot, shared read-only root, one channel."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

CHANNEL_NAME = "org.kernelhost.0"
METADATA_NS = "urn:kernelhost:domain:1"
MEM_ID = "khram"  # id of the file-backed RAM object; must match between a save and a load
MAX_LAYERS = 8
PARTITION = re.compile(r"^/machine/[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class DomainSpec:
    """Everything that makes one VM; ``to_xml`` renders it for libvirt."""

    name: str
    uuid: str
    kernel: Path
    initrd: Path
    rootfs: Path
    channel_socket: Path
    console_log: Path
    memory_mib: int = 512
    vcpus: int = 1
    # CPU time each vCPU may use, in percent of one host CPU (libvirt cputune); 0: no cap
    cpu_quota_percent: int = 0
    # libvirt resource partition (``/machine/NAME``, made first: ``cgroups.Partitions``) whose
    # cgroup holds this VM's; "" for libvirt's default (``/machine``)
    partition: str = ""
    accel: str = "tcg"  # "tcg" or "kvm"
    writable_size: str = "50%"  # size of the tmpfs that holds the guest's writable layer
    cmdline_extra: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    # Guest RAM in a file (QEMU "VM templating"): a template maps it shared (mem_share=True) so a
    # freeze leaves its RAM in the file; a clone maps the same file privately (copy-on-write).
    # A directory instead of a file gives private, unnamed RAM that is still a file-backed block,
    # so a saved state taken from a clone can be loaded into it.
    mem_path: Path | None = None
    mem_share: bool = False
    incoming: bool = False  # start waiting for a migration stream (``-incoming defer``)
    # Read-only erofs layers stacked over ``rootfs`` (a template's), lowest first: vdb, vdc, ...
    layers: tuple[Path, ...] = ()
    # One writable raw disk after the layers (a template's build VM writes its layer there); the
    # host creates it for QEMU's user (the domain's static label keeps libvirt from relabelling)
    scratch_disk: Path | None = None
    # libvirt's DAC label of its QEMU user ("+uid:+gid"), set as the domain's static label with
    # relabel='no': QEMU runs as that user, and libvirt chowns none of the shared images (the
    # kernel, initramfs, root and layers stay root's, read-only to every QEMU; ownership.py)
    dac_label: str = ""

    def __post_init__(self) -> None:
        if self.accel not in ("tcg", "kvm"):
            raise ValueError(f"accel must be 'tcg' or 'kvm', got {self.accel!r}")
        if self.memory_mib < 128:
            raise ValueError(f"memory_mib must be at least 128, got {self.memory_mib}")
        if not 1 <= self.vcpus <= 64:
            raise ValueError(f"vcpus must be between 1 and 64, got {self.vcpus}")
        if not 0 <= self.cpu_quota_percent <= 100:
            raise ValueError(
                f"cpu_quota_percent must be between 0 (no cap) and 100, got {self.cpu_quota_percent}"
            )
        if self.partition and not PARTITION.fullmatch(self.partition):
            raise ValueError(f"partition must be /machine/NAME, got {self.partition!r}")
        if len(self.layers) > MAX_LAYERS:
            raise ValueError(f"at most {MAX_LAYERS} layers over a root image, got {len(self.layers)}")
        if len(str(self.channel_socket)) > 100:
            raise ValueError(
                f"channel socket path {self.channel_socket} is longer than a UNIX socket allows; "
                "choose a shorter run_dir"
            )

    @property
    def cmdline(self) -> str:
        parts = [
            "console=ttyS0",
            "quiet",
            "loglevel=3",
            "panic=-1",
            "mitigations=off",
            # an idle guest wakes its emulator only when it must (docs/kvm.md, "Idle CPU"): no
            # soft-lockup watchdog (an hrtimer and a thread every 4 s), no clocksource watchdog
            # (twice a second) over a TSC that the hypervisor keeps steady
            "nowatchdog",
            "tsc=reliable",
            f"kh.upper_size={self.writable_size}",
        ]
        if self.layers:
            parts.append(f"kh.layers={len(self.layers)}")
        if self.cmdline_extra:
            parts.append(self.cmdline_extra)
        return " ".join(parts)

    def to_xml(self, virt_type: str | None = None) -> str:
        """Render the domain; ``virt_type`` overrides the libvirt type (``test`` for the test driver)."""
        dtype = virt_type or ("kvm" if self.accel == "kvm" else "qemu")
        cpu = "<cpu mode='host-passthrough'/>" if self.accel == "kvm" else ""
        meta = "".join(f" {k}={quoteattr(str(v))}" for k, v in sorted(self.metadata.items()))
        return f"""<domain type='{dtype}' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{escape(self.name)}</name>
  <uuid>{escape(self.uuid)}</uuid>
  <metadata><kh:vm xmlns:kh='{METADATA_NS}'{meta}/></metadata>
  <memory unit='MiB'>{self.memory_mib}</memory>
  <vcpu>{self.vcpus}</vcpu>{self._cputune()}{self._resource()}
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>{self._boot()}
  </os>
  {cpu}
  <features><acpi/></features>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file={quoteattr(str(self.rootfs))}/>
      <target dev='vda' bus='virtio'/>
      <readonly/>
      <shareable/>
    </disk>{self._layer_disks()}{self._scratch_disk()}
    <controller type='usb' model='none'/>
    <controller type='virtio-serial' index='0'/>
    <channel type='unix'>
      <source mode='bind' path={quoteattr(str(self.channel_socket))}/>
      <target type='virtio' name='{CHANNEL_NAME}'/>
    </channel>
    <serial type='pty'>
      <log file={quoteattr(str(self.console_log))} append='off'/>
      <target port='0'/>
    </serial>
    <rng model='virtio'><backend model='random'>/dev/urandom</backend></rng>
    <memballoon model='none'/>
  </devices>{self._seclabel()}
  <qemu:commandline>{self._qemu_args()}
  </qemu:commandline>
  <qemu:capabilities><qemu:del capability='cpu-unavailable-features'/></qemu:capabilities>
</domain>
"""

    def _boot(self) -> str:
        """Direct kernel boot, except for a VM started for an incoming state: its kernel already
        runs in the RAM the state brings, and a reboot destroys the domain. Given ``-kernel``,
        QEMU reads the kernel image into a buffer of its own at start (about 14 MiB of anonymous
        memory, an idle clone's largest after TCG's code buffer) and keeps it for the firmware
        as long as the VM runs. The state loads the same without: the kernel, initrd and command
        line are firmware configuration (fw_cfg) items only, neither RAM blocks nor device state.
        """
        if self.incoming:
            return ""
        return f"""
    <kernel>{escape(str(self.kernel))}</kernel>
    <initrd>{escape(str(self.initrd))}</initrd>
    <cmdline>{escape(self.cmdline)}</cmdline>"""

    def _seclabel(self) -> str:
        if not self.dac_label:
            return ""
        label = escape(self.dac_label)
        return f"\n  <seclabel type='static' model='dac' relabel='no'><label>{label}</label></seclabel>"

    def _layer_disks(self) -> str:
        return "".join(
            f"""
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file={quoteattr(str(layer))}/>
      <target dev='vd{chr(ord("b") + n)}' bus='virtio'/>
      <readonly/>
      <shareable/>
    </disk>"""
            for n, layer in enumerate(self.layers)
        )

    @property
    def scratch_device(self) -> str:
        """The guest's name of ``scratch_disk`` (``vdb`` with no layers)."""
        return f"vd{chr(ord('b') + len(self.layers))}"

    def _scratch_disk(self) -> str:
        if self.scratch_disk is None:
            return ""
        return f"""
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file={quoteattr(str(self.scratch_disk))}/>
      <target dev='{self.scratch_device}' bus='virtio'/>
    </disk>"""

    def _cputune(self) -> str:
        if not self.cpu_quota_percent:
            return ""
        period = 100_000  # microseconds; the quota is per vCPU thread
        quota = period * self.cpu_quota_percent // 100
        return f"\n  <cputune><period>{period}</period><quota>{quota}</quota></cputune>"

    def _resource(self) -> str:
        if not self.partition:
            return ""
        return f"\n  <resource><partition>{escape(self.partition)}</partition></resource>"

    def _qemu_args(self) -> str:
        args: list[str] = []
        if self.mem_path is not None:
            share = "on" if self.mem_share else "off"
            args += [
                "-object",
                f"memory-backend-file,id={MEM_ID},size={self.memory_mib}M,"
                f"mem-path={self.mem_path},share={share}",
                "-machine",
                f"memory-backend={MEM_ID}",
            ]
        if self.incoming:
            args += ["-incoming", "defer"]
        return "".join(f"\n    <qemu:arg value={quoteattr(a)}/>" for a in args)


def device_model() -> str:
    """A digest of the guest-visible machine every DomainSpec renders (devices, their order and
    options) for snapshot keys: a saved device state only loads into the same machine."""
    probe = DomainSpec(
        name="x",
        uuid="00000000-0000-0000-0000-000000000000",
        kernel=Path("k"),
        initrd=Path("i"),
        rootfs=Path("r"),
        channel_socket=Path("s"),
        console_log=Path("c"),
    )
    return hashlib.sha256(probe.to_xml().encode()).hexdigest()[:16]
