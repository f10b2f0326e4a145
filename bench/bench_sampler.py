#!/usr/bin/env python3
"""What the usage sampler (sandboxes/sampler.py) costs the host per VM per sample; writes
bench/results/sampler.json.

    .venv/bin/python bench/bench_sampler.py [--sandboxes 2] [--seconds 30] [--interval 1]

Two services in turn, each with ``--sandboxes`` idle python sandboxes: one sampling every
``--interval`` seconds, one not (``sandbox_metrics_interval = 0``). Over ``--seconds`` the
service process's CPU time (utime + stime) is read; the difference, over the passes the first
one made times its sandboxes, is the host CPU per VM per sample; the same difference of the
sandboxes' QEMUs' CPU time is what the guests spend on it (noisy: an idle guest's own CPU use
varies by more than that under TCG). The wall time of a pass (one
libvirt call for all VMs, one /proc/meminfo read per guest, concurrently) is from the
service's own histogram, ``kernelhost_sampler_pass_seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, domains_of, machine_facts, now_utc, run_main, service

from hypervisor.stats import proc_stats
from kernelhost import AsyncSandbox

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def histogram(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = [re.search(rf"^kernelhost_sampler_pass_seconds_{k} (\S+)$", text, re.M) for k in ("sum", "count")]
    return (float(found[0].group(1)), float(found[1].group(1))) if found[0] and found[1] else (0.0, 0.0)


async def measure(tmp: Path, name: str, interval: float, n: int, seconds: float) -> dict[str, Any]:
    async with service(
        tmp, name, KERNELHOST_POOL_SIZE="0", KERNELHOST_SANDBOX_METRICS_INTERVAL=str(interval)
    ) as svc:
        sandboxes = [await AsyncSandbox.create(url=svc.url, api_key=svc.api_key) for _ in range(n)]
        try:
            await asyncio.sleep(3)  # the first samples (and each ring) made
            assert svc.proc is not None
            pid = svc.proc.pid
            domains = domains_of(svc)
            s0, c0, cpu0, t0 = *histogram(svc.url), cpu_seconds(pid), time.monotonic()
            vm0 = guests_cpu(domains)
            await asyncio.sleep(seconds)
            s1, c1, cpu1, t1 = *histogram(svc.url), cpu_seconds(pid), time.monotonic()
            vm1 = guests_cpu(domains)
        finally:
            for sbx in sandboxes:
                await sbx.close()
    return {
        "cpu_s": cpu1 - cpu0,
        "vms_cpu_s": vm1 - vm0,
        "wall_s": t1 - t0,
        "passes": c1 - c0,
        "pass_s": (s1 - s0) / max(1, c1 - c0),
    }


def guests_cpu(domains: list[str]) -> float:
    """CPU seconds the domains' QEMUs used so far (all of them running)."""
    found = [proc_stats(d) for d in domains]
    return sum(st.cpu_ns for st in found if st is not None) / 1e9


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--interval", type=float, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        on = await measure(Path(tmp), "sampler-on", args.interval, args.sandboxes, args.seconds)
        off = await measure(Path(tmp), "sampler-off", 0, args.sandboxes, args.seconds)
    samples = on["passes"] * args.sandboxes
    per_sample_ms = (
        max(0.0, on["cpu_s"] - off["cpu_s"] * on["wall_s"] / off["wall_s"]) / max(1, samples) * 1000
    )
    out = {
        "when": now_utc(),
        "machine": machine_facts(),
        "sandboxes": args.sandboxes,
        "interval_s": args.interval,
        "on": on,
        "off": off,
        "host_cpu_ms_per_vm_per_sample": round(per_sample_ms, 3),
        "pass_wall_ms": round(on["pass_s"] * 1000, 2),
        # what the guests spend on it (the agent's read of /proc/meminfo), against idle guests
        "guest_cpu_ms_per_vm_per_sample": round(
            (on["vms_cpu_s"] - off["vms_cpu_s"] * on["wall_s"] / off["wall_s"]) / max(1, samples) * 1000, 3
        ),
    }
    print(json.dumps(out, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sampler.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
