"""An in-memory ``VmBackend`` (``kernelhost/sandboxes/vm/backend.py``) for unit tests of the
sandbox's state machine: create, pool hand-over, hibernate and wake, recovery, fork, checkpoints.

Each fake VM is a ``FakeAgent`` (``fake_agent.py``) on a UNIX socket, so the host side talks to
it over the real channel client; its "memory" is ``FakeVm.state``, a dict that hibernation,
checkpoints and forks carry (a test writes into it and reads it back after a restore).

It lives in ``tests/``, not in the product: it is a test double built on another test double
(the fake agent), and nothing in the service may start without a real VM.

Misbehaviour, per verb (``launch``, ``wake``, ``hibernate``, ``fork``, ``freeze``, ``store``,
``restore``, ``reattach``; ``launch_start``, ``wake_start``, ``restore_start``: before the VM
exists): ``fail[verb] = exc`` makes its next call raise ``exc`` after the VM
was started (so the verb's cleanup runs), ``hold[verb] = asyncio.Event()`` makes it wait for
the event (bounded by ``WAIT``); ``entered[verb]`` is set when a call begins. ``kill(domain)``
is a VM that dies (the host reads EOF on its channel).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypervisor import DomainStats, GuestImage, HypervisorError, ImageStore
from kernelhost.channel import AgentClient, ChannelClosed
from kernelhost.config import Settings
from kernelhost.metrics import Metrics
from kernelhost.sandboxes.checkpoints.service import Checkpoints
from kernelhost.sandboxes.context import Context
from kernelhost.sandboxes.errors import CheckpointUnusable
from kernelhost.sandboxes.lifecycle.create import Lifecycle
from kernelhost.sandboxes.lifecycle.fork import Forker
from kernelhost.sandboxes.lifecycle.hibernation import Hibernation
from kernelhost.sandboxes.lifecycle.recovery import Recoverer
from kernelhost.sandboxes.network import HostNetwork, SandboxNetwork
from kernelhost.sandboxes.registry import Quota, Registry
from kernelhost.sandboxes.sandbox import Sandbox
from kernelhost.sandboxes.states import SandboxState
from kernelhost.sandboxes.store.checkpoints import CheckpointStore
from kernelhost.sandboxes.store.sandboxes import Store
from kernelhost.sandboxes.vm.backend import Children, Saving
from kernelhost.sandboxes.vm.launched import Launched, VmTimings
from kernelhost.sandboxes.vm.pool import Clone, WarmPool
from kernelhost.tasks import TaskSet

from .fake_agent import WAIT, FakeAgent, short_socket_dir

CAPABILITIES = ["bash", "processes", "files", "network", "warm_up", "users"]


@dataclass
class FakeVm:
    domain: str
    agent: FakeAgent
    state: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)
    cpu_ns: int = 0  # the CPU time ``stats`` reports


class FakeBackend:
    """``VmBackend`` in memory; see the module docstring."""

    def __init__(self, sockets: Path, *, snapshots: bool = True) -> None:
        self.sockets = sockets
        self.snapshots = snapshots
        self.vms: dict[str, FakeVm] = {}
        self.destroyed: list[str] = []  # every destroy call, in order (idempotence shows here)
        self.labels: dict[str, dict[str, str]] = {}
        self.clones: dict[str, list[Clone]] = collections.defaultdict(list)
        self.fail: dict[str, BaseException] = {}
        self.hold: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self.background = TaskSet("fake-vms")
        self._pool = WarmPool(0, self._no_clone, self.discard)
        self._names = 0
        #: what every new VM's agent adds to its hello (capabilities beyond ``CAPABILITIES``,
        #: kernelspecs), and how it answers ops of its own (``FakeAgent.replies``)
        self.hello: dict[str, Any] = {}
        self.replies: dict[str, Any] = {}

    # -- misbehaviour ------------------------------------------------------------------------------

    async def _step(self, verb: str) -> None:
        self.entered[verb].set()
        held = self.hold.get(verb)
        if held is not None:
            await asyncio.wait_for(held.wait(), WAIT)
        exc = self.fail.pop(verb, None)
        if exc is not None:
            raise exc

    async def kill(self, domain: str) -> None:
        """The VM dies: its channel closes, its domain is gone."""
        vm = self.vms.pop(domain)
        await vm.agent.stop()

    # -- the VMs ----------------------------------------------------------------------------------

    async def _start(self, domain: str, state: dict[str, Any], meta: dict[str, str], how: str) -> Launched:
        assert domain not in self.vms, f"domain {domain} started twice"
        fake = FakeAgent(str(self.sockets / f"{domain}.sock"))
        hello = {"agent_version": 2, "capabilities": CAPABILITIES, **self.hello}
        hello["capabilities"] = [*CAPABILITIES, *self.hello.get("capabilities", [])]
        fake.reply_fields["hello"] = hello
        fake.replies.update(self.replies)
        await fake.start()
        self.vms[domain] = FakeVm(domain, fake, json.loads(json.dumps(state)), dict(meta))
        agent = AgentClient(Path(fake.path))
        try:
            await agent.connect(timeout=WAIT)
            await agent.hello(timeout=WAIT)
        except BaseException:
            await agent.close()
            raise
        return Launched(agent, VmTimings(how))

    async def _started(
        self, verb: str, domain: str, state: dict[str, Any], meta: dict[str, str], how: str
    ) -> Launched:
        """Start ``domain``, then take the verb's misbehaviour; nothing is left on failure."""
        launched: Launched | None = None
        try:
            await self._step(f"{verb}_start")  # before the VM exists
            launched = await self._start(domain, state, meta, how)
            await self._step(verb)
        except BaseException:
            if launched is not None:
                await launched.agent.close()
            await self.destroy(domain)
            raise
        return launched

    async def _no_clone(self, template: str) -> Clone:
        raise AssertionError("the fake's pool is filled by the test (add_clone)")

    async def add_clone(self, template: str, image: GuestImage) -> Clone:
        """A pooled VM of ``template``, ready for ``take_clone``."""
        domain = self.new_name()
        launched = await self._start(domain, {}, {"role": "pool"}, "pool")
        clone = Clone(domain, launched.agent, image.key)
        self.clones[template].append(clone)
        return clone

    # -- VmBackend ----------------------------------------------------------------------------------

    @property
    def use_snapshots(self) -> bool:
        return self.snapshots

    @property
    def pool(self) -> WarmPool:
        return self._pool

    async def prepare(self) -> None:
        pass

    async def close(self) -> None:
        for clones in self.clones.values():
            for clone in clones:
                await self.discard(clone)
        self.clones.clear()
        await self.background.wait(WAIT)
        for domain in list(self.vms):
            await self.kill(domain)

    def new_name(self) -> str:
        self._names += 1
        return f"fake-{self._names}"

    def shape_of(self, image: GuestImage) -> tuple[int, int]:
        return 256, 1

    async def launch(self, domain: str, image: GuestImage, meta: dict[str, str]) -> Launched:
        return await self._started("launch", domain, {}, meta, "clone" if self.snapshots else "boot")

    def take_clone(self, template: str, refill: bool) -> Clone | None:
        clones = self.clones.get(template) if self.snapshots else None
        return clones.pop(0) if clones else None

    async def discard(self, clone: Clone) -> None:
        await clone.agent.close()
        await self.destroy(clone.domain)

    async def warm(self, image: GuestImage) -> None:
        pass

    async def label(self, domain: str, meta: dict[str, str]) -> None:
        self.labels[domain] = dict(meta)

    async def hibernate(self, domain: str, path: Path) -> int:
        try:
            await self._step("hibernate")
            vm = self.vms.get(domain)
            if vm is None:
                raise HypervisorError(f"domain {domain!r} is not running")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(vm.state))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        await self.destroy(domain)
        return path.stat().st_size

    async def wake(self, domain: str, image: GuestImage, path: Path, meta: dict[str, str]) -> Launched:
        state = json.loads(path.read_text())
        return await self._started("wake", domain, state, meta, "wake")

    async def fork(self, parent: str, image: GuestImage, children: Children) -> list[tuple[str, AgentClient]]:
        started: list[tuple[str, AgentClient]] = []
        try:
            await self._step("fork")
            vm = self.vms.get(parent)
            if vm is None:
                raise HypervisorError(f"domain {parent!r} is not running: it cannot be forked")
            for domain, meta in children:
                launched = await self._start(domain, vm.state, meta, "fork")
                started.append((domain, launched.agent))
                await self._step("fork_child")
        except BaseException:
            for _, agent in started:
                await agent.close()
            for domain, _ in children:
                await self.destroy(domain)
            raise
        return started

    async def reattach(self, domain: str, timeout: float) -> AgentClient:
        await self._step("reattach")
        vm = self.vms.get(domain)
        if vm is None:
            raise ChannelClosed(f"no VM {domain}")
        agent = AgentClient(Path(vm.agent.path))
        await vm.agent.disconnect()  # a virtio-serial port has one host end: the old one goes
        await agent.connect(timeout=timeout)
        await agent.hello(timeout=timeout)
        return agent

    async def running_domains(self) -> set[str]:
        return set(self.vms)

    async def reconcile(self, keep: set[str]) -> list[str]:
        gone = [d for d in self.vms if d not in keep]
        for domain in gone:
            await self.destroy(domain)
        return gone

    async def destroy(self, domain: str) -> None:
        await asyncio.shield(self.destroy_later(domain))

    def destroy_later(self, domain: str) -> asyncio.Task[None]:
        return self.background.spawn(self._destroy(domain), name=f"destroy:{domain}")

    async def _destroy(self, domain: str) -> None:
        self.destroyed.append(domain)
        vm = self.vms.pop(domain, None)
        if vm is not None:
            await vm.agent.stop()

    async def retry_destroys(self) -> list[str]:
        return []

    async def cpu_time(self, domain: str) -> tuple[int, int]:
        return 0, 1

    async def stats(self, domains: Collection[str]) -> dict[str, DomainStats]:
        """Each running fake VM's ``cpu_ns`` (a test moves it), 64 MiB resident."""
        return {d: DomainStats(self.vms[d].cpu_ns, 64 << 20) for d in domains if d in self.vms}

    def console_tail(self, domain: str, lines: int = 20, *, qemu_log: bool = False) -> str:
        return f"console of {domain}"

    async def prepare_template(self, image: GuestImage) -> None:
        pass

    async def forget_template(self, name: str) -> None:
        self.clones.pop(name, None)

    def builder_name(self, build_id: str) -> str:
        return f"fake-build-{build_id}"

    async def boot_builder(
        self, domain: str, image: GuestImage, memory_mib: int, scratch: Path, meta: dict[str, str]
    ) -> tuple[AgentClient, str]:
        launched = await self._started("builder", domain, {}, meta, "boot")
        return launched.agent, "vdz"

    def checkpoint_files(self, directory: Path, live: str) -> FakeStateFiles:
        return FakeStateFiles(self, directory)

    # -- what a test checks --------------------------------------------------------------------------

    def domains_left(self) -> set[str]:
        return set(self.vms)


