#!/usr/bin/env python3
"""A benign tenant's execute latency alone, then while four hostile guests of another key attack
the host (a guest that stops reading, stray tunnel frames, a frame of millions of objects, a log
flood: tests/vm/hostile.py), in one run, on one service.

    .venv/bin/python bench/bench_hostile.py [--seconds 60] [--benign 4]

Prints the benign calls' p50 and p99 in each phase and the ratio under attack / alone (the target
is a p99 within 2x), and writes bench/results/hostile.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, machine_facts, now_utc, service

from kernelhost import AsyncSandbox
from tests.vm.hostile import Tally, benign_loop, hostile_loop

KINDS = ["freeze", "stray_tunnels", "object_bomb", "log_flood"]


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def _phase(benign: list[Any], seconds: float, attack: tuple[str, str] | None) -> Tally:
    stop = asyncio.Event()
    calm, hostile = Tally(), Tally()
    loops = [asyncio.ensure_future(benign_loop(sbx, stop, calm)) for sbx in benign]
    if attack is not None:
        url, key = attack
        loops += [asyncio.ensure_future(hostile_loop(url, key, k, stop, hostile)) for k in KINDS]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*loops, return_exceptions=True), 300)
    calm.attacks = hostile.attacks
    calm.deletes = hostile.deletes
    calm.errors += hostile.errors
    return calm


def _figures(tally: Tally) -> dict[str, Any]:
    lat = tally.latencies
    return {
        "calls": len(lat),
        "p50_ms": round(statistics.median(lat) * 1000, 1),
        "p99_ms": round(_pct(lat, 0.99) * 1000, 1),
        "attacks": tally.attacks,
        "max_delete_s": round(max(tally.deletes), 2) if tally.deletes else None,
        "errors": tally.errors[:10],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--benign", type=int, default=4, help="benign sandboxes")
    args = parser.parse_args()
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts(), "seconds": args.seconds}
    with tempfile.TemporaryDirectory(prefix="kh-bench-hostile-") as tmp:
        async with service(Path(tmp), "hostile", KERNELHOST_POOL_SIZE="2") as svc:
            benign = [
                await AsyncSandbox.create(url=svc.url, api_key=svc.other_key) for _ in range(args.benign)
            ]
            for sbx in benign:  # warm: the first call of a clone is not what is measured
                await sbx.run_code("1 + 1")
            alone = _figures(await _phase(benign, args.seconds, None))
            print(f"benign alone:        p50 {alone['p50_ms']} ms, p99 {alone['p99_ms']} ms", flush=True)
            attacked = _figures(await _phase(benign, args.seconds, (svc.url, svc.api_key)))
            print(
                f"benign under attack: p50 {attacked['p50_ms']} ms, p99 {attacked['p99_ms']} ms "
                f"(attacks {attacked['attacks']}, slowest DELETE {attacked['max_delete_s']} s)",
                flush=True,
            )
            for sbx in benign:
                await sbx.close()
    out.update(alone=alone, attacked=attacked)
    out["p50_ratio"] = round(attacked["p50_ms"] / alone["p50_ms"], 2)
    out["p99_ratio"] = round(attacked["p99_ms"] / alone["p99_ms"], 2)
    print(f"ratio under attack / alone: p50 {out['p50_ratio']}x, p99 {out['p99_ratio']}x", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hostile.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
