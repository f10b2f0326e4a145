#!/usr/bin/env python3
"""E2B's SDK against kernelhost's own, in one run; writes bench/results/e2b.json.

    .venv/bin/python bench/bench_e2b.py [--sandboxes 5] [--calls 30]

One service (pool of 2). For ``--sandboxes`` rounds, alternating the two SDKs so the machine's
noise falls on both: create (a pool hit) to the first ``run_code("1+1")`` answered, then
``--calls`` more ``1+1`` in the same sandbox. Medians and p95 for each path, and the E2B/ours
ratios (the target: the E2B path adds under 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine_facts, now_utc, report, run_main, service, summary, wait_pool

from kernelhost import AsyncSandbox


async def timed_calls(sbx: Any, t0: float, calls: int) -> tuple[float, list[float]]:
    """From ``t0`` (before the create) to the first ``1+1`` answered, then ``calls`` more."""
    assert (await sbx.run_code("1+1")).text == "2"
    first = time.perf_counter() - t0
    times = []
    for _ in range(calls):
        t1 = time.perf_counter()
        assert (await sbx.run_code("1+1")).text == "2"
        times.append(time.perf_counter() - t1)
    return first, times


async def ours(svc: Any, calls: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    sbx = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
    try:
        return await timed_calls(sbx, t0, calls)
    finally:
        await sbx.close()


async def e2b(calls: int) -> tuple[float, list[float]]:
    from e2b_code_interpreter import AsyncSandbox as E2BSandbox

    t0 = time.perf_counter()
    sbx = await E2BSandbox.create()
    try:
        return await timed_calls(sbx, t0, calls)
    finally:
        await sbx.kill()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts()}
    firsts: dict[str, list[float]] = {"ours": [], "e2b": []}
    calls: dict[str, list[float]] = {"ours": [], "e2b": []}
    with tempfile.TemporaryDirectory(prefix="kh-bench-e2b-") as tmp:
        async with service(Path(tmp), "e2b", KERNELHOST_POOL_SIZE="2") as svc:
            os.environ.update(
                E2B_API_URL=f"{svc.url}/e2b",
                E2B_SANDBOX_URL=f"{svc.url}/e2b/sandbox",
                E2B_API_KEY=svc.api_key,
            )
            os.environ.pop("E2B_DEBUG", None)
            for _ in range(args.sandboxes):
                for path in ("ours", "e2b"):
                    await wait_pool(svc, 2)
                    first, times = await (ours(svc, args.calls) if path == "ours" else e2b(args.calls))
                    firsts[path].append(first)
                    calls[path].extend(times)
    print(f"{args.sandboxes} sandboxes per path (pool hits), {args.calls} calls each:")
    for path in ("ours", "e2b"):
        report(out, f"{path} create to first 1+1", summary(firsts[path]), f"{path}: create to the first 1+1")
        report(out, f"{path} 1+1", summary(calls[path]), f"{path}: run_code('1+1')")
    for what in ("create to first 1+1", "1+1"):
        ratio = out[f"e2b {what}"]["median"] / out[f"ours {what}"]["median"]
        report(out, f"e2b/ours {what}", round(ratio, 2), f"E2B SDK / ours, {what} (ratio of medians)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "e2b.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
