#!/usr/bin/env python3
"""A key's CPU share against a busier key: one key keeps 4 sandboxes busy, another 1, with the
per-key CPU partitions (``cpu_weight_per_key = 100``) and without (``0``), in one run.

    .venv/bin/python bench/bench_cpu_fairness.py [--seconds 30] [--busy 4] [--step 5]

Each sandbox spins its vCPU for the whole window; every ``--step`` seconds the CPU time each
key's VMs used (libvirt's per-domain CPU time) is read, and the 1-sandbox key's share of it
taken. Prints the median share with and without partitions and their ratio; equal weights on a
host with fewer cores than busy vCPUs give the lone sandbox's key half the CPU (at most one core:
its one vCPU), against 1/(busy+1) without. Writes bench/results/cpu_fairness.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS, machine_facts, now_utc, run_main, service, spin_code

from kernelhost import AsyncSandbox
from tests.harness import Service


async def _domains(svc: Service, sandboxes: list[AsyncSandbox]) -> list[str]:
    """Each sandbox's domain, by the label the service puts on it."""
    hv = svc.hypervisor()
    try:
        want = {s.id for s in sandboxes}
        deadline = time.monotonic() + 30
        while True:
            found = {d.metadata.get("sandbox"): d.name for d in hv.domains()}
            if want <= found.keys():
                return [found[s.id] for s in sandboxes]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no domain labelled for {want - found.keys()}")
            await asyncio.sleep(0.2)
    finally:
        hv.close()


def _cpu_ns(svc: Service, domains: list[str]) -> int:
    hv = svc.hypervisor()
    try:
        return sum(hv.cpu_time(d)[0] for d in domains)
    finally:
        hv.close()


async def _run(tmp: Path, weight: int, args: argparse.Namespace) -> dict[str, Any]:
    """One service with ``cpu_weight_per_key = weight``: the lone key's share, step by step."""
    async with service(tmp, f"w{weight}", KERNELHOST_CPU_WEIGHT_PER_KEY=str(weight)) as svc:
        busy = [await AsyncSandbox.create(url=svc.url, api_key=svc.api_key) for _ in range(args.busy)]
        lone = await AsyncSandbox.create(url=svc.url, api_key=svc.other_key)
        try:
            doms_busy, doms_lone = await _domains(svc, busy), await _domains(svc, [lone])
            await asyncio.sleep(2)  # a hand-over's move into the key's partition
            spin = spin_code(args.seconds + 2 * args.step)
            runs = [asyncio.create_task(s.run_code(spin, timeout=args.seconds * 4)) for s in [*busy, lone]]
            await asyncio.sleep(args.step)  # every loop spinning
            shares, cores = [], []
            last = (_cpu_ns(svc, doms_busy), _cpu_ns(svc, doms_lone), time.monotonic())
            for _ in range(int(args.seconds / args.step)):
                await asyncio.sleep(args.step)
                now = (_cpu_ns(svc, doms_busy), _cpu_ns(svc, doms_lone), time.monotonic())
                a, b, dt = now[0] - last[0], now[1] - last[1], now[2] - last[2]
                shares.append(b / (a + b))
                cores.append((a + b) / 1e9 / dt)
                last = now
            await asyncio.gather(*runs, return_exceptions=True)
        finally:
            for s in [*busy, lone]:
                await s.close()
    return {
        "weight": weight,
        "lone_share_median": round(statistics.median(shares), 3),
        "lone_share_samples": [round(s, 3) for s in shares],
        "cores_used_median": round(statistics.median(cores), 2),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="measured window per setting")
    ap.add_argument("--busy", type=int, default=4, help="busy sandboxes of the busier key")
    ap.add_argument("--step", type=float, default=5.0, help="seconds per sample")
    args = ap.parse_args()
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts(), "busy": args.busy}
    with tempfile.TemporaryDirectory(prefix="kh-bench-cpu-") as tmp:
        for name, weight in (("with", 100), ("without", 0)):
            out[name] = figures = await _run(Path(tmp), weight, args)
            print(
                f"{name + ' partitions:':21} the 1-sandbox key's CPU share, median "
                f"{figures['lone_share_median']} (samples {figures['lone_share_samples']}; "
                f"{figures['cores_used_median']} cores busy)",
                flush=True,
            )
    out["ratio"] = round(out["with"]["lone_share_median"] / out["without"]["lone_share_median"], 2)
    print(f"share with / without: {out['ratio']}x (fair: 0.5 with, 1/{args.busy + 1} without)", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_fairness.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_main(main)
