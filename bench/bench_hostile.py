#!/usr/bin/env python3
"""A benign tenant's execute latency alone, then while four hostile guests of another key attack
the host (a guest that stops reading, stray tunnel frames, a frame of millions of objects, a log
flood: tests/vm/hostile.py), in one run, on one service. A third phase is the reference for what
any busy neighbour costs: four loops of the other key doing the same churn as the attacks (create,
one cell, delete) with harmless code that keeps its vCPU busy for as long as an attack runs.

    .venv/bin/python bench/bench_hostile.py [--seconds 60] [--benign 4]

Prints the benign calls' p50 and p99 in each phase, the service's own CPU time, and the ratios
under attack / alone (the target is a p99 within 2x) and under attack / busy neighbours; writes
bench/results/hostile.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, machine_facts, now_utc, percentile, run_main, service, spin_code

from kernelhost import AsyncSandbox
from tests.harness import Service
from tests.vm.hostile import Tally, benign_loop, hostile_loop

KINDS = ["freeze", "stray_tunnels", "object_bomb", "log_flood"]


BUSY = spin_code(4)


async def _busy_loop(url: str, key: str, stop: asyncio.Event, tally: Tally) -> None:
    """The attacks' churn with harmless code: create, keep the vCPU busy for 4 s, delete."""
    while not stop.is_set():
        async with await AsyncSandbox.create(url=url, api_key=key) as sbx:
            await sbx.run_code(BUSY, timeout=120)
            tally.attacks["busy"] = tally.attacks.get("busy", 0) + 1


def _cpu_seconds(svc: Service) -> float:
    """The service process's user + system CPU time so far."""
    assert svc.proc is not None
    fields = Path(f"/proc/{svc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _phase(svc: Service, benign: list[Any], seconds: float, load: str | None) -> Tally:
    """``load``: None (the benign loops alone), "attack" or "busy"."""
    stop = asyncio.Event()
    calm, other = Tally(), Tally()
    loops = [asyncio.ensure_future(benign_loop(sbx, stop, calm)) for sbx in benign]
    if load == "attack":
        loops += [asyncio.ensure_future(hostile_loop(svc.url, svc.api_key, k, stop, other)) for k in KINDS]
    elif load == "busy":
        loops += [asyncio.ensure_future(_busy_loop(svc.url, svc.api_key, stop, other)) for _ in KINDS]
    cpu = _cpu_seconds(svc)
    await asyncio.sleep(seconds)
    calm.service_cpu_s = _cpu_seconds(svc) - cpu
    stop.set()
    await asyncio.wait_for(asyncio.gather(*loops, return_exceptions=True), 300)
    calm.attacks = other.attacks
    calm.deletes = other.deletes
    calm.errors += other.errors
    return calm


def _figures(tally: Tally) -> dict[str, Any]:
    lat = tally.latencies
    return {
        "calls": len(lat),
        "p50_ms": round(statistics.median(lat) * 1000, 1),
        "p99_ms": round(percentile(lat, 0.99) * 1000, 1),
        "attacks": tally.attacks,
        "max_delete_s": round(max(tally.deletes), 2) if tally.deletes else None,
        "errors": tally.errors[:10],
        "service_cpu_s": round(tally.service_cpu_s, 1),
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
            phases = {}
            for name, load in (("alone", None), ("attacked", "attack"), ("busy", "busy")):
                phases[name] = figures = _figures(await _phase(svc, benign, args.seconds, load))
                print(
                    f"benign {name + ':':10} p50 {figures['p50_ms']} ms, p99 {figures['p99_ms']} ms, "
                    f"service CPU {figures['service_cpu_s']} s (load {figures['attacks']}, "
                    f"slowest DELETE {figures['max_delete_s']} s)",
                    flush=True,
                )
            for sbx in benign:
                await sbx.close()
    out.update(phases)
    alone, attacked, busy = phases["alone"], phases["attacked"], phases["busy"]
    for q in ("p50", "p99"):
        out[f"{q}_ratio"] = round(attacked[f"{q}_ms"] / alone[f"{q}_ms"], 2)
        out[f"{q}_ratio_to_busy"] = round(attacked[f"{q}_ms"] / busy[f"{q}_ms"], 2)
    print(f"ratio under attack / alone: p50 {out['p50_ratio']}x, p99 {out['p99_ratio']}x", flush=True)
    print(
        f"ratio under attack / busy neighbours: p50 {out['p50_ratio_to_busy']}x, "
        f"p99 {out['p99_ratio_to_busy']}x",
        flush=True,
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hostile.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_main(main)
