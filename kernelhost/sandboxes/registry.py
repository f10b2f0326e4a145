"""The sandboxes this service holds and their records: the one place where a sandbox is added,
found, changed or removed, in memory and in the store together.

Per-key limits are checked here too, against what a key holds *and* what it is in the middle
of creating (``reserve``): two concurrent creates cannot both pass a limit that only one fits.

A create, fork or wake that finds its key at a limit waits its turn (``admit``): in the key's
queue, first come first served, up to ``queue_seconds`` (or less, if the caller said so:
``MAX_WAIT``), while at most ``queue_length`` wait; it is refused (``CapacityExceeded``, 429)
only when the queue is full or the wait ends without room. ``ADMITTED`` tells the API how long
the call waited and at which place it joined, for the answer's headers (docs/limits.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from .. import tracing
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
    queue_seconds: float = 0.0  # the longest a call waits for room (0: refused at once)
    queue_length: int = 0  # calls of one key waiting at once


@dataclass(frozen=True)
class Admitted:
    """How a call got its room: after ``waited`` seconds, having joined the key's queue at
    ``position`` (1: first in line)."""

    waited: float
    position: int


#: the caller's own bound on waiting for room, in seconds (the API sets it from a header)
MAX_WAIT: ContextVar[float | None] = ContextVar("kernelhost_max_wait", default=None)
#: set when a call waited for room (read by the API for the answer's headers)
ADMITTED: ContextVar[Admitted | None] = ContextVar("kernelhost_admitted", default=None)
POLL_SECONDS = 1.0  # a waiting call looks again this often (a cluster's room frees elsewhere)
WAITS_KEPT = 20  # recent waits per key, for the expected wait


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
        self._room = asyncio.Event()  # set (and replaced) when a key's usage may have dropped
        self._queues: dict[str, deque[object]] = {}  # waiting calls per key, in order
        self._waits: dict[str, deque[float]] = {}  # recent waits per key

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
            self.notify_room()

    @contextlib.asynccontextmanager
    async def admit(
        self, owner: str, count: int, memory_mib: int, *, alongside: int = 0
    ) -> AsyncIterator[None]:
        """``reserve``, waiting in the key's queue for room if there is none now; refused at
        once if no wait could make room: over the key's limits with only the ``alongside``
        sandboxes the call keeps (a fork's parent) left running."""
        with contextlib.ExitStack() as stack:
            queue = self._queues.get(owner)
            if not queue:
                try:
                    stack.enter_context(self.reserve(owner, count, memory_mib))
                except CapacityExceeded as exc:
                    await self._wait_in_line(stack, owner, count, memory_mib, exc, alongside)
            else:
                await self._wait_in_line(stack, owner, count, memory_mib, None, alongside)
            yield

    def _never_fits(self, count: int, memory_mib: int, alongside: int) -> bool:
        """Whether a call is over its key's limits even with nothing else of the key running."""
        q = self.quota
        mib = (max(count, 1) + alongside) * memory_mib
        return count + alongside > q.max_sandboxes or mib > q.max_memory_mib

    async def _wait_in_line(
        self,
        stack: contextlib.ExitStack,
        owner: str,
        count: int,
        memory_mib: int,
        refused: CapacityExceeded | None,
        alongside: int,
    ) -> None:
        if self._never_fits(count, memory_mib, alongside):  # no wait would make room: say so now
            raise refused if refused is not None else self._limit_now(owner, count, memory_mib)
        wanted = MAX_WAIT.get()
        limit = self.quota.queue_seconds if wanted is None else min(wanted, self.quota.queue_seconds)
        queue = self._queues.setdefault(owner, deque())
        if limit <= 0 or len(queue) >= self.quota.queue_length:
            if refused is None:  # others are in line ahead: which limit holds them
                refused = self._limit_now(owner, count, memory_mib)
            raise self._full(refused, len(queue), limit, owner)
        ticket = object()
        queue.append(ticket)
        position = len(queue)
        loop = asyncio.get_running_loop()
        start = loop.time()
        # a stage of the call's trace (docs/tracing.md): the wait for room
        with tracing.span("sandbox.queue", position=position, wait_limit_seconds=limit):
            try:
                while True:
                    if queue[0] is ticket:
                        try:
                            stack.enter_context(self.reserve(owner, count, memory_mib))
                            break
                        except CapacityExceeded as exc:
                            refused = exc
                    left = start + limit - loop.time()
                    if left <= 0:
                        raise self._timed_out(refused, owner, limit, position)
                    await self._room_freed(min(left, POLL_SECONDS))
            finally:
                queue.remove(ticket)
                if not queue:
                    del self._queues[owner]
                self.notify_room()  # the next in line looks again
        waited = loop.time() - start
        self._waits.setdefault(owner, deque(maxlen=WAITS_KEPT)).append(waited)
        ADMITTED.set(Admitted(round(waited, 3), position))

    def expected_wait(self, owner: str) -> float | None:
        """Seconds a call of ``owner`` joining the queue now may wait (recent waits), or None."""
        waits = self._waits.get(owner)
        if not waits:
            return None
        return sum(waits) / len(waits) * (len(self._queues.get(owner, ())) + 1)

    def _refusal(self, owner: str, why: str) -> CapacityExceeded:
        return CapacityExceeded(f"{why}", limit="max_sandboxes_per_key", value=self.quota.max_sandboxes)

    def _limit_now(self, owner: str, count: int, memory_mib: int) -> CapacityExceeded:
        """The refusal a call would get now, for one that finds others of its key in line."""
        try:
            with self.reserve(owner, count, memory_mib):
                pass
        except CapacityExceeded as exc:
            return exc
        return self._refusal(
            owner,
            "this key's earlier calls are waiting for room under its limits "
            "(max_sandboxes_per_key, max_memory_mib_per_key)",
        )

    def _full(self, refused: CapacityExceeded, waiting: int, limit: float, owner: str) -> CapacityExceeded:
        if limit <= 0:
            return refused
        expected = self.expected_wait(owner) or limit
        refused.message = (
            f"{refused.message}; {waiting} calls of this key already wait for room, the most that "
            f"may (create_queue_length): try again in about {math.ceil(expected)} s"
        )
        refused.details.update(queue_length=waiting, retry_after=math.ceil(expected))
        return refused

    def _timed_out(
        self, refused: CapacityExceeded | None, owner: str, limit: float, position: int
    ) -> CapacityExceeded:
        exc = refused or self._refusal(owner, "no room for this key's call")
        exc.message = (
            f"{exc.message} (waited {limit:g} s in this key's queue, joined at place {position}; "
            "create_queue_seconds, or the X-Kernelhost-Queue-Wait header, bounds the wait)"
        )
        exc.details.update(waited=limit, retry_after=math.ceil(self.expected_wait(owner) or limit))
        return exc

    def notify_room(self) -> None:
        """Wake the calls waiting for room: a key's usage may have dropped."""
        self._room.set()
        self._room = asyncio.Event()

    async def _room_freed(self, timeout: float) -> None:
        # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that comes as the event
        # is set (the caller who went away would wait on)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._room.wait()

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
        self.notify_room()

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
        self.notify_room()
        return True

    def update(self, sbx: Sandbox, **fields: Any) -> None:
        """Change fields of the record, in memory and in the store (if it is still stored)."""
        for name, value in fields.items():
            setattr(sbx.record, name, value)
        self.store.update(sbx.id, **fields)
        self.changed.set()
        if "state" in fields or "memory_mib" in fields:
            self.notify_room()  # a hibernated sandbox's memory counts no more

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
