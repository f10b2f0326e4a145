#!/usr/bin/env python3
"""Checkpoints of a sandbox holding 100 MB of new state, in one run; writes
bench/results/checkpoints.json.

    .venv/bin/python bench/bench_checkpoints.py [--rounds 5] [--calls 20]

One service (pool of 2). For ``--rounds`` rounds, on one sandbox that holds ``--state-mb`` MB of
fresh random bytes (incompressible: the honest case for stored bytes): the checkpoint call, a
``1+1`` sent while it runs (how long the sandbox stops answering), the bytes stored against the
state added, and a restore to a ready kernel (the restore call, then the first ``1+1``).
References in the same run: fork(1) of the same sandbox to the child answering, and a cold boot
(a create on a second service with snapshots off). Then the cost of ``auto_checkpoint`` on a
``1+1`` call: ``--calls`` calls in a sandbox without it and in one with it, one second apart
(an agent's think time: the checkpoint is saved meanwhile) and back to back (each call waits
for the previous call's checkpoint to be frozen).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine_facts, now_utc, report, run_main, service, summary, wait_pool

from kernelhost import AsyncSandbox


async def one_plus_one(sbx: AsyncSandbox) -> float:
    t0 = time.perf_counter()
    assert (await sbx.run_code("1+1")).text == "2"
    return time.perf_counter() - t0


async def checkpoint_rounds(svc: Any, rounds: int, state_mb: int, out: dict[str, Any]) -> None:
    took, paused, restored, first, forks = [], [], [], [], []
    stored: list[int] = []
    sbx = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
    try:
        base = (await sbx.checkpoint("empty")).bytes
        await sbx.run_code(f"import os\nstate = os.urandom({state_mb} << 20)")
        for _ in range(rounds):
            t0 = time.perf_counter()
            task = asyncio.create_task(sbx.checkpoint())
            await asyncio.sleep(0.05)  # the freeze has begun
            paused.append(await one_plus_one(sbx))
            cp = await task
            took.append(time.perf_counter() - t0)
            stored.append(cp.bytes)
            t1 = time.perf_counter()
            await sbx.restore(cp)
            restored.append(time.perf_counter() - t1)
            first.append(await one_plus_one(sbx) + restored[-1])
            t2 = time.perf_counter()
            (child,) = await sbx.fork(1)
            assert (await child.run_code("len(state)")).text == str(state_mb << 20)
            forks.append(time.perf_counter() - t2)
            await child.close()
            await sbx.delete_checkpoint(cp)
    finally:
        await sbx.close()
    added = state_mb << 20
    report(out, "checkpoint", summary(took), f"checkpoint, {state_mb} MB of new state")
    report(out, "1+1 during a checkpoint", summary(paused), "1+1 sent while it is taken")
    report(out, "restore", summary(restored), "restore (the call)")
    report(out, "restore to first 1+1", summary(first), "restore to the first 1+1 answered")
    report(out, "fork(1) to child answering", summary(forks), "reference: fork(1) to the child answering")
    report(out, "stored bytes", int(sorted(stored)[len(stored) // 2]), "stored bytes (median)")
    report(out, "empty sandbox checkpoint bytes", base, "checkpoint of a fresh sandbox, bytes")
    report(
        out,
        "stored / state added",
        round(sorted(stored)[len(stored) // 2] / added, 3),
        "stored / state added",
    )


async def auto_rounds(svc: Any, calls: int, out: dict[str, Any]) -> None:
    """Each mode in a block of its own: a background checkpoint of one sandbox must not land
    in the other's figures."""
    plain = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
    auto = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key, auto_checkpoint=True)
    samples: dict[str, list[float]] = {}
    try:
        for sbx in (plain, auto):
            await one_plus_one(sbx)
        for gap in (1.0, 0.0):
            for name, sbx in (("off", plain), ("on", auto)):
                await asyncio.sleep(3)  # the last background checkpoint is saved
                times = samples.setdefault(f"{name}, {'1 s apart' if gap else 'back to back'}", [])
                for _ in range(calls):
                    times.append(await one_plus_one(sbx))
                    await asyncio.sleep(gap)
    finally:
        await plain.close()
        await auto.close()
    for name, times in samples.items():
        report(out, f"1+1 auto_checkpoint {name}", summary(times), f"1+1, auto_checkpoint {name}")
    for spacing in ("1 s apart", "back to back"):
        on, off = (out[f"1+1 auto_checkpoint {m}, {spacing}"]["median"] for m in ("on", "off"))
        added = round((on - off) * 1000, 1)
        report(out, f"auto_checkpoint added ms ({spacing})", added, f"added per 1+1 ({spacing}), ms")


async def cold_boot(tmp: Path, out: dict[str, Any]) -> None:
    async with service(tmp, "checkpoints-cold", KERNELHOST_SNAPSHOTS="off", KERNELHOST_POOL_SIZE="0") as svc:
        t0 = time.perf_counter()
        sbx = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
        try:
            await one_plus_one(sbx)
            report(out, "cold boot to first 1+1", summary([time.perf_counter() - t0]), "reference: cold boot")
        finally:
            await sbx.close()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--state-mb", type=int, default=100)
    args = ap.parse_args()
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts(), "state_mb": args.state_mb}
    with tempfile.TemporaryDirectory(prefix="kh-bench-checkpoints-") as tmp:
        async with service(Path(tmp), "checkpoints", KERNELHOST_POOL_SIZE="2") as svc:
            await wait_pool(svc, 2)
            await checkpoint_rounds(svc, args.rounds, args.state_mb, out)
            await auto_rounds(svc, args.calls, out)
        await cold_boot(Path(tmp), out)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpoints.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
