"""One libvirt connection and the VMs kernelhost runs through it.

Every domain is transient (``createXML``): destroying it removes it from libvirt. Domains are
named ``<prefix><id>``; each has a directory ``<run_dir>/<name>/`` holding its channel socket and
serial console log. ``destroy`` and ``reconcile`` remove both, so nothing outlives a VM.

libvirt-python is blocking; the service calls these methods through ``asyncio.to_thread``.
A libvirt connection is thread-safe.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree
from xml.sax.saxutils import quoteattr

import libvirt

from .domain import METADATA_NS, DomainSpec
from .errors import DomainNotFound, DomainStartFailed, HypervisorError, LibvirtUnavailable
from .forkram import (
    PageForkUnavailable,
    RamMapping,
    allocate_written,
    copy_base,
    copy_written,
    device_stream,
    find_ram,
)
from .images import GuestImage
from .migration import (
    begin_live_save,
    finish_live_save,
    load_state,
    migrate_live,
    save_devices,
    save_state,
)
from .ownership import dac_label, give_to_qemu, keep_images_from_qemu


def _silence_libvirt(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; they are raised as exceptions anyway."""


libvirt.registerErrorHandler(_silence_libvirt, None)


@dataclass(frozen=True)
class PageCopy:
    """What ``fork_pages`` copied (bytes) and how long the parent was paused for it (s)."""

    base: int
    written: int
    pages_seconds: float
    devices_seconds: float
    allocate_seconds: float = 0.0  # before the pause: room for the written pages in the file


@dataclass(frozen=True)
class DomainInfo:
    name: str
    uuid: str
    running: bool
    metadata: dict[str, str]


