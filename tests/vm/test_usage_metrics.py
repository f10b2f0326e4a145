"""Each sandbox's CPU, memory and disk over time (sandboxes/sampler.py), through a real VM: a
sandbox that spins its CPU, holds memory and writes a file shows CPU rising and memory and disk
grown in its samples (the SDK's ``get_metrics`` and E2B's), ``/metrics/sandboxes`` lists it for
an operator key only and forgets it once it is deleted; the public ``/metrics`` names no one."""

from __future__ import annotations

import asyncio
import re
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kernelhost import AsyncSandbox, SandboxMetrics
from kernelhost.api.auth import key_id

from ..harness import Service, running_service

pytestmark = pytest.mark.vm

OPERATOR = "operator-key-" + secrets.token_hex(12)
MIB = 1 << 20


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(
        tmp_path_factory.mktemp("usage"),
        "vm-usage-metrics",
        KERNELHOST_OPERATOR_KEYS=OPERATOR,
        KERNELHOST_SANDBOX_METRICS_INTERVAL="1",
        KERNELHOST_POOL_SIZE="0",
    ) as svc:
        yield svc


def _get(svc: Service, path: str, key: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(svc.url + path, headers=headers), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def _samples_after(
    sbx: AsyncSandbox, t: float, n: int = 2, timeout: float = 60
) -> list[SandboxMetrics]:
    """At least ``n`` complete samples taken after ``t`` (Unix time)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            s for s in await sbx.get_metrics(start=t) if s.mem_used is not None and s.cpu_used_pct is not None
        ]
        if len(found) >= n:
            return found
        assert time.monotonic() < deadline, f"fewer than {n} samples after {t} within {timeout}s"
        await asyncio.sleep(0.5)


async def test_a_busy_sandbox_shows_in_its_samples_and_to_the_operator(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    sbx = await AsyncSandbox.create(template="python", url=svc.url, api_key=svc.api_key, timeout=900)
    deleted = False
    try:
        before = await _samples_after(sbx, time.time(), n=3)
        idle = before[-1]
        assert idle.cpu_count == 1 and idle.host_memory_bytes > 50 * MIB, idle
        assert idle.mem_total and 0 < idle.mem_used < idle.mem_total, idle  # type: ignore[operator]
        assert idle.disk_total and 0 <= idle.disk_used < idle.disk_total, idle  # type: ignore[operator]

        spin_start = time.time()
        spun = await sbx.run_code("import time\nt = time.time()\nwhile time.time() - t < 5: pass\n'spun'")
        assert spun.text == "'spun'", spun
        spin = [
            s for s in await _samples_after(sbx, spin_start, n=3) if s.timestamp.timestamp() <= time.time()
        ]
        busiest = max(s.cpu_used_pct or 0 for s in spin)
        print(f"cpu idle {[s.cpu_used_pct for s in before]} spinning {[s.cpu_used_pct for s in spin]}")
        # a spinning vCPU takes what the host gives it: all of a core on a quiet host, a share
        # of one on a loaded one (the tests of others), but always well above the idle guest's
        calm = max(s.cpu_used_pct or 0 for s in before)
        assert busiest > max(2 * calm, calm + 4), (before, spin)
        assert spin[-1].cpu_seconds > idle.cpu_seconds, (idle, spin[-1])

        held = await sbx.run_code(
            "held = b'x' * (120 << 20)\n"
            "with open('/home/user/big.bin', 'wb') as f:\n"
            "    f.write(b'y' * (80 << 20))\n"
            "len(held)"
        )
        assert held.error is None, held.error
        # a sample taken once the cell ended: one taken while it ran may miss part of the write
        grown_at = time.time()
        after = (await _samples_after(sbx, grown_at + 0.5, n=1))[-1]
        print(f"idle {idle}\nafter {after}")
        assert after.mem_used - idle.mem_used >= 100 * MIB, (idle, after)  # type: ignore[operator]
        assert after.disk_used - idle.disk_used >= 75 * MIB, (idle, after)  # type: ignore[operator]
        assert after.host_memory_bytes - idle.host_memory_bytes >= 100 * MIB, (idle, after)

        # E2B's SDK reads the same samples
        monkeypatch.setenv("E2B_API_URL", f"{svc.url}/e2b")
        monkeypatch.setenv("E2B_SANDBOX_URL", f"{svc.url}/e2b/sandbox")
        monkeypatch.setenv("E2B_API_KEY", svc.api_key)
        monkeypatch.delenv("E2B_DEBUG", raising=False)
        from e2b import AsyncSandbox as E2BSandbox

        e2b = await E2BSandbox.connect(sbx.id)
        entries = await e2b.get_metrics()
        assert len(entries) >= 6 and entries == sorted(entries, key=lambda e: e.timestamp), entries
        assert entries[-1].disk_used - idle.disk_used >= 75 * MIB, entries[-1]  # type: ignore[operator]
        assert max(e.cpu_used_pct for e in entries) >= busiest, entries
        recent = await e2b.get_metrics(start=after.timestamp)
        assert 1 <= len(recent) < len(entries) and recent[0].mem_used >= after.mem_used - 16 * MIB, recent  # type: ignore[operator]

        # the operator's view: ids as labels; a tenant's key is refused; the public one names no one
        assert _get(svc, "/metrics/sandboxes", svc.api_key)[0] == 403
        status, text = await asyncio.to_thread(_get, svc, "/metrics/sandboxes", OPERATOR)
        assert status == 200, text
        labels = f'key_id="{key_id(svc.api_key)}",sandbox_id="{sbx.id}",template="python"'
        used = re.search(rf"^kernelhost_sandbox_disk_used_bytes\{{{labels}\}} (\S+)$", text, re.M)
        assert used and float(used.group(1)) >= 75 * MIB, text
        assert svc.api_key not in text and OPERATOR not in text
        public = (await asyncio.to_thread(_get, svc, "/metrics"))[1]
        assert sbx.id not in public and key_id(svc.api_key) not in public
        passes = re.search(r"^kernelhost_sampler_pass_seconds_sum (\S+)$", public, re.M)
        count = re.search(r"^kernelhost_sampler_pass_seconds_count (\S+)$", public, re.M)
        assert passes and count
        n = float(count.group(1))
        print(f"sampler: {n:.0f} passes, {float(passes.group(1)) / n * 1000:.1f} ms each")

        await sbx.close()
        deleted = True
        status, text = await asyncio.to_thread(_get, svc, "/metrics/sandboxes", OPERATOR)
        assert status == 200 and sbx.id not in text, text
    finally:
        if not deleted:
            await sbx.close()
