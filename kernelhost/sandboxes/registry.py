"""The sandboxes this service holds and their records: the one place where a sandbox is added,
found, changed or removed, in memory and in the store together.

Per-key limits are checked here too, against what a key holds *and* what it is in the middle
of creating (``reserve``): two concurrent creates cannot both pass a limit that only one fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import CapacityExceeded, SandboxNotFound
from .sandbox import Sandbox
from .states import SandboxState
from .store.sandboxes import SandboxRecord, Store


class SharedQuota(Protocol):
    """The limits a cluster node takes in the shared store (``cluster.quota.ClusterQuota``)."""

    def reserve(self, owner: str, count: int, memory_mib: int) -> contextlib.AbstractContextManager[None]: ...

    def record(self, store: Store, rec: SandboxRecord) -> None: ...


@dataclass(frozen=True)
class VmShape:
    """The machine a sandbox runs on."""

    memory_mib: int
    vcpus: int
    accel: str


def new_record(
    *,
    owner: str,
    template: str,
    domain: str,
    image_key: str,
    shape: VmShape,
    idle_timeout: int,
    metadata: dict[str, str],
    network: dict[str, Any],
) -> SandboxRecord:
    """The record of a sandbox about to get its VM (state ``starting``)."""
    now = time.time()
    return SandboxRecord(
        id="sbx_" + secrets.token_hex(8),
        owner=owner,
        template=template,
        domain=domain,
        state=SandboxState.STARTING,
        created_at=now,
        last_active_at=now,
        idle_timeout_seconds=idle_timeout,
        memory_mib=shape.memory_mib,
        vcpus=shape.vcpus,
        accel=shape.accel,
        image_key=image_key,
        metadata=dict(metadata),
        network=dict(network),
    )


@dataclass(frozen=True)
class Quota:
    max_sandboxes: int
    max_memory_mib: int


class Registry:
    def __init__(self, store: Store, quota: Quota) -> None:
        self.store = store
        self.quota = quota
        self._live: dict[str, Sandbox] = {}
        self._reserved: Counter[str] = Counter()  # sandboxes being created, per key
        self._reserved_mib: Counter[str] = Counter()
        self.cluster: SharedQuota | None = None  # a cluster node: limits in the shared store
        #: set when a sandbox comes, is touched, or its idle timeout changes: the reaper then
        #: looks again at when the next one is due
        self.changed = asyncio.Event()

    # -- lookups ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Sandbox]:
        return iter(list(self._live.values()))

    def holds(self, sbx: Sandbox) -> bool:
        """Whether ``sbx`` is still this service's (not deleted, not replaced by another)."""
        return self._live.get(sbx.id) is sbx

    def find(self, sandbox_id: str) -> Sandbox | None:
        return self._live.get(sandbox_id)

    def get(self, owner: str, sandbox_id: str) -> Sandbox:
        sbx = self._live.get(sandbox_id)
        if sbx is None or sbx.record.owner != owner:
            raise SandboxNotFound(sandbox_id)
        return sbx

    def owned(self, owner: str) -> list[Sandbox]:
        return [s for s in self._live.values() if s.record.owner == owner]

    # -- limits ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def reserve(self, owner: str, count: int, memory_mib: int) -> Iterator[None]:
        """Hold room for ``count`` new sandboxes of ``owner`` (each of ``memory_mib`` MiB; with
        ``count=0``, for one sandbox waking up) while they are made; raises
        ``CapacityExceeded`` (naming the setting) if the key has no room for them."""
        if self.cluster is not None:
            with self.cluster.reserve(owner, count, memory_mib):
                yield
            return
        mine = self.owned(owner)
        held = len(mine) + self._reserved[owner]
        limit = self.quota.max_sandboxes
        if held + count > limit:
            raise CapacityExceeded(
                f"this API key holds {held} sandboxes and asked for {count} more, over its "
                f"limit of {limit} (max_sandboxes_per_key); close some first",
                limit="max_sandboxes_per_key",
                value=limit,
            )
        used = sum(s.record.memory_mib for s in mine if s.record.state != SandboxState.HIBERNATED)
        used += self._reserved_mib[owner]
        want = max(count, 1) * memory_mib
        mem_limit = self.quota.max_memory_mib
        if used + want > mem_limit:
            raise CapacityExceeded(
                f"this API key's running sandboxes use {used} MiB of VM memory; {want} MiB more "
                f"would pass its limit of {mem_limit} MiB (max_memory_mib_per_key); close or "
                "hibernate some first",
                limit="max_memory_mib_per_key",
                value=mem_limit,
            )
        self._reserved[owner] += count
        self._reserved_mib[owner] += want
        try:
            yield
        finally:
            self._reserved[owner] -= count
            self._reserved_mib[owner] -= want
            if self._reserved[owner] <= 0 and self._reserved_mib[owner] <= 0:
                del self._reserved[owner], self._reserved_mib[owner]

    # -- changes ---------------------------------------------------------------------------------

    def record(self, rec: SandboxRecord) -> None:
        """Store the record of a sandbox being made (it is not live yet)."""
        if self.cluster is not None:
            self.cluster.record(self.store, rec)
        else:
            self.store.insert(rec)

    def forget(self, sandbox_id: str) -> None:
        """Delete a stored record (a sandbox that never became live, or is gone)."""
        self.store.delete(sandbox_id)

    def add(self, sbx: Sandbox) -> None:
        """Make ``sbx`` live: found by lookups, reaped, counted."""
        self._live[sbx.id] = sbx
        self.changed.set()

    def pop(self, sbx: Sandbox) -> bool:
        """Take ``sbx`` out of the table (its record stays until ``forget``); False if it was
        not there (already removed)."""
        if self._live.get(sbx.id) is not sbx:
            return False
        del self._live[sbx.id]
        return True

    def update(self, sbx: Sandbox, **fields: Any) -> None:
        """Change fields of the record, in memory and in the store (if it is still stored)."""
        for name, value in fields.items():
            setattr(sbx.record, name, value)
        self.store.update(sbx.id, **fields)
        self.changed.set()

    def set_state(self, sbx: Sandbox, state: SandboxState, detail: str | None = None) -> None:
        fields: dict[str, Any] = {"state": state}
        if detail is not None:
            fields["detail"] = detail
        self.update(sbx, **fields)

    def touch(self, sbx: Sandbox, when: float | None = None) -> None:
        """Record activity (what the idle reaper measures from)."""
        now = time.time() if when is None else when
        sbx.record.last_active_at = now
        self.changed.set()
        if self.holds(sbx):
            self.store.touch(sbx.id, now)