class Hypervisor:
    """Starts, lists and destroys kernelhost's domains on one libvirt connection."""

    def __init__(self, uri: str, prefix: str, run_dir: Path) -> None:
        if not prefix or not prefix.replace("-", "").isalnum():
            raise ValueError(f"domain prefix must be alphanumeric (dashes allowed), got {prefix!r}")
        self.uri = uri
        self.prefix = prefix
        self.run_dir = Path(run_dir)
        self._conn: libvirt.virConnect | None = None
        self._lock = threading.Lock()
        # domains whose destroy failed (libvirt away or restarting): retried by ``retry_destroys``
        self._doomed: set[str] = set()
        self._dac_label: str | None = None

    # -- connection ----------------------------------------------------------------------------

    @property
    def conn(self) -> libvirt.virConnect:
        with self._lock:
            if self._conn is None or not self._alive(self._conn):
                try:
                    self._conn = libvirt.open(self.uri)
                except libvirt.libvirtError as exc:
                    raise LibvirtUnavailable(self.uri, str(exc)) from exc
            return self._conn

    @property
    def dac_label(self) -> str:
        """libvirt's DAC label of its QEMU user, read once (``ownership.dac_label``)."""
        if self._dac_label is None:
            self._dac_label = dac_label(self.conn)
        return self._dac_label

    @staticmethod
    def _alive(conn: libvirt.virConnect) -> bool:
        """Whether ``conn`` still reaches its daemon. ``isAlive`` alone keeps saying yes after
        libvirtd restarted (nothing watches the socket), so one cheap call checks the pipe."""
        try:
            if not conn.isAlive():
                return False
            conn.getLibVersion()
            return True
        except libvirt.libvirtError:
            with contextlib.suppress(libvirt.libvirtError):
                conn.close()
            return False

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(libvirt.libvirtError):
                    self._conn.close()
                self._conn = None

    def versions(self) -> dict[str, str]:
        def fmt(v: int) -> str:
            return f"{v // 1_000_000}.{v // 1000 % 1000}.{v % 1000}"

        return {"libvirt": fmt(self.conn.getLibVersion()), "hypervisor": fmt(self.conn.getVersion())}

    # -- files ---------------------------------------------------------------------------------

    def vm_dir(self, name: str) -> Path:
        return self.run_dir / name

    def new_name(self) -> str:
        return f"{self.prefix}{uuidlib.uuid4().hex[:12]}"

    def spec_for(
        self,
        name: str,
        image: GuestImage,
        *,
        accel: str,
        memory_mib: int,
        vcpus: int,
        metadata: dict[str, str] | None = None,
        cmdline_extra: str = "",
        mem_path: Path | None = None,
        mem_share: bool = False,
        incoming: bool = False,
        cpu_quota_percent: int = 0,
        writable_size: str = "50%",
        partition: str = "",
    ) -> DomainSpec:
        """A DomainSpec whose per-VM files live under ``vm_dir(name)``, created here."""
        self._check_name(name)
        vm_dir = self.vm_dir(name)
        vm_dir.mkdir(parents=True, exist_ok=True)
        give_to_qemu(vm_dir)
        # what every VM starts from: root's, read-only to QEMU (libvirt leaves them so: dac_label)
        keep_images_from_qemu(image.kernel, image.initrd, image.rootfs, *image.layers)
        return DomainSpec(
            name=name,
            uuid=str(uuidlib.uuid4()),
            kernel=image.kernel,
            initrd=image.initrd,
            rootfs=image.rootfs,
            layers=image.layers,
            channel_socket=vm_dir / "agent.sock",
            console_log=vm_dir / "console.log",
            memory_mib=memory_mib,
            vcpus=vcpus,
            cpu_quota_percent=cpu_quota_percent,
            partition=partition,
            writable_size=writable_size,
            accel=accel,
            cmdline_extra=cmdline_extra,
            metadata=dict(metadata or {}),
            mem_path=mem_path,
            mem_share=mem_share,
            incoming=incoming,
            dac_label=self.dac_label,
        )

    def _check_name(self, name: str) -> None:
        if not name.startswith(self.prefix) or "/" in name or name in (".", ".."):
            raise ValueError(f"domain name {name!r} does not start with prefix {self.prefix!r}")

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, spec: DomainSpec) -> None:
        """Create and start a transient domain."""
        self._check_name(spec.name)
        try:
            virt_type = "test" if self.uri.startswith("test:") else None
            self.conn.createXML(spec.to_xml(virt_type), 0)
        except libvirt.libvirtError as exc:
            self.cleanup_files(spec.name)
            raise DomainStartFailed(spec.name, str(exc)) from exc

    def start_incoming(self, spec: DomainSpec) -> None:
        """Start a domain paused, waiting for a state (``load_into``), so a caller can prepare
        the state while QEMU starts."""
        self._check_name(spec.name)
        if not spec.incoming or spec.mem_path is None:
            raise ValueError("start_incoming needs a spec with incoming=True and a mem_path")
        virt_type = "test" if self.uri.startswith("test:") else None
        try:
            self.conn.createXML(spec.to_xml(virt_type), libvirt.VIR_DOMAIN_START_PAUSED)
        except libvirt.libvirtError as exc:
            self.cleanup_files(spec.name)
            raise DomainStartFailed(spec.name, str(exc)) from exc

    def load_into(self, name: str, state: Path, *, ignore_shared: bool, timeout: float = 120.0) -> None:
        """Load ``state`` into the domain ``start_incoming`` started, and resume it; on failure
        the domain is destroyed."""
        try:
            dom = self._lookup(name)
            load_state(dom, state, ignore_shared=ignore_shared, timeout=timeout)
            dom.resume()
        except (libvirt.libvirtError, HypervisorError) as exc:
            self.destroy(name)
            raise DomainStartFailed(name, f"loading {state}: {exc}") from exc

    def fork_into(self, parent: str, spec: DomainSpec, state: Path, timeout: float = 120.0) -> int:
        """Copy the running ``parent`` into a new paused domain whose RAM is a shared file
        (``spec.mem_path``, ``spec.mem_share``), then save that domain's device state without
        RAM to ``state``, as for a template: clones of (RAM file, state) are copies of the
        parent. The parent is paused only while its state is copied, then resumed. The new
        domain is left paused; the caller destroys it (off the critical path). Returns the size
        of ``state``."""
        self._check_name(spec.name)
        if not (spec.incoming and spec.mem_share and spec.mem_path is not None):
            raise ValueError("fork_into needs incoming=True, mem_share=True and a mem_path")
        src = self._lookup(parent)
        virt_type = "test" if self.uri.startswith("test:") else None
        try:
            dst = self.conn.createXML(spec.to_xml(virt_type), libvirt.VIR_DOMAIN_START_PAUSED)
        except libvirt.libvirtError as exc:
            self.cleanup_files(spec.name)
            raise DomainStartFailed(spec.name, str(exc)) from exc
        try:
            src.suspend()
            try:
                migrate_live(src, dst, timeout=timeout)
            finally:
                src.resume()
            return save_state(dst, state, ignore_shared=True, timeout=timeout)
        except libvirt.libvirtError as exc:
            raise HypervisorError(f"cannot copy domain {parent!r}: {exc}") from exc

    def fork_source(self, parent: str, memory_bytes: int) -> RamMapping:
        """Where the running ``parent`` maps its RAM (``memory_bytes``), if it can be forked page
        by page (``fork_pages``): ``PageForkUnavailable`` when its RAM is shared (a VM woken from
        disk) or QEMU's memory cannot be read here; copy it with ``fork_into`` then."""
        return find_ram(self.qemu_pid(parent), memory_bytes)

    def fork_pages(
        self, parent: str, source: RamMapping, ram: Path, state: Path, *, base: bool, machine: str
    ) -> PageCopy:
        """Copy the running ``parent`` (its RAM at ``source``, its ``machine_type``, asked
        before clones start: beside their start libvirt answers 0.12-0.22 s later) into ``ram``,
        a file made by ``forkram.make_ram_file`` (or holding the base's data: ``base=False``),
        and its devices into ``state``: the base's data and room for the written pages while it
        runs, then, paused, those pages and its devices. Clones load ``state`` with
        ``ignore_shared=False`` into ``ram`` mapped privately; they may be started (paused)
        before, as nothing reads their RAM until they run."""
        dom = self._lookup(parent)
        devices = state.with_name(state.name + ".devices")
        try:
            copied = copy_base(source.map_file, ram) if base else 0
            ta = time.monotonic()
            allocate_written(source, ram)  # while it runs: the paused copy then writes only
            t0 = time.monotonic()
            dom.suspend()
            try:
                written = copy_written(source, ram)
                t1 = time.monotonic()
                save_devices(dom, devices)
            finally:
                dom.resume()
            t2 = time.monotonic()
            state.write_bytes(device_stream(devices.read_bytes(), machine))
            return PageCopy(copied, written, t1 - t0, t2 - t1, t0 - ta)
        except (OSError, ValueError, libvirt.libvirtError) as exc:  # tmpfs full, QEMU gone, ...
            raise HypervisorError(f"cannot copy domain {parent!r} page by page: {exc}") from exc
        finally:
            devices.unlink(missing_ok=True)

    def qemu_pid(self, name: str) -> int:
        """The pid of the domain's QEMU process (libvirt's pid file)."""
        self._check_name(name)
        try:
            return int(Path(f"/run/libvirt/qemu/{name}.pid").read_text().strip())
        except (OSError, ValueError) as exc:
            raise PageForkUnavailable(f"no QEMU pid for domain {name!r}: {exc}") from exc

    def machine_type(self, name: str) -> str:
        """The machine type QEMU runs the domain as (``pc-i440fx-7.2``, say)."""
        node = ElementTree.fromstring(self.domain_xml(name)).find("os/type")
        machine = node.get("machine") if node is not None else None
        if not machine:
            raise HypervisorError(f"domain {name!r} names no machine type")
        return machine

    def freeze(
        self, name: str, state: Path, *, ignore_shared: bool, resume: bool = False, timeout: float = 120.0
    ) -> int:
        """Pause the domain and save its state to ``state``; resume it afterwards if asked.

        Returns the size of the state file.
        """
        dom = self._lookup(name)
        try:
            dom.suspend()
            try:
                return save_state(dom, state, ignore_shared=ignore_shared, timeout=timeout)
            finally:
                if resume:
                    dom.resume()
        except libvirt.libvirtError as exc:  # e.g. the domain died or was destroyed meanwhile
            raise HypervisorError(f"cannot freeze domain {name!r}: {exc}") from exc

    def live_save(self, name: str, state: Path) -> Callable[[float], int]:
        """Save the running domain's state as it is now without stopping it for the copy
        (``migration.begin_live_save``); returns once it runs again. Call the result (with a
        timeout) to wait for ``state`` to be complete; it returns the size."""
        dom = self._lookup(name)
        try:
            begin_live_save(dom, state)
        except libvirt.libvirtError as exc:
            raise HypervisorError(f"cannot save domain {name!r}: {exc}") from exc

        def finish(timeout: float) -> int:
            try:
                return finish_live_save(dom, state, timeout=timeout)
            except libvirt.libvirtError as exc:
                raise HypervisorError(f"cannot save domain {name!r}: {exc}") from exc

        return finish

    def set_metadata(self, name: str, metadata: dict[str, str]) -> None:
        attrs = "".join(f" {k}={quoteattr(str(v))}" for k, v in sorted(metadata.items()))
        try:
            self._lookup(name).setMetadata(
                libvirt.VIR_DOMAIN_METADATA_ELEMENT,
                f"<vm{attrs}/>",
                "kh",
                METADATA_NS,
                libvirt.VIR_DOMAIN_AFFECT_LIVE,
            )
        except libvirt.libvirtError as exc:
            raise HypervisorError(f"cannot set metadata of domain {name!r}: {exc}") from exc

    def _lookup(self, name: str) -> libvirt.virDomain:
        self._check_name(name)
        try:
            return self.conn.lookupByName(name)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                raise DomainNotFound(name) from exc
            raise HypervisorError(f"cannot look up domain {name!r}: {exc}") from exc

    def domain_xml(self, name: str) -> str:
        """The live XML of a domain, as libvirt runs it (for operators and post-mortems)."""
        try:
            return str(self._lookup(name).XMLDesc(0))
        except libvirt.libvirtError as exc:
            raise HypervisorError(f"cannot read the XML of domain {name!r}: {exc}") from exc

    def cpu_time(self, name: str) -> tuple[int, int]:
        """(CPU time the domain's vCPUs used, in ns; its vCPU count)."""
        try:
            _state, _max_kib, _kib, vcpus, cpu_ns = self._lookup(name).info()
        except libvirt.libvirtError as exc:
            raise HypervisorError(f"cannot read the CPU time of domain {name!r}: {exc}") from exc
        return int(cpu_ns), int(vcpus)

    def is_running(self, name: str) -> bool:
        try:
            dom = self.conn.lookupByName(name)
            return bool(dom.isActive())
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return False
            raise

    def destroy(self, name: str) -> bool:
        """Destroy the domain and remove its files. Idempotent: False if it was already gone.

        If libvirt cannot be reached the name is remembered and ``retry_destroys`` tries again
        later, so a destroy that failed while libvirtd restarted does not leak the VM."""
        self._check_name(name)
        existed = False
        try:
            dom = self.conn.lookupByName(name)
            existed = True
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()
            if dom.isPersistent():
                dom.undefine()
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                with self._lock:
                    self._doomed.add(name)
                raise HypervisorError(f"destroying domain {name!r} failed: {exc}") from exc
        except HypervisorError:
            with self._lock:
                self._doomed.add(name)
            raise
        with self._lock:
            self._doomed.discard(name)
        self.cleanup_files(name)
        return existed

    def retry_destroys(self) -> list[str]:
        """Destroy again every domain whose earlier destroy failed; the names destroyed now."""
        with self._lock:
            doomed = sorted(self._doomed)
        done = []
        for name in doomed:
            with contextlib.suppress(HypervisorError):
                self.destroy(name)
                done.append(name)
        return done

    @property
    def pending_destroys(self) -> int:
        with self._lock:
            return len(self._doomed)

    def cleanup_files(self, name: str) -> None:
        self._check_name(name)
        shutil.rmtree(self.vm_dir(name), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.qemu_log(name))

    def qemu_log(self, name: str) -> Path:
        """libvirt's log of the domain's QEMU (its command line, and why it exited)."""
        self._check_name(name)
        return Path("/var/log/libvirt/qemu") / f"{name}.log"

    def domains(self) -> list[DomainInfo]:
        """Every domain of this prefix that libvirt knows, running or not."""
        out = []
        for dom in self.conn.listAllDomains(0):
            name = dom.name()
            if not name.startswith(self.prefix):
                continue
            try:
                raw = dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS, 0)
                meta = dict(ElementTree.fromstring(raw).attrib)
            except (libvirt.libvirtError, ElementTree.ParseError):
                meta = {}
            try:
                active = bool(dom.isActive())
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    continue  # destroyed (a transient domain) between the listing and now
                raise
            out.append(DomainInfo(name, dom.UUIDString(), active, meta))
        return out

    def reconcile(self, keep: set[str]) -> list[str]:
        """Destroy every domain of our prefix not in ``keep``, and every stray VM directory."""
        removed = []
        for info in self.domains():
            if info.name not in keep:
                self.destroy(info.name)
                removed.append(info.name)
        if self.run_dir.is_dir():
            for path in self.run_dir.iterdir():
                if path.name.startswith(self.prefix) and path.name not in keep:
                    self.cleanup_files(path.name)
                    if path.name not in removed:
                        removed.append(path.name)
        return removed
