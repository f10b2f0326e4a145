"""A bounded loopback load test: N sandboxes at once, each running M executions back to back.

Every execution prints a token only its request knows and reads a value only its sandbox holds, so
an output that went to the wrong request, or got lost, fails the test. Throughput and latency
percentiles are printed and kept in ``results/load.json`` (figures, not assertions: these machines
are shared and noisy).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import statistics
import time
from pathlib import Path

import pytest

from kernelhost import AsyncSandbox

from ..harness import Service

pytestmark = pytest.mark.vm

SANDBOXES = 6
EXECUTIONS = 8
RESULTS = Path(__file__).resolve().parents[2] / "results"


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _worker(sbx: AsyncSandbox, latencies: list[float]) -> int:
    own = secrets.token_hex(8)
    setup = await sbx.run_code(f"OWN = {own!r}\ncount = 0", timeout=120)
    assert setup.error is None, setup.error
    for i in range(EXECUTIONS):
        token = secrets.token_hex(8)
        streamed: list[str] = []
        t0 = time.perf_counter()
        ex = await sbx.run_code(
            f"count += 1\nprint({token!r})\nprint(OWN, count)\n(OWN, count, {i} * 7)",
            timeout=120,
            on_stdout=streamed.append,
        )
        latencies.append(time.perf_counter() - t0)
        assert ex.error is None, ex.error
        assert ex.stdout == f"{token}\n{own} {i + 1}\n", (ex.stdout, token, own)
        assert "".join(streamed) == ex.stdout  # streamed and collected agree
        assert ex.text == repr((own, i + 1, i * 7))
    return EXECUTIONS


async def test_concurrent_sandboxes_each_get_exactly_their_own_output(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    sandboxes = await asyncio.gather(
        *(AsyncSandbox.create(url=service.url, api_key=service.api_key) for _ in range(SANDBOXES))
    )
    latencies: list[float] = []
    try:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(_worker(s, latencies) for s in sandboxes))
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(s.close() for s in sandboxes))
    assert sum(done) == SANDBOXES * EXECUTIONS == len(latencies)
    ordered = sorted(latencies)
    figures = {
        "sandboxes": SANDBOXES,
        "executions_each": EXECUTIONS,
        "executions": len(ordered),
        "wall_s": round(wall, 3),
        "throughput_per_s": round(len(ordered) / wall, 2),
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p99_ms": round(_percentile(ordered, 0.99) * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "load.json").write_text(json.dumps(figures, indent=2) + "\n")
    with capsys.disabled():
        print(
            f"\nload: {SANDBOXES} sandboxes x {EXECUTIONS} executions: "
            f"{figures['throughput_per_s']} executions/s, p50 {figures['p50_ms']} ms, "
            f"p99 {figures['p99_ms']} ms (results/load.json)"
        )
