"""The VM side of checkpoints: freeze a running VM's whole state, keep of it only what differs
from its template snapshot, compressed; and start a VM from such a file.

A checkpoint is taken in two steps. ``freeze`` saves the VM's whole state (RAM included) to a
file on tmpfs: the VM is paused while QEMU writes it (about half a second under emulation), then
resumed. With ``live_checkpoints = "on"`` (and a host that lets QEMU use userfaultfd,
``vm.unprivileged_userfaultfd = 1``) it is a *live* save, QEMU's background snapshot: the VM is
paused only while its devices are saved and its RAM write-protected (tens of milliseconds), and
runs on while its pages are written, each before the guest's first write to it;
``Saving.finish`` waits for the file. Under emulation on two cores the live save takes about
twice as long, slows the guest meanwhile, and holds the next checkpoint back until it is done,
so it is not the default (docs/checkpoints.md has the figures). ``store`` then, off the
sandbox's path, drops every RAM page that equals the template snapshot's page at that offset
(``hypervisor.diff_stream``) and compresses the rest (zstd) into the checkpoint's file on disk.
``launch`` loads that file into a new VM whose RAM maps the same snapshot privately, like any
clone: the pages the file no longer carries are already there.

The snapshot a checkpoint was diffed against is its ``base``: that snapshot's directory and
build time. A pin file in the snapshot (``pins/<checkpoint id>``) keeps pruning from removing it
while the checkpoint exists; a base rebuilt since (the host restarted and its tmpfs was emptied)
makes the checkpoint unusable, which ``launch`` says rather than loading a wrong RAM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import structlog
import zstandard

from hypervisor import MEM_ID, GuestImage, HypervisorError, LiveSaveUnavailable, diff_stream

from ...tasks import to_thread_to_the_end
from ..errors import CheckpointUnusable, StoreRowRefused
from ..trust import inside
from .backend import Saving
from .fork import VmFactory as ForkHost
from .launched import Launched
from .snapshots import Snapshot

log = structlog.get_logger("kernelhost.checkpoints")

STORE_CONCURRENCY = 2  # checkpoints diffed and compressed at once (each reads a whole VM state)
ZSTD_LEVEL = 1


class Host(ForkHost, Protocol):
    """What checkpoint files use of the factory that owns them (``factory.VmFactory``)."""

    ram_dir: Path

    @property
    def use_snapshots(self) -> bool: ...


class CheckpointFiles:
    """The libvirt backend's ``StateFiles`` (``backend.py``)."""

    def __init__(self, vms: Host, checkpoint_dir: Path, live: str = "off") -> None:
        self.vms = vms
        self.dir = checkpoint_dir
        self.tmp = vms.ram_dir / "checkpoints" / vms.hv.prefix.rstrip("-")
        #: whole states in tmpfs or being diffed at once (taken before a freeze, given back after
        #: the diff): each is up to a VM's RAM, and a burst of checkpoints must not fill the host
        self.slots = asyncio.Semaphore(STORE_CONCURRENCY)
        self.live: bool | None = None if live == "on" else False  # None: not tried yet

    def prepare(self) -> None:
        """Create the directories; remove what a killed predecessor left half written."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for part in self.dir.glob("*/*.part"):
            part.unlink(missing_ok=True)

    def close(self) -> None:
        """At shutdown: this service's tmpfs directory goes (a state a cancelled write left too)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def path_for(self, sandbox_id: str, checkpoint_id: str) -> Path:
        return self.dir / sandbox_id / f"{checkpoint_id}.zst"

    def own(self, path: str | Path, checkpoint_id: str) -> Path:
        """A checkpoint's file as its record names it, if it lies in this node's checkpoint_dir
        (records come from a store other nodes share: one naming any other path is refused)."""
        real = inside(path, self.dir)
        if real is None:
            log.warning(
                "store.path_refused",
                what="checkpoint file",
                checkpoint_id=checkpoint_id,
                path=str(path)[:300],
            )
            raise StoreRowRefused(
                f"the file of checkpoint {checkpoint_id} lies outside this node's checkpoint_dir; refused",
                checkpoint_id=checkpoint_id,
            )
        return real

    def own_base(self, base: dict[str, Any], checkpoint_id: str) -> Path | None:
        """The template snapshot a checkpoint's record names as its base, if it is one of this
        node's (None: it has none); else refused, as ``own``."""
        if not base.get("path"):
            return None
        real = inside(str(base["path"]), self.vms.snapshots.dir)
        if real is None:
            log.warning(
                "store.path_refused",
                what="checkpoint base",
                checkpoint_id=checkpoint_id,
                path=str(base["path"])[:300],
            )
            raise StoreRowRefused(
                f"the base snapshot of checkpoint {checkpoint_id} is not one of this node's; refused",
                checkpoint_id=checkpoint_id,
            )
        return real

    # -- taking --------------------------------------------------------------------------------

    async def freeze(self, domain: str) -> Saving:
        """The running VM's whole state as it is now, in a file on tmpfs (being written, for a
        live save); the VM runs again when this returns."""
        path = self.tmp / f"{domain}-{uuid.uuid4().hex[:8]}.state"
        try:
            if self.live is not False:
                try:
                    finish = await asyncio.to_thread(self.vms.hv.live_save, domain, path)
                    self.live = True
                    return Saving(path, finish)
                except LiveSaveUnavailable as exc:
                    self.live = False
                    log.warning(
                        "checkpoint.live_unavailable",
                        error=str(exc),
                        hint="set vm.unprivileged_userfaultfd=1 for live checkpoints; until the "
                        "service restarts, checkpoints pause their VM while it is saved",
                    )
            await asyncio.to_thread(self.vms.hv.freeze, domain, path, ignore_shared=False, resume=True)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return Saving(path)

    async def complete(self, saving: Saving, timeout: float = 300.0) -> None:
        """Wait until a live save's file is whole (nothing to wait for otherwise)."""
        if saving.finish is not None:
            finish, saving.finish = saving.finish, None
            await asyncio.to_thread(finish, timeout)

    async def store(
        self, full: Path, dest: Path, image: GuestImage, checkpoint_id: str
    ) -> tuple[int, dict[str, Any]]:
        """Write the checkpoint file ``dest`` from the whole state ``full``; its size and base."""
        snap = self.vms.snapshots.current(image) if self.vms.use_snapshots else None
        base = _base_of(snap) if snap is not None else {}
        t0 = time.monotonic()
        size = await asyncio.to_thread(_write, full, dest, snap.ram if snap is not None else None)
        if snap is not None:
            _pin(snap.path, checkpoint_id)
        log.info(
            "checkpoint.stored",
            checkpoint_id=checkpoint_id,
            live=bool(self.live),
            bytes=size,
            state_bytes=full.stat().st_size,
            ms=round((time.monotonic() - t0) * 1000),
        )
        return size, base

    def remove(self, path: Path, checkpoint_id: str, base: dict[str, Any]) -> None:
        """Delete a checkpoint's file and its pin on the base (idempotent); what lies outside
        this node's directories is left alone (refused and logged)."""
        with contextlib.suppress(StoreRowRefused):
            own = self.own(path, checkpoint_id)
            own.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                own.parent.rmdir()  # the sandbox's directory, once empty
        with contextlib.suppress(StoreRowRefused):
            snapshot = self.own_base(base, checkpoint_id)
            if snapshot is not None and "/" not in checkpoint_id:
                (snapshot / "pins" / checkpoint_id).unlink(missing_ok=True)

    # -- loading -------------------------------------------------------------------------------

    def _snapshot(self, image: GuestImage, base: dict[str, Any], checkpoint_id: str) -> Snapshot | None:
        path = self.own_base(base, checkpoint_id)
        if path is None:
            return None
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            meta = {}
        if meta.get("built_at") != base.get("built_at") or not (path / "ram").is_file():
            raise CheckpointUnusable(
                f"the template snapshot this checkpoint was taken over ({path.name}) is gone or was "
                "rebuilt since (the host restarted?), so its memory cannot be put back; take a new "
                "checkpoint",
                base=path.name,
            )
        return Snapshot(image.template, str(meta.get("key", "")), path, image.key)

    def check(self, image: GuestImage, path: Path, base: dict[str, Any]) -> Snapshot | None:
        """``CheckpointUnusable`` unless the checkpoint's file and base are there (a restore
        asks before it lets the sandbox's VM go); its base snapshot, if it has one."""
        snap = self._snapshot(image, base, path.stem)
        path = self.own(path, path.stem)
        if not path.is_file():
            raise CheckpointUnusable(f"the file of this checkpoint is missing ({path.name})", file=str(path))
        return snap

    async def launch(
        self, domain: str, image: GuestImage, path: Path, base: dict[str, Any], meta: dict[str, str]
    ) -> Launched:
        """Start ``domain`` from the checkpoint file ``path``; on failure nothing of it is left."""
        snap = self.check(image, path, base)
        vms = self.vms
        t0 = time.monotonic()
        state = self.tmp / f"{domain}-load.state"
        try:
            spec = vms.spec(domain, image, meta, mem_path=snap.ram if snap else None, incoming=True)
            # QEMU starts (about 0.2 s) while the file is unpacked
            started = asyncio.ensure_future(to_thread_to_the_end(vms.hv.start_incoming, spec))
            try:
                await asyncio.to_thread(_unpack, path, state)
            finally:
                await started
            launched = await vms.load_attached(spec, state, ignore_shared=False, how="checkpoint", t0=t0)
        except BaseException:
            await vms.destroy(domain)
            raise
        finally:
            state.unlink(missing_ok=True)
        timings = launched.timings
        log.info(
            "checkpoint.loaded",
            domain=domain,
            load_ms=round(timings.start * 1000),
            attach_ms=round(timings.attach * 1000),
            hygiene_ms=round(timings.hygiene * 1000),
        )
        return launched


