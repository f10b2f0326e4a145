#!/usr/bin/env python3
"""Density: many idle sandboxes at once, each answering; their memory and idle CPU.

    .venv/bin/python bench/bench_density.py [--sandboxes 200] [--idle 30]

Creates ``--sandboxes`` sandboxes on one service (each answers ``1+1``), leaves them idle for
``--idle`` seconds, then has every one answer ``1+1`` again. Prints the PSS of each sandbox's
QEMU process (median, p95) with where one clone's PSS goes (the guest RAM pages it changed,
QEMU's anonymous memory such as TCG's translation cache, the rest), the CPU all of them use
while idle (% of one core, from /proc), and MemAvailable before and after. Writes
bench/results/density.json. Every sandbox is deleted on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    domains_of,
    machine_facts,
    mem_available_mib,
    qemu_pid,
    run_main,
    service,
    smaps_mib,
    summary,
)

from kernelhost import AsyncSandbox

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def pss_breakdown(pid: int) -> dict[str, float]:
    """One QEMU's PSS (MiB) by kind of mapping: the guest RAM file (pages the clone changed, and
    its share of the template's), anonymous memory (TCG's translation cache, QEMU's heap), files."""
    kinds: dict[str, float] = defaultdict(float)
    kind = "other"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            name = head[5] if len(head) > 5 else ""
            if "/ram" in name or "memory" in name or "kernelhost" in name:
                kind = "guest_ram_file"
            elif not name or name.startswith("[heap]") or name.startswith("[anon"):
                kind = "anonymous"
            else:
                kind = "files_and_libraries"
        elif head and head[0] == "Pss:":
            kinds[kind] += int(head[1]) / 1024
    return {k: round(v, 1) for k, v in kinds.items()}


async def create_all(url: str, key: str, n: int, parallel: int) -> list[AsyncSandbox]:
    made: list[AsyncSandbox] = []
    gate = asyncio.Semaphore(parallel)

    async def one() -> None:
        async with gate:
            sbx = await AsyncSandbox.create(url=url, api_key=key, timeout=600)
            made.append(sbx)
            ex = await sbx.run_code("1+1", timeout=300)
            assert ex.text == "2", ex

    results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await close_all(made)
        raise failed[0]
    return made


async def close_all(sandboxes: list[AsyncSandbox]) -> None:
    gate = asyncio.Semaphore(8)

    async def one(sbx: AsyncSandbox) -> None:
        async with gate:
            with contextlib.suppress(Exception):
                await sbx.close()

    await asyncio.gather(*(one(s) for s in sandboxes))


async def measure(svc: Any, sandboxes: list[AsyncSandbox], idle: float, res: dict[str, Any]) -> None:
    """Idle CPU and memory of every sandbox's QEMU, then every sandbox answers again."""
    pids = [qemu_pid(d) for d in domains_of(svc)]
    await asyncio.sleep(5)  # the last creates' work settles
    cpu0 = {p: cpu_seconds(p) for p in pids}
    w0 = time.perf_counter()
    await asyncio.sleep(idle)
    wall = time.perf_counter() - w0
    idle_cpu = sum(cpu_seconds(p) - cpu0[p] for p in pids) / wall * 100
    pss = summary([smaps_mib(p) for p in pids])
    res.update(
        domains=len(pids),
        pss_mib=pss,
        pss_breakdown_one=pss_breakdown(pids[len(pids) // 2]),
        idle_cpu_percent_of_one_core_all=round(idle_cpu, 1),
        idle_cpu_percent_per_sandbox=round(idle_cpu / len(pids), 3),
        mem_available_mib_with_all=round(mem_available_mib()),
    )
    print(f"  PSS per QEMU: median {pss['median']:.1f} MiB, p95 {pss['p95']:.1f} ({len(pids)} domains)")
    print(f"  one clone's PSS by kind: {res['pss_breakdown_one']}")
    each = idle_cpu / len(pids)
    print(f"  idle CPU of all of them: {idle_cpu:.1f}% of one core ({each:.3f}% each) over {wall:.0f} s")
    print(f"  MemAvailable with all running: {res['mem_available_mib_with_all']} MiB")
    t1 = time.perf_counter()
    gate = asyncio.Semaphore(16)  # under the API key's max_requests_per_key

    async def answer(sbx: AsyncSandbox) -> str | None:
        async with gate:
            return (await sbx.run_code("1+1", timeout=300)).text

    again = await asyncio.gather(*(answer(s) for s in sandboxes))
    assert all(text == "2" for text in again), again
    res["all_answer_again_seconds"] = round(time.perf_counter() - t1, 1)
    print(f"  all {len(sandboxes)} answered 1+1 again in {res['all_answer_again_seconds']} s")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandboxes", type=int, default=200)
    parser.add_argument("--idle", type=float, default=30.0)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    a = parser.parse_args()
    res: dict[str, Any] = {"machine": machine_facts(), "sandboxes": a.sandboxes, "idle_seconds": a.idle}
    env = {
        "KERNELHOST_POOL_SIZE": "4",
        "KERNELHOST_MAX_SANDBOXES_PER_KEY": str(a.sandboxes + 10),
        "KERNELHOST_MAX_MEMORY_MIB_PER_KEY": str((a.sandboxes + 10) * 1024),
        "KERNELHOST_DEFAULT_IDLE_TIMEOUT": "3600",
    }
    res["mem_available_mib_before"] = round(mem_available_mib())
    with tempfile.TemporaryDirectory(prefix="kh-bench-density-") as tmp:
        async with service(Path(tmp), "density", **env) as svc:
            t0 = time.perf_counter()
            sandboxes = await create_all(svc.url, svc.api_key, a.sandboxes, a.parallel)
            try:
                res["create_all_seconds"] = took = round(time.perf_counter() - t0, 1)
                print(f"  {a.sandboxes} sandboxes created, each answered 1+1, in {took} s")
                print(f"  MemAvailable before: {res['mem_available_mib_before']} MiB")
                await measure(svc, sandboxes, a.idle, res)
            finally:
                await close_all(sandboxes)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "density.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out / 'density.json'}")


if __name__ == "__main__":
    run_main(main)
