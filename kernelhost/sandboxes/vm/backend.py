"""``VmBackend``: the one door from a sandbox's state machine to its VMs.

After jupyter_client's ``KernelProvisionerBase``: the verbs a backend offers, who calls each, and
what each guarantees when it fails or its caller is cancelled. ``vm/factory.py``'s ``VmFactory``
is the reference implementation (libvirt and QEMU); ``tests/unit/fake_backend.py`` is an
in-memory one whose VMs are fake agents on UNIX sockets, for the unit tests of the state machine.

A backend knows the channel (a launch hands back an attached, fresh ``AgentClient``) and nothing
of sandbox records, Jupyter sessions or HTTP. A VM is named by its *domain*, a string the
backend makes (``new_name``); a name is never reused, so a teardown still in flight for an old
name cannot hit a new VM.

Guarantees every verb keeps:

- **Failure**: a verb that starts a VM (``launch``, ``wake``, ``fork``) leaves nothing of it
  behind when it raises: no domain, no agent. Its errors are ``HypervisorError`` (including
  ``LibvirtUnavailable``), ``ChannelError`` or ``TimeoutError``; the callers map them to the
  sandbox layer's errors.
- **Cancellation**: a cancelled start still tears down what it began before the
  ``CancelledError`` propagates (the teardown itself is shielded).
- **Teardown** is one verb, ``destroy``: idempotent (an unknown or already destroyed domain is
  fine), shielded from its caller's cancellation, and it never raises; a failure is logged and
  the backend retries it (``retry_destroys``). ``destroy_later`` is the same teardown without
  waiting for it; ``close`` waits for every such teardown.
- **Deadlines**: every wait inside a verb is bounded by the service's timeouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hypervisor import DomainStats, GuestImage

from ...channel import AgentClient
from .launched import Launched
from .pool import Clone, WarmPool

#: a fork's children: (domain, metadata) each
Children = list[tuple[str, dict[str, str]]]


@dataclass
class Saving:
    """A VM's whole state in a file on tmpfs; ``finish`` (a live save still being written):
    call it in a thread, with a timeout, before reading the file."""

    path: Path
    finish: Callable[[float], int] | None = None


class StateFiles(Protocol):
    """A VM's whole state as a checkpoint file and back (``checkpoints.Checkpoints`` calls every
    verb; ``VmBackend.checkpoint_files`` makes it). The libvirt one is ``vm/saves.py``."""

    dir: Path
    #: whole states waiting to be stored at once (each is up to a VM's RAM)
    slots: asyncio.Semaphore

    def prepare(self) -> None:
        """At service start: make the directories, remove what a killed predecessor left."""

    def close(self) -> None:
        """At service shutdown."""

    def path_for(self, sandbox_id: str, checkpoint_id: str) -> Path: ...

    async def freeze(self, domain: str) -> Saving:
        """Save the running VM's whole state; it runs on. Raises ``HypervisorError`` or
        ``OSError`` and leaves no file then."""

    async def complete(self, saving: Saving, timeout: float = 300.0) -> None:
        """Wait (bounded) for a live save to be whole."""

    async def store(
        self, path: Path, dest: Path, image: GuestImage, checkpoint_id: str
    ) -> tuple[int, dict[str, Any]]:
        """Keep the saved state at ``path`` as the checkpoint file ``dest``: (bytes, base)."""

    def remove(self, path: Path, checkpoint_id: str, base: dict[str, Any]) -> None:
        """Remove a checkpoint's file (idempotent)."""

    def check(self, image: GuestImage, path: Path, base: dict[str, Any]) -> object:
        """Raise ``CheckpointUnusable`` if the checkpoint cannot be loaded; nothing is touched."""

    async def launch(
        self, domain: str, image: GuestImage, path: Path, base: dict[str, Any], meta: dict[str, str]
    ) -> Launched:
        """Start ``domain`` from a checkpoint file; on failure or cancellation nothing is left."""


