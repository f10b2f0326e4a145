"""Checkpoints: a sandbox's whole state (kernel memory, the writable files, the shell) kept on
disk, to rewind the same sandbox to (``restore``), to start a new one from (``branch``), or, with
``auto_checkpoint``, to undo the last calls.

Taking one holds the sandbox's execution lock only while its VM is paused and saved
(``StateFiles.freeze``); the diff against the template snapshot and the compression run
afterwards, as an owned task, while the sandbox answers again. A restore replaces the sandbox's
VM with one loaded from the file (same id, owner, network mode; fresh clock and random seeds);
a call running at that moment ends with status ``restored``. Automatic checkpoints are taken
right after each call, in the background, as the state "before the next call" (a call that
comes before it is written takes it first, synchronously); the newest ``keep`` + 1 are kept.

Budgets: ``max_checkpoint_bytes_per_key`` (the compressed files of a key's checkpoints, kept
ones included) and ``max_checkpoints_per_sandbox`` (those taken by hand); either answers
``CapacityExceeded`` naming it, and nothing of the sandbox or its other checkpoints is lost.

A checkpoint goes with its sandbox unless it is *kept* (``keep``: E2B's snapshots), which only
deleting it ends; its record holds what a branch needs of the sandbox (the network mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from hypervisor import GuestImage, HypervisorError, ImageNotFound, StreamNotUnderstood

from ...channel import ChannelError
from ..context import Context
from ..errors import (
    BootFailed,
    CapacityExceeded,
    CheckpointNotFound,
    CheckpointUnusable,
    InvalidRequest,
    SandboxBusy,
    SandboxError,
    SandboxNotFound,
)
from ..lifecycle.create import Lifecycle
from ..network import NetworkSpec
from ..registry import new_record
from ..sandbox import Sandbox, ensure_usable, wait_replacement
from ..states import SandboxState
from ..store.checkpoints import (
    CheckpointRecord,
    CheckpointStore,
    check_label,
    is_checkpoint_id,
    new_checkpoint_id,
)
from ..vm.backend import Saving
from .auto import AutoCheckpoints

log = structlog.get_logger("kernelhost.checkpoints")


@dataclass
class Frozen:
    """A sandbox's whole state, saved (or, live, being saved) and waiting to be diffed into a
    checkpoint. While a live save is written, ``vm_lock`` is held (no fork, hibernation or
    restore may take the VM) and ``_store`` releases it."""

    saving: Saving
    image: GuestImage
    vm_lock: asyncio.Lock | None = None
    slot: asyncio.Semaphore | None = None  # given back once the state is diffed


#: ``Recoverer.swap_vm``: the one way a sandbox changes VM
SwapVm = Callable[..., Awaitable[bool]]


class Checkpoints:
    def __init__(self, ctx: Context, lifecycle: Lifecycle, store: CheckpointStore, swap_vm: SwapVm) -> None:
        self.ctx = ctx
        self.lifecycle = lifecycle
        self.registry = ctx.registry
        self.store = store
        self.swap_vm = swap_vm
        self.files = ctx.vms.checkpoint_files(ctx.settings.checkpoint_dir, ctx.settings.live_checkpoints)
        self._writing: dict[str, set[asyncio.Task[CheckpointRecord]]] = {}
        self.auto = AutoCheckpoints(ctx, self)
        lifecycle.on_remove.append(self.drop_all)

    def close(self) -> None:
        """At service stop, once no checkpoint is being written."""
        self.files.close()

    def start(self) -> None:
        """At service start, after reconcile: files and records no live sandbox owns go (kept
        checkpoints stay)."""
        self.files.prepare()
        live = {s.id for s in self.registry}
        if self.registry.store.shared:  # a cluster: other nodes' sandboxes keep theirs
            live |= self.registry.store.ids()
        for cp in self.store.all():
            if cp.sandbox_id not in live and not cp.keep:
                self._delete(cp)
        known = {Path(cp.path) for cp in self.store.all()}
        for path in self.files.dir.glob("*/*.zst"):
            if path not in known:
                path.unlink(missing_ok=True)

    # -- lookups ---------------------------------------------------------------------------------

    def get(self, owner: str, checkpoint_id: str) -> CheckpointRecord:
        cp = self.store.get(checkpoint_id) if is_checkpoint_id(checkpoint_id) else None
        if cp is None or cp.owner != owner:
            raise CheckpointNotFound(str(checkpoint_id)[:80])
        return cp

    def of(self, sbx: Sandbox) -> list[CheckpointRecord]:
        return self.store.of_sandbox(sbx.id)

    def of_owner(self, owner: str, *, kept_only: bool = False) -> list[CheckpointRecord]:
        """Every checkpoint of the key, its gone sandboxes' kept ones included, oldest first."""
        return self.store.of_owner(owner, kept_only=kept_only)

    # -- taking ----------------------------------------------------------------------------------

    async def checkpoint(
        self, sbx: Sandbox, label: str | None = None, *, keep: bool = False
    ) -> CheckpointRecord:
        """Freeze the sandbox's whole state into a new checkpoint; it runs on once it is saved.
        ``keep``: the checkpoint outlives the sandbox, until deleted."""
        label = check_label(label)
        manual = [c for c in self.of(sbx) if not c.auto]
        limit = self.ctx.settings.max_checkpoints_per_sandbox
        if len(manual) >= limit:
            raise CapacityExceeded(
                f"sandbox {sbx.id} keeps {len(manual)} checkpoints, the limit "
                f"(max_checkpoints_per_sandbox); delete some first",
                limit="max_checkpoints_per_sandbox",
                value=limit,
            )
        self._check_budget(sbx.record.owner, 0)
        async with sbx.lock.hold("checkpoint"):
            frozen = await self.freeze(sbx)
        return await self.write(sbx, frozen, label=label, keep=keep)

    def _check_budget(self, owner: str, adding: int) -> None:
        used = self.store.bytes_of(owner)
        limit = self.ctx.settings.max_checkpoint_bytes_per_key
        if used + adding > limit or used >= limit:
            more = f"; this one takes {adding} bytes more" if adding else ""
            raise CapacityExceeded(
                f"this API key's checkpoints take {used} bytes of disk{more}, over the limit of "
                f"{limit} bytes (max_checkpoint_bytes_per_key); delete checkpoints, or raise the setting",
                limit="max_checkpoint_bytes_per_key",
                value=limit,
            )

    async def freeze(self, sbx: Sandbox) -> Frozen:
        """The caller holds ``sbx.lock``: the saved state is the kernel between calls. At most
        ``STORE_CONCURRENCY`` whole states wait in tmpfs at once (each is a VM's RAM): a slot is
        taken here and given back once ``_store`` has diffed the state."""
        await wait_replacement(sbx)
        ensure_usable(sbx)
        slots = self.files.slots
        await slots.acquire()
        try:
            frozen = await self._freeze_vm(sbx)
        except BaseException:
            slots.release()
            raise
        frozen.slot = slots
        return frozen

    async def _freeze_vm(self, sbx: Sandbox) -> Frozen:
        await sbx.vm_lock.acquire()
        held = True
        try:
            if not self.registry.holds(sbx):
                raise SandboxNotFound(sbx.id)
            rec = sbx.record
            image = self.ctx.image_of(rec)
            if rec.state == SandboxState.HIBERNATED:  # its saved state is already on disk
                hib = self.ctx.hibernation_file(rec)
                link = hib.with_name(f"{hib.name}.cp-{new_checkpoint_id()}")
                link.hardlink_to(hib)  # a wake's unlink leaves this name
                return Frozen(Saving(link), image)
            saving = await self.files.freeze(rec.domain)
            if saving.finish is None:
                return Frozen(saving, image)
            held = False  # a live save: _store releases it once the file is whole
            return Frozen(saving, image, vm_lock=sbx.vm_lock)
        except (HypervisorError, OSError) as exc:
            raise BootFailed(
                f"the state of sandbox {sbx.id} could not be saved: {exc}", sandbox_id=sbx.id
            ) from exc
        finally:
            if held:
                sbx.vm_lock.release()

    async def write(
        self,
        sbx: Sandbox,
        frozen: Frozen,
        *,
        label: str = "",
        auto: bool = False,
        call_index: int = 0,
        keep: bool = False,
    ) -> CheckpointRecord:
        """Diff and compress ``frozen`` into a checkpoint in an owned task (a client that goes
        away does not leave it half done); a restore waits for the sandbox's writes."""
        rec = sbx.record
        cp = CheckpointRecord(
            id=new_checkpoint_id(),
            sandbox_id=rec.id,
            owner=rec.owner,
            template=rec.template,
            image_key=frozen.image.key,
            path="",
            label=label,
            auto=auto,
            call_index=call_index,
            keep=keep,
            network=dict(rec.network),
        )
        cp.path = str(self.files.path_for(rec.id, cp.id))
        task = self.ctx.tasks.spawn(
            self._store(sbx, frozen, cp), name=f"checkpoint:{cp.id}", expected=(SandboxError,)
        )
        pending = self._writing.setdefault(sbx.id, set())
        pending.add(task)
        task.add_done_callback(pending.discard)
        return await asyncio.shield(task)

    async def _store(self, sbx: Sandbox, frozen: Frozen, cp: CheckpointRecord) -> CheckpointRecord:
        path = frozen.saving.path
        try:
            try:
                await self.files.complete(frozen.saving)
            finally:
                if frozen.vm_lock is not None:
                    frozen.vm_lock.release()
            cp.bytes, cp.base = await self.files.store(path, Path(cp.path), frozen.image, cp.id)
        except (OSError, HypervisorError, StreamNotUnderstood) as exc:
            raise BootFailed(f"checkpoint of sandbox {sbx.id} failed: {exc}", sandbox_id=sbx.id) from exc
        finally:
            path.unlink(missing_ok=True)
            if frozen.slot is not None:
                frozen.slot.release()
        if not self.registry.holds(sbx):  # deleted meanwhile
            self.files.remove(Path(cp.path), cp.id, cp.base)
            raise SandboxNotFound(sbx.id)
        try:
            self._check_budget(cp.owner, cp.bytes)
        except CapacityExceeded:
            self.files.remove(Path(cp.path), cp.id, cp.base)
            raise
        if cp.auto:
            for old in self.of(sbx):  # a later state's "before call n" is now in the future
                if old.auto and old.call_index >= cp.call_index:
                    self._delete(old)
        self.store.insert(cp)
        if cp.auto:
            autos = [c for c in self.of(sbx) if c.auto]
            for old in autos[: max(0, len(autos) - (sbx.record.auto_checkpoint + 1))]:
                self._delete(old)
        log.info("checkpoint.taken", sandbox_id=sbx.id, checkpoint_id=cp.id, bytes=cp.bytes, auto=cp.auto)
        return cp

    async def wait_writes(self, sbx: Sandbox) -> None:
        """Wait for the checkpoints of ``sbx`` being written (their errors are theirs)."""
        pending = list(self._writing.get(sbx.id, ()))
        if pending:
            await asyncio.gather(*[asyncio.shield(t) for t in pending], return_exceptions=True)

    # -- restore, undo, branch -------------------------------------------------------------------

    async def restore(self, sbx: Sandbox, checkpoint_id: str, *, stale: bool = True) -> CheckpointRecord:
        """Rewind ``sbx`` to its checkpoint; a call running now ends with status ``restored``."""
        cp = self.get(sbx.record.owner, checkpoint_id)
        if cp.sandbox_id != sbx.id:
            raise InvalidRequest(
                f"checkpoint {cp.id} is of sandbox {cp.sandbox_id}, not {sbx.id}; start a new "
                "sandbox from it (create with checkpoint) or restore that sandbox",
                field="checkpoint",
            )
        await self.wait_writes(sbx)
        if sbx.call is not None:
            sbx.call.notify("restored", checkpoint=cp.id)
        timeout = self.ctx.settings.agent_timeout
        try:
            async with asyncio.timeout(timeout):
                await sbx.lock.lease("restore")
        except TimeoutError:
            raise SandboxBusy(
                f"sandbox {sbx.id} is busy (an attached Jupyter client's cell, or a checkpoint) and "
                f"did not come free within {timeout:g}s; interrupt it and retry",
                sandbox_id=sbx.id,
            ) from None
        try:
            task = self.ctx.tasks.spawn(
                self._rewind(sbx, cp), name=f"restore:{sbx.id}", expected=(SandboxError,)
            )
            sbx.replacement = task
            if not await asyncio.shield(task):
                raise SandboxNotFound(sbx.id)
        finally:
            sbx.lock.end_lease("restore")
        sbx.checkpoint_stale = stale
        return cp

    async def _rewind(self, sbx: Sandbox, cp: CheckpointRecord) -> bool:
        async with sbx.vm_lock:
            if not self.registry.holds(sbx):
                return False
            t0 = time.monotonic()
            image = self._image(cp)
            self.files.check(image, Path(cp.path), cp.base)  # an unusable one loses nothing

            async def start() -> None:
                self.registry.update(sbx, image_key=cp.image_key)
                await self._launch(sbx, cp, image)

            # the old VM goes while the new one loads
            if not await self.swap_vm(sbx, start, f"restoring checkpoint {cp.id}", wait=False):
                return False
            self.registry.touch(sbx)
            log.info(
                "checkpoint.restored",
                sandbox_id=sbx.id,
                checkpoint_id=cp.id,
                ms=round((time.monotonic() - t0) * 1000),
            )
            return True

    def _image(self, cp: CheckpointRecord) -> GuestImage:
        try:
            return self.ctx.images.get_by_key(cp.template, cp.image_key)
        except ImageNotFound as exc:
            raise CheckpointUnusable(
                f"the image build this checkpoint ran ({cp.template}, {cp.image_key}) is gone; "
                "take a new checkpoint",
                checkpoint_id=cp.id,
            ) from exc

    async def _launch(self, sbx: Sandbox, cp: CheckpointRecord, image: GuestImage) -> None:
        rec = sbx.record
        meta = {"sandbox": rec.id, "template": rec.template, "key": rec.owner}
        try:
            launched = await self.files.launch(rec.domain, image, Path(cp.path), cp.base, meta)
        except (HypervisorError, ChannelError, TimeoutError, OSError) as exc:
            raise BootFailed(
                f"checkpoint {cp.id} could not be loaded: {exc or type(exc).__name__}", sandbox_id=rec.id
            ) from exc
        self.lifecycle.bind(sbx, launched.agent)
        await self.ctx.network.configure(sbx, strict=True)

    async def undo(self, sbx: Sandbox, n: int = 1) -> CheckpointRecord:
        """Rewind ``sbx`` to before its ``n``-th last call (``auto_checkpoint`` must be on)."""
        keep = sbx.record.auto_checkpoint
        if not keep:
            raise InvalidRequest(
                f"sandbox {sbx.id} was created without auto_checkpoint, so no state is kept before "
                "its calls; create sandboxes with auto_checkpoint=true to undo calls, or take "
                "checkpoints yourself",
                field="n",
            )
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= keep:
            raise InvalidRequest(
                f"n={n!r} is out of range; undo 1 to {keep} calls (its auto_checkpoint)", field="n"
            )
        await self.wait_writes(sbx)
        target = sbx.record.calls - n + 1
        cp = next((c for c in self.of(sbx) if c.auto and c.call_index == target), None)
        if target < 1 or cp is None:
            raise CheckpointNotFound(
                f"undo n={n}",
                why=f"sandbox {sbx.id} has no checkpoint from before call {target} (it ran "
                f"{sbx.record.calls} calls; the last {keep} are kept, and a checkpoint that failed "
                "or was over the budget is missing)",
            )
        await self.restore(sbx, cp.id, stale=False)
        self.registry.update(sbx, calls=target - 1)
        for later in self.of(sbx):
            if later.auto and later.call_index > target:
                self._delete(later)
        return cp

    async def branch(
        self,
        owner: str,
        checkpoint_id: str,
        idle_timeout: int,
        metadata: dict[str, str],
        network: NetworkSpec | None = None,
    ) -> Sandbox:
        """A new sandbox of ``owner`` holding the state of the checkpoint, in the network mode
        ``network`` or (None) the one its sandbox had when the checkpoint was taken."""
        cp = self.get(owner, checkpoint_id)
        image = self._image(cp)
        net = network.to_dict() if network is not None else self._network_of(cp)
        shape = self.ctx.shape_for(image)
        async with self.registry.admit(owner, 1, shape.memory_mib):
            rec = new_record(
                owner=owner,
                template=cp.template,
                domain=self.ctx.vms.new_name(),
                image_key=cp.image_key,
                shape=shape,
                idle_timeout=idle_timeout,
                metadata={**metadata, "branched_from": cp.id},
                network=net,
            )
            source = self.registry.find(cp.sandbox_id)  # its guest's memory holds the same user
            rec.run_as = source.record.run_as if source is not None else ""
            sbx = Sandbox(rec)
            await self.lifecycle.admit(sbx, lambda: self._launch(sbx, cp, image))
        log.info("checkpoint.branched", sandbox_id=rec.id, checkpoint_id=cp.id)
        return sbx

    def _network_of(self, cp: CheckpointRecord) -> dict[str, Any]:
        """The checkpoint's network mode; a record from before it was kept: its sandbox's, if
        that still runs, else none."""
        if cp.network:
            return dict(cp.network)
        source = self.registry.find(cp.sandbox_id)
        return dict(source.record.network) if source is not None else {"mode": "none", "allow": []}

    # -- deleting --------------------------------------------------------------------------------

    async def delete(self, sbx: Sandbox, checkpoint_id: str) -> None:
        cp = self.get(sbx.record.owner, checkpoint_id)
        if cp.sandbox_id != sbx.id:
            raise CheckpointNotFound(checkpoint_id)
        self._delete(cp)

    def discard(self, owner: str, checkpoint_id: str) -> CheckpointRecord:
        """Delete one of the key's checkpoints by id, whether its sandbox still runs or not."""
        cp = self.get(owner, checkpoint_id)
        self._delete(cp)
        return cp

    def _delete(self, cp: CheckpointRecord) -> None:
        self.store.delete(cp.id)
        self.files.remove(Path(cp.path), cp.id, cp.base)

    def drop_all(self, sbx: Sandbox) -> None:
        """The sandbox is gone: its checkpoints go too (a branch runs from its own VM), but for
        the kept ones."""
        for cp in self.store.of_sandbox(sbx.id):
            if not cp.keep:
                self._delete(cp)
        with contextlib.suppress(OSError):
            (self.files.dir / sbx.id).rmdir()
