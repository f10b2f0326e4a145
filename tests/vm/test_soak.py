"""A bounded soak: four hostile sandboxes of one key attack the host in a loop (a guest that stops
reading, stray tunnel frames, a frame of millions of objects, a log flood) while four benign
sandboxes of another key run a fixed workload. Through the whole run: the service's memory stays
under a stated bound, every DELETE returns within its deadline, no domain outlives its record,
and the reaper still hibernates the benign key's idle sandbox on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kernelhost import AsyncSandbox
from kernelhost.client import NotFoundError

from ..harness import REPO, Service, running_service
from .hostile import Tally, benign_loop, hostile_loop

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

SOAK_SECONDS = 120
RSS_BOUND_MIB = 160  # the service's growth over the run, attacks and all (about 45 MiB measured)
DELETE_DEADLINE = 15.0


@pytest.fixture(scope="module")
def soak_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(
        tmp_path_factory.mktemp("soak"), "vm-soak", KERNELHOST_REAPER_INTERVAL="1", KERNELHOST_POOL_SIZE="2"
    ) as svc:
        yield svc


def _rss_mib(service: Service) -> float:
    assert service.proc is not None
    with open(f"/proc/{service.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _orphans(service: Service) -> list[str]:
    """Domains labelled with a sandbox that neither key holds any more."""
    known = set()
    for key in (service.api_key, service.other_key):
        known |= {s.id for s in await AsyncSandbox.list(url=service.url, api_key=key)}
    hv = service.hypervisor()
    try:
        labelled = {d.metadata["sandbox"]: d.name for d in hv.domains() if "sandbox" in d.metadata}
    finally:
        hv.close()
    return [name for sandbox_id, name in labelled.items() if sandbox_id not in known]


async def test_hostile_guests_do_not_hurt_the_host_or_the_other_tenant(soak_service: Service) -> None:
    svc = soak_service
    benign: list[AsyncSandbox] = []
    try:
        for _ in range(4):
            benign.append(await AsyncSandbox.create(url=svc.url, api_key=svc.other_key))
        idle = await AsyncSandbox.create(url=svc.url, api_key=svc.other_key, idle_timeout_seconds=20)
        benign.append(idle)
        report = await _soak(svc, benign[:4], idle)
    finally:
        for sbx in benign:
            with contextlib.suppress(NotFoundError):
                await sbx.close()
    (REPO / "results").mkdir(exist_ok=True)
    (REPO / "results" / "soak.json").write_text(json.dumps(report, indent=1))
    assert report["rss_peak_mib"] - report["rss_base_mib"] < RSS_BOUND_MIB, report
    deletes = report["deletes_s"]
    assert deletes and max(deletes) < DELETE_DEADLINE, report
    attacks = report["attacks"]
    assert sum(attacks.values()) >= 6 and set(attacks) == {"SandboxLost"}, report
    assert report["benign_calls"] and not report["benign_errors"], report
    hibernated_after = report["idle_hibernated_after_s"]
    assert hibernated_after is not None and hibernated_after < 20 + 30, report
    assert report["orphans"] == [], "a domain outlived its sandbox"


async def _soak(svc: Service, benign: list[AsyncSandbox], idle: AsyncSandbox) -> dict[str, Any]:
    """Run the attacks and the benign workload for SOAK_SECONDS; what was seen, as a report."""
    stop = asyncio.Event()
    hostile, calm = Tally(), Tally()
    base = peak = _rss_mib(svc)
    kinds = ["freeze", "stray_tunnels", "object_bomb", "log_flood"]
    loops = [asyncio.ensure_future(hostile_loop(svc.url, svc.api_key, k, stop, hostile)) for k in kinds]
    loops += [asyncio.ensure_future(benign_loop(sbx, stop, calm)) for sbx in benign]
    idle_since = time.monotonic()
    hibernated_after: float | None = None
    try:
        deadline = time.monotonic() + SOAK_SECONDS
        while time.monotonic() < deadline:
            await asyncio.sleep(2)
            peak = max(peak, _rss_mib(svc))
            if hibernated_after is None and (await idle.info()).state == "hibernated":
                hibernated_after = time.monotonic() - idle_since
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loops, return_exceptions=True), 300)
    await asyncio.sleep(3)
    return {
        "seconds": SOAK_SECONDS, "rss_base_mib": round(base), "rss_peak_mib": round(peak),
        "rss_end_mib": round(_rss_mib(svc)), "attacks": hostile.attacks,
        "deletes_s": [round(d, 2) for d in hostile.deletes], "benign_calls": len(calm.latencies),
        "benign_p50_s": round(statistics.median(calm.latencies), 3) if calm.latencies else None,
        "hostile_errors": hostile.errors[:20], "benign_errors": calm.errors[:20],
        "idle_hibernated_after_s": hibernated_after, "orphans": await _orphans(svc),
    }  # fmt: skip
