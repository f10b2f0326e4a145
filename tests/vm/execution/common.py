"""What the execution tests share besides fixtures: this service's limits, and a liveness check."""

from __future__ import annotations

import time

from kernelhost import AsyncSandbox

MAX_OUTPUT = 1 << 20  # this service's max_output_bytes
MAX_RESULT = 4 << 20  # this service's max_result_bytes
MAX_FILE = 120 << 20  # this service's max_file_bytes
GRACE = 3.0
AGENT_TIMEOUT = 5.0


async def alive(sbx: AsyncSandbox) -> None:
    """The sandbox answers, quickly, on a working kernel."""
    t0 = time.monotonic()
    execution = await sbx.run_code("6 * 7", timeout=60)
    assert execution.status == "ok" and execution.text == "42", execution
    assert time.monotonic() - t0 < 30
