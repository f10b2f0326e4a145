#!/usr/bin/env python3
"""kernelhost benchmarks: prints medians (and p95) and ratios against a reference measured in the
same process, and writes them to bench/results/latest.json.

    make bench            (or: .venv/bin/python bench/run.py [--boots N] [--rounds N])

Figures:
- boot-to-ready: POST /v1/sandboxes until the sandbox's kernel answers (a cold VM boot here).
- `1+1` round trip: through the service (HTTP -> channel -> guest kernel and back), against the
  same code on a local ipykernel driven by jupyter_client: the floor, reported as a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jupyter_client.manager import AsyncKernelManager  # noqa: E402

from kernelhost import AsyncSandbox  # noqa: E402
from tests.harness import Service  # noqa: E402


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median": statistics.median(ordered), "p95": p95, "min": ordered[0], "n": len(ordered)}


async def local_kernel_roundtrips(rounds: int) -> list[float]:
    km = AsyncKernelManager(kernel_name="python3")
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=60)
        samples = []
        for _ in range(rounds + 3):
            t0 = time.perf_counter()
            reply = await kc.execute_interactive("1+1", timeout=30, output_hook=lambda m: None)
            samples.append(time.perf_counter() - t0)
            assert reply["content"]["status"] == "ok"
        return samples[3:]
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)


async def service_bench(svc: Service, boots: int, rounds: int) -> dict[str, object]:
    boot_samples = []
    for _ in range(boots):
        t0 = time.perf_counter()
        sbx = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
        boot_samples.append(time.perf_counter() - t0)
        if len(boot_samples) < boots:
            await sbx.close()
    rt = []
    try:
        for _ in range(rounds + 3):
            t0 = time.perf_counter()
            execution = await sbx.run_code("1+1")
            rt.append(time.perf_counter() - t0)
            assert execution.text == "2", execution
        info = await sbx.info()
    finally:
        await sbx.close()
    return {"boot": summary(boot_samples), "roundtrip": summary(rt[3:]), "accel": info.accel}


def fmt_ms(s: float) -> str:
    return f"{s * 1000:8.1f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--boots", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kh-bench-") as tmp:
        svc = Service.make(Path(tmp))
        svc.start()
        try:
            ours = await service_bench(svc, args.boots, args.rounds)
        finally:
            leaked, _ = svc.cleanup()
            if leaked:
                print(f"warning: cleaned up leaked domains {leaked}", file=sys.stderr)
    local = summary(await local_kernel_roundtrips(args.rounds))
    boot, rt = ours["boot"], ours["roundtrip"]
    assert isinstance(boot, dict) and isinstance(rt, dict)
    ratio = rt["median"] / local["median"]
    print(f"acceleration: {ours['accel']}   host: {platform.node()} {platform.machine()}")
    print(f"{'figure':38} {'median':>11} {'p95':>11}  n")
    for label, fig in [("VM boot to ready kernel (create)", boot), ("1+1 round trip, kernelhost", rt),
                       ("1+1 round trip, local ipykernel", local)]:
        print(f"{label:38} {fmt_ms(fig['median'])} {fmt_ms(fig['p95'])}  {fig['n']}")
    print(f"ratio kernelhost / local ipykernel (1+1 median): {ratio:.1f}x")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps({
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "accel": ours["accel"],
        "boot_s": boot, "roundtrip_s": rt, "local_roundtrip_s": local, "ratio": ratio,
    }, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
