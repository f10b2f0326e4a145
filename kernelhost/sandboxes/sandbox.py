"""One live sandbox: its record, its channel, and the two locks that order what happens to it.

Lock order: ``lock`` (what runs in the kernel) before ``vm_lock`` (what happens to the VM), never
the other way round.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .. import tracing
from ..channel import AgentClient
from .errors import Remedy, SandboxError, SandboxNotRunning
from .network.policy import NetworkSpec
from .states import SandboxState
from .store.sandboxes import SandboxRecord

if TYPE_CHECKING:
    from .execution import RunningCall
    from .network.ingress import Ingress
    from .network.tunnels import Tunnels


class AttachedKernel(Protocol):
    """What the layer asks of a sandbox's co-attached Jupyter clients (``session.KernelSession``,
    which owns them)."""

    quiet_restart: bool  # a restart whose clients reconnect by themselves: no status sent

    @property
    def clients(self) -> Set[Any]: ...

    @property
    def execution_state(self) -> str: ...

    @property
    def last_activity(self) -> float: ...

    @property
    def running(self) -> bool: ...

    def bind(self, agent: AgentClient) -> None: ...

    def drop_outstanding(self) -> None: ...


class BackgroundProcess(Protocol):
    """What the layer asks of a sandbox's background process (``processes.Process``, which owns
    them)."""

    @property
    def pid(self) -> int: ...

    @property
    def own(self) -> bool: ...

    @property
    def running(self) -> RunningCall: ...

    @property
    def task(self) -> asyncio.Task[None] | None: ...

    async def signal(self, name: str) -> None: ...


def iso_time(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


class ExecutionLock:
    """One thing at a time in a sandbox's kernel: a native call, or the cells of the Jupyter
    clients attached to it.

    A native call holds it for its duration, in its own task (``hold``). A ``KernelSession``
    *leases* it across tasks while its clients' execute_requests are in the kernel: ``lease``
    when the first is sent, ``end_lease`` once the last has ended (or the channel changed). The
    holder's name is kept, so a wrong release is a bug that shows, not a silent unlock.
    """

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self.holder: str | None = None

    def locked(self) -> bool:
        return self._lock.locked()

    @contextlib.asynccontextmanager
    async def hold(self, holder: str) -> AsyncIterator[None]:
        if self._lock.locked():  # behind another call: the wait is a stage of this one's trace
            with tracing.span("sandbox.wait_turn", behind=self.holder):
                await self._lock.acquire()
        else:
            await self._lock.acquire()
        self.holder = holder
        try:
            yield
        finally:
            self.holder = None
            self._lock.release()

    async def lease(self, holder: str) -> None:
        await self._lock.acquire()
        self.holder = holder

    def end_lease(self, holder: str) -> None:
        if self.holder != holder:
            raise RuntimeError(f"{holder} ends a lease of the execution lock held by {self.holder}")
        self.holder = None
        self._lock.release()


@dataclass(eq=False)
class Sandbox:
    """A live sandbox. Its fields are the sandbox layer's; other layers read them, never set."""

    record: SandboxRecord
    agent: AgentClient | None = None
    #: the Jupyter session of the messages the host itself sends to the kernel
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    lock: ExecutionLock = field(default_factory=ExecutionLock)
    #: held while the VM behind the sandbox changes (hibernate, wake, replace, fork's freeze)
    #: or a restart works on it; taken after ``lock`` when both are needed
    vm_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    call: RunningCall | None = None  # the native execution running now
    replacement: asyncio.Task[bool] | None = None  # a VM replacement in progress
    net: Tunnels | None = None  # the host side of the guest's network tunnels
    ingress: Ingress | None = None  # the host's connections to ports in the guest
    kernel: AttachedKernel | None = None  # the Jupyter clients attached to it (co-attach)
    processes: dict[int, BackgroundProcess] = field(default_factory=dict)  # background processes, by pid
    #: auto_checkpoint: the state changed since the last automatic checkpoint
    checkpoint_stale: bool = True

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> SandboxState:
        return self.record.state

    @property
    def busy(self) -> bool:
        """Whether something runs in its kernel: a native call or an attached client's cell."""
        return self.call is not None or self.lock.locked()

    @property
    def live_agent(self) -> AgentClient | None:
        """The agent, if the sandbox is running and its channel is up."""
        agent = self.agent
        if self.record.state != SandboxState.RUNNING or agent is None or not agent.connected:
            return None
        return agent

    def to_dict(self) -> dict[str, Any]:
        """The sandbox as every interface describes it."""
        return sandbox_view(self.record)


def sandbox_view(r: SandboxRecord) -> dict[str, Any]:
    """A sandbox's record as every interface describes it (a cluster lists other nodes' too)."""
    return {
        "id": r.id,
        "template": r.template.split("@", 1)[0],  # a key's own template: its name, not its image
        "state": r.state.value,
        "created_at": iso_time(r.created_at),
        "last_active_at": iso_time(r.last_active_at),
        "idle_timeout_seconds": r.idle_timeout_seconds,
        "accel": r.accel,
        "memory_mib": r.memory_mib,
        "vcpus": r.vcpus,
        "metadata": r.metadata,
        "network": NetworkSpec.from_dict(r.network).to_dict(),
        "auto_checkpoint": r.auto_checkpoint,
        **({"node": r.node} if r.node else {}),
        **({"detail": r.detail} if r.detail else {}),
    }


def ensure_usable(sbx: Sandbox) -> None:
    """Raise ``SandboxNotRunning`` unless the sandbox runs, or is hibernated (a call wakes it)
    or getting a new VM (a call waits for it)."""
    rec = sbx.record
    if rec.state in (SandboxState.HIBERNATED, SandboxState.REPLACING):
        return
    if rec.state != SandboxState.RUNNING or sbx.agent is None or not sbx.agent.connected:
        raise SandboxNotRunning(
            f"sandbox {sbx.id} is {rec.state}{': ' + rec.detail if rec.detail else ''}",
            remedy=Remedy.RESTART,
            state=rec.state.value,
            sandbox_id=sbx.id,
        )


async def wait_replacement(sbx: Sandbox) -> None:
    """Wait for a VM replacement of ``sbx`` in flight, if there is one (its failure is the
    replacement's to report)."""
    task = sbx.replacement
    if task is not None and not task.done():
        with contextlib.suppress(SandboxError):  # BootFailed: the sandbox is marked dead
            await asyncio.shield(task)