class FakeStateFiles:
    """``StateFiles`` of the fake: a checkpoint file is the VM's ``state`` as JSON."""

    def __init__(self, vms: FakeBackend, directory: Path) -> None:
        self.vms = vms
        self.dir = directory
        self.tmp = directory / ".tmp"
        self.slots = asyncio.Semaphore(2)

    def prepare(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        pass

    def path_for(self, sandbox_id: str, checkpoint_id: str) -> Path:
        return self.dir / sandbox_id / f"{checkpoint_id}.zst"

    async def freeze(self, domain: str) -> Saving:
        await self.vms._step("freeze")
        vm = self.vms.vms.get(domain)
        if vm is None:
            raise HypervisorError(f"domain {domain!r} is not running: nothing to freeze")
        path = self.tmp / f"{domain}-{os.urandom(4).hex()}.state"
        path.write_text(json.dumps(vm.state))
        return Saving(path)

    async def complete(self, saving: Saving, timeout: float = 300.0) -> None:
        pass

    async def store(
        self, path: Path, dest: Path, image: GuestImage, checkpoint_id: str
    ) -> tuple[int, dict[str, Any]]:
        await self.vms._step("store")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(path.read_bytes())
        return dest.stat().st_size, {}

    def remove(self, path: Path, checkpoint_id: str, base: dict[str, Any]) -> None:
        path.unlink(missing_ok=True)

    def check(self, image: GuestImage, path: Path, base: dict[str, Any]) -> object:
        if not path.is_file():
            raise CheckpointUnusable(f"checkpoint {checkpoint_of(path)} has no file", checkpoint_id=path.stem)
        return None

    async def launch(
        self, domain: str, image: GuestImage, path: Path, base: dict[str, Any], meta: dict[str, str]
    ) -> Launched:
        state = json.loads(path.read_text())
        return await self.vms._started("restore", domain, state, meta, "checkpoint")


def checkpoint_of(path: Path) -> str:
    return path.stem


# -- the parts of the sandbox layer, on the fake ------------------------------------------------------


@dataclass
class House:
    """The sandbox layer's state machine on a ``FakeBackend``: the parts ``SandboxManager``
    builds, wired the same way."""

    ctx: Context
    vms: FakeBackend
    image: GuestImage
    lifecycle: Lifecycle
    hibernation: Hibernation
    recovery: Recoverer
    forker: Forker
    checkpoints: Checkpoints

    def vm_of(self, sandbox_id: str) -> FakeVm:
        return self.vms.vms[self.ctx.registry.find(sandbox_id).record.domain]  # type: ignore[union-attr]


async def until(predicate: Callable[[], bool], timeout: float = WAIT) -> None:
    """Wait until ``predicate()`` holds, looking every 10 ms; TimeoutError after ``timeout``."""
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"not true within {timeout} s")


