#!/usr/bin/env python3
"""Fast-start benchmarks, in one run with a cold boot as the reference.

    .venv/bin/python bench/bench_fast_start.py [--density 200] [--rounds 15]

Prints medians and p95s, writes bench/results/fast_start.json. Figures:
- create, cold boot (snapshots off): the reference
- create on a pool miss (clone from the template snapshot, on demand) and on a pool hit
  (measured at the client: HTTP round trip included, so an upper bound of the service's time)
- fork(1) and fork(5) of a sandbox holding 100 MB of state
- wake of a hibernated sandbox (its first call's extra latency)
- proportional memory (PSS) per idle sandbox, from the QEMU processes' smaps_rollup
- density: how many idle sandboxes run at once while each still answers ``1+1``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    Service,
    domains_of,
    mem_available_mib,
    ms,
    qemu_pss_mib,
    report,
    run_main,
    service,
    summary,
    wait_pool,
)

from kernelhost import AsyncSandbox


async def timed_create(svc: Service) -> tuple[float, AsyncSandbox]:
    t0 = time.perf_counter()
    sbx = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key, timeout=300)
    return time.perf_counter() - t0, sbx


async def bench_cold(tmp: Path, n: int) -> dict[str, float]:
    async with service(tmp, "cold", KERNELHOST_SNAPSHOTS="off", KERNELHOST_POOL_SIZE="0") as svc:
        samples = []
        for _ in range(n):
            took, sbx = await timed_create(svc)
            samples.append(took)
            await sbx.close()
        return summary(samples)


async def bench_snapshots(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with service(tmp, "warm", KERNELHOST_POOL_SIZE="0", KERNELHOST_REAPER_INTERVAL="1") as svc:
        # the first create builds the template snapshot (a cold boot plus freeze) if needed
        took, first = await timed_create(svc)
        report(out, "first_create_incl_snapshot_build_s", round(took, 2))
        miss = []
        for _ in range(args.rounds):
            took, sbx = await timed_create(svc)
            miss.append(took)
            await sbx.close()
        report(out, "create_pool_miss", summary(miss))
        # fork with 100 MB of state in the parent
        await first.run_code("import os\nblob = os.urandom(100 * 1024 * 1024)\nlen(blob)")
        f1, f5 = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            kids = await first.fork(1)
            f1.append(time.perf_counter() - t0)
            assert (await kids[0].run_code("len(blob)")).text == str(100 * 1024 * 1024)
            for k in kids:
                await k.close()
        for _ in range(2):
            t0 = time.perf_counter()
            kids = await first.fork(5)
            f5.append(time.perf_counter() - t0)
            for k in kids:
                await k.close()
        report(out, "fork1_100MB", summary(f1))
        report(out, "fork5_100MB", summary(f5))
        # wake after hibernation: first call's latency, against a warm call
        wake, warm = [], []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {svc.api_key}"}) as http:
            for _ in range(3):
                t0 = time.perf_counter()
                await first.run_code("1+1")
                warm.append(time.perf_counter() - t0)
                r = await http.post(f"{svc.url}/v1/sandboxes/{first.id}/hibernate")
                assert r.status == 200
                t0 = time.perf_counter()
                assert (await first.run_code("1+1")).text == "2"
                wake.append(time.perf_counter() - t0)
        report(out, "wake_first_call_100MB", summary(wake))
        report(out, "warm_call", summary(warm))
        await first.close()
        # density: clones side by side, each answering
        before = mem_available_mib()
        alive: list[AsyncSandbox] = []
        t0 = time.perf_counter()
        for _ in range(args.density):
            try:
                _, sbx = await timed_create(svc)
            except Exception as exc:  # report how far it got, not a crash
                out["density_stopped_by"] = repr(exc)
                break
            alive.append(sbx)
        out["density_create_all_s"] = time.perf_counter() - t0
        answers = await asyncio.gather(*[s.run_code("1+1") for s in alive], return_exceptions=True)
        ok = sum(1 for a in answers if not isinstance(a, BaseException) and a.text == "2")
        pss = [qemu_pss_mib(d) for d in domains_of(svc)]
        report(
            out,
            "density",
            {
                "started": len(alive),
                "answered": ok,
                "host_mem_used_mib": round(before - mem_available_mib()),
                "pss_per_sandbox_mib": summary(pss) if pss else None,
            },
        )
        for sbx in alive:
            await sbx.close()
    async with service(tmp, "pool", KERNELHOST_POOL_SIZE="3") as svc:
        hit = []
        for _ in range(args.rounds):
            await wait_pool(svc, 3)
            took, sbx = await timed_create(svc)
            hit.append(took)
            await sbx.close()
        report(out, "create_pool_hit", summary(hit))
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--density", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cold", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kh-bench-") as tmpdir:
        tmp = Path(tmpdir)
        cold = await bench_cold(tmp, args.cold)
        print(f"{'create_cold_boot':34} {ms(cold)}", flush=True)
        res = await bench_snapshots(tmp, args)
    res["create_cold_boot"] = cold
    print(f"{'figure':34} {'median':>12} {'p95':>12}")
    for key in (
        "create_cold_boot",
        "create_pool_miss",
        "create_pool_hit",
        "fork1_100MB",
        "fork5_100MB",
        "warm_call",
        "wake_first_call_100MB",
    ):
        print(f"{key:34} {ms(res[key])}")
    print(
        f"cold boot / pool miss: {cold['median'] / res['create_pool_miss']['median']:.0f}x; "
        f"cold boot / pool hit: {cold['median'] / res['create_pool_hit']['median']:.0f}x"
    )
    d = res["density"]
    pss = d["pss_per_sandbox_mib"]
    print(
        f"density: {d['started']} started, {d['answered']} answered 1+1; host memory used "
        f"{d['host_mem_used_mib']} MiB; PSS per sandbox median "
        f"{pss['median'] if pss else float('nan'):.1f} MiB"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fast_start.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    run_main(main)
