"""Usage figures through a real VM: each execution's wall time, CPU time and peak memory."""

from __future__ import annotations

import json

import pytest

from kernelhost import AsyncSandbox

pytestmark = pytest.mark.vm


async def test_each_execution_reports_wall_cpu_and_peak_memory(py: AsyncSandbox) -> None:
    idle = await py.run_code("import time\ntime.sleep(1)")
    busy = await py.run_code(
        "import time\nt = time.time()\nwhile time.time() - t < 1:\n    pass\n"
        "big = bytearray(200 * 2**20)\ndel big"
    )
    for execution in (idle, busy):
        assert execution.duration_ms is not None and execution.duration_ms >= 900
        assert execution.cpu_time_ms is not None and execution.peak_memory_bytes is not None
    # (the loop checked them; mypy does not narrow through it)
    assert busy.cpu_time_ms is not None and idle.cpu_time_ms is not None
    assert busy.peak_memory_bytes is not None and idle.peak_memory_bytes is not None
    assert busy.cpu_time_ms > 800 > idle.cpu_time_ms
    assert busy.peak_memory_bytes >= 200 * 2**20 > idle.peak_memory_bytes
    shell = await py.run_code("python3 -c 'b = bytearray(100 * 2**20)'", language="bash", timeout=60)
    assert shell.peak_memory_bytes is not None and shell.peak_memory_bytes >= 100 * 2**20
    assert shell.cpu_time_ms is not None and shell.cpu_time_ms > 0
    wire = json.dumps({"cpu": busy.cpu_time_ms, "peak": busy.peak_memory_bytes})
    assert wire  # JSON-ready figures
