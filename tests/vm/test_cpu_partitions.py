"""Each key's VMs in a CPU partition of their own (hypervisor/cgroups.py), through real VMs: two
keys' sandboxes land in their keys' partitions with the configured weight (a pooled VM moved
there at hand-over), and the partitions are gone once the sandboxes are deleted."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypervisor.cgroups import hierarchies, weight_value
from kernelhost import AsyncSandbox
from kernelhost.api.auth import key_id

from ..harness import Service, running_service

pytestmark = pytest.mark.vm

WEIGHT = 200  # not the default, so the test sees the setting, not libvirt's or the kernel's
CPU = Path("/sys/fs/cgroup/cpu/machine")


@pytest.fixture(scope="module")
def weighted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    if not CPU.is_dir():
        pytest.skip("this test reads the cgroup v1 CPU hierarchy (/sys/fs/cgroup/cpu/machine)")
    with running_service(
        tmp_path_factory.mktemp("cpu"),
        "cpu-partitions",
        KERNELHOST_CPU_WEIGHT_PER_KEY=str(WEIGHT),
        KERNELHOST_POOL_SIZE="1",
    ) as svc:
        yield svc


async def _domain_of(svc: Service, sandbox_id: str) -> str:
    hv = svc.hypervisor()
    try:
        deadline = time.monotonic() + 30
        while not (found := [d.name for d in hv.domains() if d.metadata.get("sandbox") == sandbox_id]):
            assert time.monotonic() < deadline, f"no domain labelled with {sandbox_id}"
            await asyncio.sleep(0.1)
        return found[0]
    finally:
        hv.close()


async def _pool_ready(svc: Service) -> None:
    """Until the pool holds a ready clone (``kernelhost_pool_ready``)."""
    deadline = time.monotonic() + 120
    while True:
        text = await asyncio.to_thread(_metrics, svc)
        if re.search(r'^kernelhost_pool_ready\{template="python"\} [1-9]', text, re.M):
            return
        assert time.monotonic() < deadline, "the pool made no clone"
        await asyncio.sleep(0.5)


def _metrics(svc: Service) -> str:
    with urllib.request.urlopen(svc.url + "/metrics", timeout=5) as r:
        return str(r.read().decode())


def _cpu_groups(domain: str) -> set[str]:
    """The v1 CPU cgroup of every thread of the domain's QEMU."""
    pid = int(Path(f"/run/libvirt/qemu/{domain}.pid").read_text())
    groups = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                groups.add(path)
    return groups


def _partitions(svc: Service) -> list[str]:
    return sorted({p.name for h in hierarchies() for p in h.machine.glob(f"{svc.prefix}*.partition")})


async def test_two_keys_vms_run_in_their_partitions_which_go_with_them(weighted: Service) -> None:
    keys = [weighted.api_key, weighted.other_key]
    names = [f"{weighted.prefix}{key_id(k)}" for k in keys]
    first = await AsyncSandbox.create(template="python", api_key=keys[0], url=weighted.url)
    try:
        await _pool_ready(weighted)  # the second key's sandbox is then a pooled VM handed over
        second = await AsyncSandbox.create(template="python", api_key=keys[1], url=weighted.url)
        try:
            created = {e["sandbox_id"]: e["how"] for e in weighted.log_events("sandbox.created")}
            assert created[second.id] == "pool", "the hand-over is what this test moves"
            for sbx, name in ((first, names[0]), (second, names[1])):
                domain = await _domain_of(weighted, sbx.id)
                deadline = time.monotonic() + 10  # a hand-over's move runs after the create
                while not all(g.startswith(f"/machine/{name}.partition/") for g in _cpu_groups(domain)):
                    assert time.monotonic() < deadline, f"{domain}'s threads: {_cpu_groups(domain)}"
                    await asyncio.sleep(0.2)
                shares = (CPU / f"{name}.partition" / "cpu.shares").read_text().strip()
                assert int(shares) == weight_value(WEIGHT, v2=False), "the configured weight"
                assert (await sbx.run_code("6 * 7", timeout=120)).text == "42"
        finally:
            await second.close()
    finally:
        await first.close()
    deadline = time.monotonic() + 20
    while set(names) & set(_partitions(weighted)):
        assert time.monotonic() < deadline, f"partitions left after the deletes: {_partitions(weighted)}"
        await asyncio.sleep(0.2)
