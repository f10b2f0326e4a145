#!/usr/bin/env python3
"""A benign key's execute latency alone and beside a busy neighbour: a second key holding
``--times`` times the benign key's sandboxes, each spinning its vCPU, on a service with the
per-key CPU partitions (``cpu_weight_per_key = 100``) and on one without (``0``), in one run.

    .venv/bin/python bench/bench_neighbour.py [--seconds 40] [--benign 2] [--times 4]

The benign sandboxes run tests/vm/hostile.py's benign loop (a small computation, a 0.5 s pause)
in each phase. Prints, per setting, the benign calls' p50 and p99 alone and beside the
neighbour and their ratio (the target: the p99 beside the neighbour within 2x of alone with
partitions), and the neighbour's CPU. With partitions the benign key's share of the host does
not shrink as the neighbour adds sandboxes; without, each busy VM is one more equal share.
Writes bench/results/neighbour.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, machine_facts, now_utc, percentile, run_main, service, spin_code

from kernelhost import AsyncSandbox
from tests.vm.hostile import Tally, benign_loop


async def _phase(benign: list[AsyncSandbox], seconds: float) -> dict[str, Any]:
    """The benign loops for ``seconds``: their calls' p50 and p99."""
    stop, tally = asyncio.Event(), Tally()
    loops = [asyncio.ensure_future(benign_loop(sbx, stop, tally)) for sbx in benign]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*loops, return_exceptions=True), 300)
    lat = tally.latencies
    return {
        "calls": len(lat),
        "p50_ms": round(statistics.median(lat) * 1000, 1),
        "p99_ms": round(percentile(lat, 0.99) * 1000, 1),
        "errors": tally.errors[:5],
    }


async def _run(tmp: Path, weight: int, args: argparse.Namespace) -> dict[str, Any]:
    """One service with ``cpu_weight_per_key = weight``: the benign key alone, then beside."""
    async with service(tmp, f"n{weight}", KERNELHOST_CPU_WEIGHT_PER_KEY=str(weight)) as svc:
        benign = [await AsyncSandbox.create(url=svc.url, api_key=svc.other_key) for _ in range(args.benign)]
        busy: list[AsyncSandbox] = []
        spins: list[asyncio.Task[Any]] = []
        try:
            for sbx in benign:  # warm: the first call of a clone is not what is measured
                await sbx.run_code("1 + 1")
            alone = await _phase(benign, args.seconds)
            for _ in range(args.times * args.benign):
                busy.append(await AsyncSandbox.create(url=svc.url, api_key=svc.api_key))
            spin = spin_code(args.seconds + 60)
            spins = [asyncio.ensure_future(s.run_code(spin, timeout=args.seconds + 120)) for s in busy]
            await asyncio.sleep(5)  # every neighbour spinning, moved into its key's partition
            beside = await _phase(benign, args.seconds)
        finally:
            for s in [*busy, *benign]:
                await s.close()
            await asyncio.gather(*spins, return_exceptions=True)
    return {
        "weight": weight,
        "alone": alone,
        "beside": beside,
        "p50_ratio": round(beside["p50_ms"] / alone["p50_ms"], 2),
        "p99_ratio": round(beside["p99_ms"] / alone["p99_ms"], 2),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    ap.add_argument("--benign", type=int, default=2, help="the benign key's sandboxes")
    ap.add_argument("--times", type=int, default=4, help="the neighbour's sandboxes per benign one")
    args = ap.parse_args()
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts(), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="kh-bench-neighbour-") as tmp:
        for name, weight in (("with", 100), ("without", 0)):
            out[name] = fig = await _run(Path(tmp), weight, args)
            print(
                f"{name + ' partitions:':21} benign p50 {fig['alone']['p50_ms']} -> "
                f"{fig['beside']['p50_ms']} ms ({fig['p50_ratio']}x), p99 {fig['alone']['p99_ms']} -> "
                f"{fig['beside']['p99_ms']} ms ({fig['p99_ratio']}x) beside "
                f"{args.times * args.benign} busy sandboxes of another key",
                flush=True,
            )
    out["p99_ratio_without_over_with"] = round(out["without"]["p99_ratio"] / out["with"]["p99_ratio"], 2)
    print(f"p99 ratio without / with partitions: {out['p99_ratio_without_over_with']}x", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "neighbour.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_main(main)
