"""The fork's spare RAM copies (``fork_spares.Spares``): a copy runs at the idle priority until a
fork right after another waits for it, instead of copying the base beside it, and raises it;
paused QEMUs are started on each ready copy, handed to the fork that takes it, and destroyed
when the service stops, even mid-copy."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hypervisor import HypervisorError
from hypervisor.forkram import copy_base
from kernelhost.sandboxes.vm import spares as fork_spares
from kernelhost.tasks import TaskSet

pytestmark = pytest.mark.unit

SIZE = 1 << 20
POLICIES: list[int] = []  # the scheduling policies the held copies ran at


@pytest.fixture
def base(tmp_path: Path) -> Path:
    ram = tmp_path / "templates" / "python-0123" / "ram"
    ram.parent.mkdir(parents=True)
    ram.write_bytes(bytes(range(256)) * (SIZE // 256))
    (tmp_path / "forks").mkdir()
    return ram


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every spare's copy until set."""
    opened = threading.Event()

    def held(source: str | Path, dest: Path) -> int:
        POLICIES.append(os.sched_getscheduler(0))  # the copying thread's, before the gate
        assert opened.wait(10), "the test never opened the gate"
        POLICIES.append(os.sched_getscheduler(0))  # after: raised if a fork waited for it
        return copy_base(source, dest)

    POLICIES.clear()

    monkeypatch.setattr("kernelhost.sandboxes.vm.spares.copy_base", held)
    monkeypatch.setattr("kernelhost.sandboxes.vm.spares.give_to_qemu", lambda *args: None)
    return opened


@pytest.fixture
async def tasks(gate: threading.Event) -> AsyncIterator[TaskSet]:
    """The spares' tasks; its copies are ended (the gate opened) and the tasks closed after."""
    owned = TaskSet("test")
    try:
        yield owned
    finally:
        gate.set()
        await owned.close()


@pytest.fixture
def spares(tmp_path: Path, tasks: TaskSet) -> fork_spares.Spares:
    """Spares of the fixture's templates, with no QEMUs."""
    return fork_spares.Spares(tmp_path / "forks", tmp_path / "templates", tasks)


async def test_a_fork_right_after_another_takes_the_spare_being_made(
    tmp_path: Path, base: Path, gate: threading.Event, spares: fork_spares.Spares
) -> None:
    spares.refill(str(base), SIZE)
    dest = tmp_path / "child.ram"
    for _ in range(1000):  # the copy under way at its idle priority (later on a busy host)
        if POLICIES:
            break
        await asyncio.sleep(0.01)
    taking = asyncio.create_task(spares.take(str(base), dest))
    await asyncio.sleep(0.2)
    assert not taking.done()  # waiting for the copy, not copying the base itself
    gate.set()
    assert await asyncio.wait_for(taking, 10) == fork_spares.Spare(dest)
    assert POLICIES == [os.SCHED_IDLE, os.SCHED_OTHER]  # idle until the fork waited for it
    assert dest.read_bytes() == base.read_bytes()
    assert await spares.take(str(base), tmp_path / "next.ram") is None  # taken: none ready


async def test_a_spare_that_cannot_be_made_lets_the_fork_copy_for_itself(
    tmp_path: Path, base: Path, gate: threading.Event, spares: fork_spares.Spares
) -> None:
    gate.set()
    missing = tmp_path / "templates" / "gone-0123" / "ram"  # pruned since: the copy fails
    spares.refill(str(missing), SIZE)
    took = await asyncio.wait_for(spares.take(str(missing), tmp_path / "child.ram"), 10)
    assert took is None and not (tmp_path / "child.ram").exists()
    assert list((tmp_path / "forks").iterdir()) == []  # nothing half-made is left


async def test_a_spare_nobody_waits_for_is_copied_at_the_idle_priority(
    tmp_path: Path, base: Path, gate: threading.Event, spares: fork_spares.Spares
) -> None:
    gate.set()
    spares.refill(str(base), SIZE)
    await asyncio.sleep(0.5)
    dest = tmp_path / "child.ram"
    assert await asyncio.wait_for(spares.take(str(base), dest), 10) is not None
    assert dest.read_bytes() == base.read_bytes()
    assert POLICIES == [os.SCHED_IDLE, os.SCHED_IDLE]


async def test_stop_mid_copy_raises_it_and_keeps_no_spare(
    tmp_path: Path, base: Path, gate: threading.Event, tasks: TaskSet, spares: fork_spares.Spares
) -> None:
    spares.refill(str(base), SIZE)
    await asyncio.sleep(0.2)
    spares.stop()
    gate.set()
    await tasks.wait(10)
    assert POLICIES == [os.SCHED_IDLE, os.SCHED_OTHER]
    assert await spares.take(str(base), tmp_path / "child.ram") is None
    assert list((tmp_path / "forks").iterdir()) == []
    spares.refill(str(base), SIZE)  # a stopped service makes no more
    assert len(tasks) == 0


