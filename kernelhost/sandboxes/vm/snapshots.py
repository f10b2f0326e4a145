"""Template snapshots: a booted, warmed-up VM frozen once per template, cloned copy-on-write.

A template VM boots with its RAM in a file on tmpfs mapped shared. Once its kernel is ready and
the template's heavy modules are imported (agent op ``prepare_snapshot``), it is paused and its
device state saved with ``x-ignore-shared`` (a few hundred KiB): the RAM stays in the file. A
clone maps that file privately and loads the state, so it starts without a boot and shares every
page it has not written with every other clone (how fast: bench/results/vm-mechanics.md).

In the code, "snapshot" means this and nothing else: a template's frozen VM. A VM's saved state
is a *state* (``hypervisor/migration.py``: saved, loaded, live-saved); E2B's snapshot is a kept
checkpoint, and the word stays at that surface (``api/e2b/snapshots.py``).

Snapshots are content-addressed by everything that makes them valid (the image build, the QEMU
and libvirt versions, the machine shape, the accelerator); a stale one is rebuilt on first use
and the old one's files removed (running clones keep their mapping of the unlinked file).

Once frozen, a snapshot is every tenant's starting point, so it is sealed (``_seal``): its
directory, state and metadata become root's and read-only to QEMU, and so does its RAM file
where this host's QEMU can map a file it may only read (``private_ram_may_be_read_only``:
QEMU 7.2 opens even a private mapping's file read-write, so there the RAM file stays its
user's, mode 0600; docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from hypervisor import GuestImage, Hypervisor, HypervisorError, device_model
from hypervisor.ownership import give_to_qemu, keep_from_qemu, private_ram_may_be_read_only

from ... import logs
from ...channel import AgentClient
from ...channel.protocol import Op
from ...progress import Stages, format_bytes
from ...tasks import to_thread_to_the_end

log = structlog.get_logger("kernelhost.snapshots")

FORMAT = 1  # bump when what goes into a snapshot changes
BUILD_STAGES = ["boot", "kernel ready", "warm-up", "freeze"]


@dataclass(frozen=True)
class Snapshot:
    template: str
    key: str
    path: Path
    image_key: str

    @property
    def ram(self) -> Path:
        return self.path / "ram"

    @property
    def state(self) -> Path:
        return self.path / "state"


Attach = Callable[[Path, float], Awaitable[AgentClient]]


def snapshot_key(image_key: str, versions: dict[str, str], memory_mib: int, vcpus: int, accel: str) -> str:
    """What a snapshot's name ends with: everything that makes it valid, hashed."""
    blob = json.dumps([FORMAT, image_key, versions, memory_mib, vcpus, accel, device_model()])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class TemplateSnapshots:
    """Finds or builds the snapshot of each template; one build per template at a time."""

    def __init__(
        self,
        hv: Hypervisor,
        ram_dir: Path,
        *,
        accel: str,
        memory_mib: int,
        vcpus: int,
        boot_timeout: float,
        warmup_timeout: float,
        attach: Attach,
    ) -> None:
        self.hv = hv
        self.dir = ram_dir / "templates"
        self.accel = accel
        self.memory_mib = memory_mib
        self.vcpus = vcpus
        self.boot_timeout = boot_timeout
        self.warmup_timeout = warmup_timeout
        self.attach = attach
        self._locks: dict[str, asyncio.Lock] = {}
        self.ram_read_only: bool | None = None  # probed by ``prepare``

    def prepare(self) -> None:
        """The snapshot directory, root's (QEMU writes only in a build's own directory), and
        whether QEMU can clone from a RAM file it may only read."""
        self.dir.mkdir(parents=True, exist_ok=True)
        keep_from_qemu(self.dir, 0o755)
        if self.ram_read_only is None:
            self.ram_read_only = private_ram_may_be_read_only(self.dir)
            if not self.ram_read_only:
                log.warning(
                    "snapshot.ram_writable_by_qemu",
                    reason="this QEMU opens a private mapping's RAM file read-write (QEMU < 8.2)",
                    hint="template RAM files stay writable to libvirt's QEMU user; docs/security.md",
                )

    def _seal(self, path: Path) -> None:
        """A frozen snapshot: root's and read-only to QEMU, but for its RAM file where this
        QEMU needs it writable to map it (idempotent)."""
        for name in ("state", "meta.json"):
            if (path / name).exists():
                keep_from_qemu(path / name, 0o644)
        if (path / "ram").exists():
            if self.ram_read_only:
                keep_from_qemu(path / "ram", 0o644)
            else:
                give_to_qemu(path / "ram", 0o600)
        keep_from_qemu(path, 0o755)

    def shape_of(self, image: GuestImage) -> tuple[int, int, str]:
        """(memory MiB, vCPUs, writable size) of the image's VMs: its template's, else the
        service's."""
        vm = image.manifest.get("vm") or {}
        memory = int(vm.get("memory_mib") or self.memory_mib)
        writable = f"{int(vm['writable_mib'])}m" if vm.get("writable_mib") else "50%"
        return memory, int(vm.get("vcpus") or self.vcpus), writable

    def key_for(self, image: GuestImage) -> str:
        memory, vcpus, _ = self.shape_of(image)
        return snapshot_key(image.key, self.hv.versions(), memory, vcpus, self.accel)

    def _shape(self, image: GuestImage) -> str:
        memory, vcpus, _ = self.shape_of(image)
        return f"{memory}m{vcpus}c{self.accel}"

    def _path(self, image: GuestImage, key: str) -> Path:
        return self.dir / f"{image.template}-{self._shape(image)}-{key}"

    def current(self, image: GuestImage) -> Snapshot | None:
        key = self.key_for(image)
        path = self._path(image, key)
        if (path / "meta.json").is_file() and (path / "ram").is_file():
            self._seal(path)  # one a service before this one built (a few stats when sealed)
            return Snapshot(image.template, key, path, image.key)
        return None

    async def ensure(self, image: GuestImage) -> Snapshot:
        """The valid snapshot of the image's template, built now if there is none."""
        lock = self._locks.setdefault(image.template, asyncio.Lock())
        async with lock:
            snap = await asyncio.to_thread(self.current, image)
            if snap is None:
                snap = await self._build(image)
                await asyncio.to_thread(self._remove_stale, snap)
            return snap

    async def _build(self, image: GuestImage) -> Snapshot:
        key = await asyncio.to_thread(self.key_for, image)
        final = self._path(image, key)
        memory, vcpus, writable = self.shape_of(image)
        work = self.dir / f".build-{final.name}-{uuid.uuid4().hex[:6]}"
        work.mkdir(parents=True)
        give_to_qemu(work)  # QEMU creates the RAM file here; sealed once frozen
        name = f"{self.hv.prefix}tpl{uuid.uuid4().hex[:9]}"
        preload = [m for m in image.manifest.get("preload", []) if isinstance(m, str)]
        bound = log.bind(template=image.template, key=key, domain=name)
        bound.info("snapshot.build_started", preload=preload)
        t0 = time.monotonic()

        def on_stage(n: int, total: int, stage: str, detail: str, elapsed: float) -> None:
            if stage != "done":  # snapshot.built says it
                bound.info(
                    "snapshot.build_stage", stage=stage, n=n, of=total, detail=detail, elapsed_s=elapsed
                )

        # a bar on a terminal (console logs), snapshot.build_stage events otherwise
        progress = Stages(f"snapshot {image.template}", BUILD_STAGES, tty=logs.console(), on_stage=on_stage)
        try:
            spec = self.hv.spec_for(
                name,
                image,
                accel=self.accel,
                memory_mib=memory,
                vcpus=vcpus,
                writable_size=writable,
                mem_path=work / "ram",
                mem_share=True,
                metadata={"role": "template", "template": image.template},
            )
            progress.stage("boot", f"{memory} MiB, {self.accel}")
            await to_thread_to_the_end(self.hv.start, spec)
            progress.stage("kernel ready")
            agent = await self.attach(spec.channel_socket, self.boot_timeout)
            try:
                progress.stage("warm-up", ", ".join(preload) or "kernel")
                await agent.request(Op.PREPARE_SNAPSHOT, timeout=self.warmup_timeout, preload=preload)
            finally:
                await agent.close()  # the guest sees the host leave; clones see a new one come
            progress.stage("freeze", "device state, RAM stays in its file")
            size = await asyncio.to_thread(self.hv.freeze, name, work / "state", ignore_shared=True)
            (work / "meta.json").write_text(
                json.dumps(
                    {
                        "template": image.template,
                        "key": key,
                        "image_key": image.key,
                        "memory_mib": memory,
                        "vcpus": vcpus,
                        "accel": self.accel,
                        "state_bytes": size,
                        "built_at": time.time(),
                        "build_seconds": round(time.monotonic() - t0, 2),
                    }
                )
            )
            # the template VM goes before the seal: nothing maps the RAM file shared any more
            await asyncio.shield(asyncio.to_thread(self.hv.destroy, name))
            await asyncio.to_thread(self._seal, work)
            if final.exists():  # another service on this host built the same snapshot meanwhile
                shutil.rmtree(work)
            else:
                work.rename(final)
        except BaseException as exc:
            progress.finish(f"{type(exc).__name__}: {exc}", failed=True)
            shutil.rmtree(work, ignore_errors=True)
            raise
        finally:
            with contextlib.suppress(HypervisorError):  # remembered and retried by the reaper
                await asyncio.shield(asyncio.to_thread(self.hv.destroy, name))
        progress.finish(format_bytes(size) + " of device state")
        bound.info("snapshot.built", seconds=round(time.monotonic() - t0, 2))
        return Snapshot(image.template, key, final, image.key)

    def _remove_stale(self, keep: Snapshot) -> None:
        """Remove older snapshots of the same template and shape (clones keep their mapping)."""
        shape = keep.path.name.removeprefix(f"{keep.template}-").rsplit("-", 1)[0]
        for path in self.dir.glob(f"{keep.template}-{shape}-*"):
            if path != keep.path:
                shutil.rmtree(path, ignore_errors=True)

    def remove(self, template: str) -> None:
        """Remove every snapshot of a template (it was deleted; running clones keep theirs)."""
        for path in self.dir.glob(f"{template}-*"):
            if path.name.removeprefix(f"{template}-").count("-") == 1:  # <shape>-<key>, not a longer name
                shutil.rmtree(path, ignore_errors=True)