class VmBackend(Protocol):
    """The verbs the sandbox layer uses on its VMs. "Who calls" names the sandbox layer's part."""

    @property
    def use_snapshots(self) -> bool:
        """Whether VMs are clones of a template snapshot (and a pool of them is kept)."""

    @property
    def pool(self) -> WarmPool:
        """The warm pool, for metrics (``SandboxManager.pool``)."""

    async def prepare(self) -> None:
        """Service start, before anything else (``SandboxManager.start``)."""

    async def close(self) -> None:
        """Service shutdown (``SandboxManager.close``): stops the pool and waits (bounded) for
        every teardown in flight. Running sandbox VMs keep running for the next start."""

    def new_name(self) -> str:
        """A fresh domain name (every part that gives a sandbox a VM)."""

    def shape_of(self, image: GuestImage) -> tuple[int, int]:
        """(memory MiB, vCPUs) of the VMs of ``image`` (``Context.shape_for``)."""

    async def launch(self, domain: str, image: GuestImage, meta: dict[str, str]) -> Launched:
        """Start a VM named ``domain`` with a fresh attached agent (``Lifecycle.launch``: a
        create and a VM replacement). Clone or cold boot; see the module's guarantees."""

    def take_clone(self, template: str, refill: bool) -> Clone | None:
        """A ready pooled VM of ``template``, or None (``Lifecycle.create``); ``refill``: keep
        the template's pool filled from now on. The caller owns the clone it gets."""

    async def discard(self, clone: Clone) -> None:
        """Close and destroy a pooled VM the caller will not use (``Lifecycle.create``)."""

    async def warm(self, image: GuestImage) -> None:
        """Make the snapshot of ``image`` and keep its template's pool filled
        (``SandboxManager`` at start)."""

    async def label(self, domain: str, meta: dict[str, str]) -> None:
        """Put ``meta`` in the domain's metadata (``Lifecycle``, a pooled VM handed over);
        never raises, a failure is logged."""

    async def hibernate(self, domain: str, path: Path) -> int:
        """Save the whole VM to ``path`` and destroy it; the bytes written (``Hibernation``).
        On failure no file is left and the VM may still run (the caller removes it)."""

    async def wake(self, domain: str, image: GuestImage, path: Path, meta: dict[str, str]) -> Launched:
        """Start ``domain`` from a hibernated state at ``path``, agent attached
        (``Hibernation.wake``); the caller removes ``path`` afterwards."""

    async def fork(self, parent: str, image: GuestImage, children: Children) -> list[tuple[str, AgentClient]]:
        """Copy the running ``parent`` into ``children``; the parent resumes (``Forker``). Each
        child's domain (it may differ from the name asked for) and agent. On failure no child
        is left."""

    async def reattach(self, domain: str, timeout: float) -> AgentClient:
        """Connect to a VM that ran before this service started (``Lifecycle.reconcile``);
        raises ``ChannelError``."""

    async def running_domains(self) -> set[str]:
        """The names of this service's domains that run now (``Lifecycle.reconcile``); raises
        ``LibvirtUnavailable`` if the backend cannot be reached."""

    async def reconcile(self, keep: set[str]) -> list[str]:
        """Destroy every domain of this service not in ``keep``; the names destroyed."""

    async def destroy(self, domain: str) -> None:
        """The one teardown: idempotent, shielded, never raises (see the module docstring)."""

    def destroy_later(self, domain: str) -> asyncio.Task[None]:
        """``destroy`` in the background; ``close`` waits for it."""

    async def retry_destroys(self) -> list[str]:
        """Destroy again what failed to be destroyed before (the reaper, shutdown)."""

    async def cpu_time(self, domain: str) -> tuple[int, int]:
        """(CPU time used in ns, vCPUs) of a running VM (``UsageMeter``)."""

    async def stats(self, domains: Collection[str]) -> dict[str, DomainStats]:
        """What those of ``domains`` that run now use, read from the host side (``UsageSampler``,
        every few seconds: cheap); raises ``HypervisorError``."""

    def console_tail(self, domain: str, lines: int = 20, *, qemu_log: bool = False) -> str:
        """The last lines of the VM's console, for a boot failure's report ("" if none); with
        ``qemu_log`` also of QEMU's own log (why QEMU exited; it names host paths, so it is for
        the operator's log only). Read before ``destroy``, which removes both."""

    # -- templates (``templates/``) ----------------------------------------------------------

    async def prepare_template(self, image: GuestImage) -> None:
        """Make the snapshot of a newly built template (``templates/stages.py``); raises like
        ``launch``; a no-op without snapshots."""

    async def forget_template(self, name: str) -> None:
        """A deleted template: stop its pool, remove its snapshot (``TemplateService``)."""

    async def boot_builder(
        self, domain: str, image: GuestImage, memory_mib: int, scratch: Path, meta: dict[str, str]
    ) -> tuple[AgentClient, str]:
        """Boot a template's build VM with ``scratch`` as an extra raw disk; its agent (which
        runs no kernel) and the disk's device name in the guest (``templates/build_vm.py``).
        Nothing is left on failure; the caller destroys it when done."""

    def builder_name(self, build_id: str) -> str:
        """The domain name of a build's VM."""

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_files(self, directory: Path, live: str) -> StateFiles:
        """The checkpoint files of this backend's VMs (``Checkpoints``, once)."""
