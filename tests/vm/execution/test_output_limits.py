"""Output caps through a real VM: printing forever is cut at the cap, host memory stays flat."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from kernelhost import AsyncSandbox

from ...harness import Service
from .common import MAX_OUTPUT

pytestmark = pytest.mark.vm


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_printing_forever_is_cut_at_the_cap_and_host_memory_stays_flat(
    py: AsyncSandbox, execution_service: Service
) -> None:
    assert execution_service.proc is not None
    pid = execution_service.proc.pid
    # the guest's first GiB string faults in a GiB of fresh VM memory (seconds under emulation,
    # many more under a loaded CI machine): paid here, outside the flood's 20 s
    warm = await py.run_code("x = 'x' * 10**9\ndel x", timeout=120)
    assert warm.status == "ok", warm.error
    baseline = _rss(pid)
    samples: list[int] = []

    async def sample() -> None:
        while True:
            samples.append(_rss(pid))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    try:
        flood = await py.run_code("while True:\n    print('x' * 10**9)", timeout=20)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    assert flood.status == "timeout" and flood.output_truncated, (flood.status, len(flood.stdout))
    assert flood.stdout.startswith("x" * 1000)
    assert "output truncated" in flood.stdout and "max_output_bytes" in flood.stdout
    assert MAX_OUTPUT <= len(flood.stdout.encode()) < MAX_OUTPUT + 1000
    # the service kept no more than a few frames of it at any time
    assert max(samples) - baseline < 64 << 20, (baseline, max(samples))
    bash = await py.run_code("yes | head -c 50000000", language="bash", timeout=60)
    assert bash.output_truncated and len(bash.stdout.encode()) < MAX_OUTPUT + 1000
    assert bash.exit_code == 0