class FakeVms:
    """``start_vm`` and ``destroy_vm`` for ``Spares``: names the files its QEMUs map."""

    def __init__(self, fail: bool = False, fail_calls: frozenset[int] = frozenset()) -> None:
        self.fail, self.fail_calls = fail, fail_calls  # every start fails, or these calls (0-based)
        self.calls = 0
        self.started: dict[str, Path] = {}
        self.destroyed: list[str] = []
        self.hold = asyncio.Event()
        self.hold.set()

    async def start(self, ram: Path, image: object) -> str:
        call, self.calls = self.calls, self.calls + 1
        await self.hold.wait()
        if self.fail or call in self.fail_calls:
            raise HypervisorError("no QEMU today")
        domain = f"kht-spare{len(self.started)}"
        self.started[domain] = ram
        return domain

    def destroy(self, domain: str) -> None:
        self.destroyed.append(domain)


def spares_with(tmp_path: Path, tasks: TaskSet, vms: FakeVms) -> fork_spares.Spares:
    return fork_spares.Spares(tmp_path / "forks", tmp_path / "templates", tasks, vms.start, vms.destroy)


IMAGE: Any = object()  # the fake's start never looks at it


async def test_a_ready_spare_has_a_paused_qemu_on_its_file_for_the_fork(
    tmp_path: Path, base: Path, gate: threading.Event, tasks: TaskSet
) -> None:
    gate.set()
    vms = FakeVms()
    spares = spares_with(tmp_path, tasks, vms)
    spares.refill(str(base), SIZE, IMAGE)
    dest = tmp_path / "child.ram"
    spare = await asyncio.wait_for(spares.take(str(base), dest), 10)
    assert spare == fork_spares.Spare(dest, ("kht-spare0",))
    assert vms.started["kht-spare0"].name.startswith("spare-")  # the file it mapped, moved to dest
    assert dest.read_bytes() == base.read_bytes() and vms.destroyed == []  # the fork's now
    spares.refill(str(base), SIZE)  # no image: a file spare only
    assert await asyncio.wait_for(spares.take(str(base), dest), 10) == fork_spares.Spare(dest)


async def test_stop_destroys_the_ready_spares_qemu_and_one_started_during_the_copy(
    tmp_path: Path, base: Path, gate: threading.Event, tasks: TaskSet
) -> None:
    gate.set()
    vms = FakeVms()
    spares = spares_with(tmp_path, tasks, vms)
    spares.refill(str(base), SIZE, IMAGE)
    await tasks.wait(10)
    other = tmp_path / "templates" / "python-4567" / "ram"
    other.parent.mkdir()
    other.write_bytes(base.read_bytes())
    vms.hold.clear()  # the second spare's QEMU starts only after the stop
    spares.refill(str(other), SIZE, IMAGE)
    await asyncio.sleep(0.2)
    spares.stop()
    vms.hold.set()
    await tasks.wait(10)
    assert sorted(vms.destroyed) == sorted(vms.started) == ["kht-spare0", "kht-spare1"]
    spares.clear()
    assert list((tmp_path / "forks").iterdir()) == []
    spares.refill(str(base), SIZE, IMAGE)  # a stopped service makes no more
    assert await spares.take(str(base), tmp_path / "child.ram") is None


async def test_a_qemu_that_cannot_start_leaves_the_file_spare(
    tmp_path: Path, base: Path, gate: threading.Event, tasks: TaskSet
) -> None:
    gate.set()
    vms = FakeVms(fail=True)
    spares = spares_with(tmp_path, tasks, vms)
    spares.refill(str(base), SIZE, IMAGE)
    dest = tmp_path / "child.ram"
    assert await asyncio.wait_for(spares.take(str(base), dest), 10) == fork_spares.Spare(dest)


async def test_a_spare_has_as_many_qemus_as_asked_at_most_the_cap_and_keeps_those_that_started(
    tmp_path: Path, base: Path, gate: threading.Event, tasks: TaskSet
) -> None:
    gate.set()
    vms = FakeVms(fail_calls=frozenset({1}))
    spares = spares_with(tmp_path, tasks, vms)
    spares.refill(str(base), SIZE, IMAGE, vms=3)  # the second start fails
    dest = tmp_path / "child.ram"
    spare = await asyncio.wait_for(spares.take(str(base), dest), 10)
    assert spare is not None and len(spare.domains) == 2 and vms.calls == 3
    spares.refill(str(base), SIZE, IMAGE, vms=50)
    spare = await asyncio.wait_for(spares.take(str(base), dest), 10)
    assert spare is not None and len(spare.domains) == fork_spares.SPARE_VMS_MAX
    spares.drop_vms(spare.domains[1:], delay=0.3)  # the ones a fork leaves, a little later
    await asyncio.sleep(0.1)
    assert vms.destroyed == []
    await tasks.wait(5)
    assert sorted(vms.destroyed) == sorted(spare.domains[1:])