def _base_of(snap: Snapshot) -> dict[str, Any]:
    try:
        built_at = json.loads((snap.path / "meta.json").read_text()).get("built_at")
    except (OSError, ValueError) as exc:
        raise HypervisorError(f"the template snapshot {snap.path.name} cannot be read: {exc}") from exc
    return {"path": str(snap.path), "built_at": built_at}


def _pin(snapshot_dir: Path, checkpoint_id: str) -> None:
    pins = snapshot_dir / "pins"
    pins.mkdir(exist_ok=True)
    (pins / checkpoint_id).touch()


def _write(full: Path, dest: Path, base_ram: Path | None) -> int:
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    part = dest.with_suffix(".part")
    try:
        with contextlib.ExitStack() as stack:
            src = stack.enter_context(full.open("rb"))
            data = stack.enter_context(_mapped(src.fileno()))
            base = None
            if base_ram is not None:
                bf = stack.enter_context(base_ram.open("rb"))
                base = stack.enter_context(_mapped(bf.fileno()))
            out = stack.enter_context(part.open("wb"))
            compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=2)
            writer = stack.enter_context(compressor.stream_writer(out, closefd=False))
            diff_stream(data, writer.write, main_block=MEM_ID, base=base)
        os.replace(part, dest)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return dest.stat().st_size


@contextlib.contextmanager
def _mapped(fd: int) -> Iterator[mmap.mmap]:
    """A read-only mapping of ``fd``, unmapped on exit unless views of it are still alive (the
    traceback of an error raised while reading it holds some): then it is left to the collector,
    and the error itself goes on, rather than a ``BufferError`` in its place."""
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    try:
        yield m
    finally:
        with contextlib.suppress(BufferError):
            m.close()


def _unpack(path: Path, state: Path) -> None:
    with path.open("rb") as src, state.open("wb") as out:
        zstandard.ZstdDecompressor().copy_stream(src, out, write_size=1 << 20)