def state_of(sbx: Sandbox) -> SandboxState:
    """The sandbox's state now (a call, so a type checker does not narrow it across awaits)."""
    return sbx.record.state


def nothing_left(house: House, owner: str = "k") -> None:
    """No VM, no live sandbox of ``owner``, no stored record."""
    assert house.vms.domains_left() == set()
    assert house.ctx.registry.owned(owner) == []
    assert house.ctx.registry.store.all() == []


def write_image(root: Path, template: str = "python", key: str = "k1") -> None:
    """A guest image's manifest and link, as ``make image`` leaves them (no disks: never booted)."""
    build = root / f"{template}-{key}"
    build.mkdir(parents=True)
    (build / "manifest.json").write_text(json.dumps({"key": key}))
    (root / template).symlink_to(build.name)


@contextlib.asynccontextmanager
async def open_house(tmp_path: Path, *, snapshots: bool = True, **settings: Any) -> AsyncIterator[House]:
    write_image(tmp_path / "images")
    config = Settings(state_dir=tmp_path / "state", image_dir=tmp_path / "images", **settings)
    images = ImageStore(config.image_dir)
    store = Store(tmp_path / "store.db")
    metrics = Metrics()
    with short_socket_dir() as sockets:
        vms = FakeBackend(Path(sockets), snapshots=snapshots)
        host = HostNetwork(config, own_addresses=set())
        ctx = Context(
            settings=config,
            images=images,
            registry=Registry(
                store,
                Quota(
                    config.max_sandboxes_per_key,
                    config.max_memory_mib_per_key,
                    config.create_queue_seconds,
                    config.create_queue_length,
                ),
            ),
            vms=vms,
            metrics=metrics,
            network=SandboxNetwork(config, host, metrics),
            tasks=TaskSet("sandboxes"),
            accel="tcg",
        )
        lifecycle = Lifecycle(ctx)
        hibernation = Hibernation(ctx, lifecycle)
        recovery = Recoverer(ctx, lifecycle, hibernation)
        checkpoints = Checkpoints(ctx, lifecycle, CheckpointStore(store.db), recovery.swap_vm)
        checkpoints.start()
        forker = Forker(ctx, lifecycle, hibernation)
        house = House(ctx, vms, images.get("python"), lifecycle, hibernation, recovery, forker, checkpoints)
        try:
            yield house
        finally:
            await ctx.tasks.close(timeout=WAIT)
            for sbx in list(ctx.registry):
                if sbx.agent is not None:
                    await sbx.agent.close()
            await vms.close()
            host.close()
            store.db.close()
