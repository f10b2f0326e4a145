#!/usr/bin/env python3
"""Where a user waits: output throughput, fork, kernel restart and the first call of a pooled
sandbox, each with its reference measured in the same run. Writes bench/results/speed.json.

    .venv/bin/python bench/bench_speed.py [--quick] [--throughput] [--mib 32] [--rounds 5]
        [--only stream,fork]

Figures (median and p95 over ``--rounds``; the first run of each throughput figure warms up):
- stdout MB/s of bash ``head -c | tr`` and of a Python cell printing 1 KiB lines, through the
  service (guest -> agent -> virtio-serial -> service -> HTTP NDJSON -> SDK); references: the
  same bash pipeline inside the guest to /dev/null (what the guest can make), a file of the same
  size read through the files API (the channel with no Jupyter in the way), the bash pipeline as
  a local subprocess and the Python cell on a local ipykernel (jupyter_client);
- stdout MB/s of bash ``cat`` of that file (in the guest's RAM-backed root), a producer that is
  not the bottleneck (``tr`` is, in the guest); reference: the same ``cat`` to /dev/null;
- fork(1) of a parent holding 100 MB of fresh state, to the child answering ``1+1``; fork(5) to
  all five answering; against a pool-hit create of the same template; fork(1) in parts (the
  call, the child's first and second ``1+1``) and the parent's pause per fork;
- kernel restart (``restart()``) to the next ``1+1`` answered, with the standby kernel ready;
- a bash call right after another and after a pause, against Python ``1+1``;
- pool hit: the first ``1+1`` of a sandbox just handed out of the warm pool, against its second.

Columns: TCG always; KVM too when the acceleration probe finds KVM usable on this host (else the
probe's reason is printed). ``--only`` runs some parts (stream, bash, pool, fork, restart);
``--throughput``: the output figures alone, TCG only. Everything started here is stopped on exit,
on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    LocalKernel,
    Service,
    bash_code,
    healthz,
    machine_facts,
    print_code,
    run_main,
    service,
    wait_pool,
)
from common import summary as stats

from kernelhost import AsyncSandbox

PARTS = ("stream", "bash", "pool", "fork", "restart")
POOL_SIZE = 2
BENCH_FILE = "/tmp/kh-bench-file"
STATE_CELL = "import os\n_kh_bench_state = os.urandom(100 * 1000 * 1000)\nlen(_kh_bench_state)"


THROUGHPUT_FIGURES = (
    "bash_service",
    "bash_in_guest",
    "bash_cat_service",
    "bash_cat_in_guest",
    "python_service",
    "channel_files_read",
)


def fig(samples: list[float], unit: str) -> dict[str, Any]:
    return {**stats(samples), "unit": unit}


def show(label: str, figure: dict[str, Any], ref: dict[str, Any] | None = None) -> None:
    unit = figure["unit"]
    line = f"  {label:<46} median {figure['median']:9.3f} {unit:<5} p95 {figure['p95']:9.3f}"
    if ref is not None and ref["median"]:
        line += f"   x{figure['median'] / ref['median']:.2f} of reference"
    print(line, flush=True)


async def timed(coro: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = await coro
    return time.perf_counter() - t0, result


async def throughput(sbx: AsyncSandbox, mib: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, language, code in (("bash", "bash", bash_code(mib)), ("python", "python", print_code(mib))):
        rates = []
        for i in range(rounds + 1):
            took, ex = await timed(sbx.run_code(code, language=language, timeout=600))
            assert ex.status == "ok" and not ex.output_truncated and len(ex.stdout) == mib << 20, ex.status
            if i:
                rates.append(len(ex.stdout) / took / 1e6)
        out[f"{name}_service"] = fig(rates, "MB/s")
    inside = []
    for _ in range(rounds):
        cmd = f"s=$(date +%s%N); {bash_code(mib)} > /dev/null; e=$(date +%s%N); echo $((e - s))"
        ex = await sbx.run_code(cmd, language="bash", timeout=600)
        inside.append((mib << 20) / (int(ex.stdout.strip()) / 1e9) / 1e6)
    out["bash_in_guest"] = fig(inside, "MB/s")
    await sbx.run_code(f"{bash_code(mib)} > {BENCH_FILE}", language="bash", timeout=600)
    reads = []
    for _ in range(rounds):
        took, data = await timed(sbx.files.read(BENCH_FILE, timeout=600))
        reads.append(len(data) / took / 1e6)
    out["channel_files_read"] = fig(reads, "MB/s")
    out.update(await file_throughput(sbx, mib, rounds))
    return out


async def file_throughput(sbx: AsyncSandbox, mib: int, rounds: int) -> dict[str, Any]:
    """``cat`` of a file in the guest's RAM: through the service, and to /dev/null in the guest."""
    rates = []
    for i in range(rounds + 1):
        took, ex = await timed(sbx.run_code(f"cat {BENCH_FILE}", language="bash", timeout=600))
        assert ex.status == "ok" and not ex.output_truncated and len(ex.stdout) == mib << 20, ex.status
        if i:
            rates.append(len(ex.stdout) / took / 1e6)
    inside = []
    for _ in range(rounds):
        cmd = f"s=$(date +%s%N); cat {BENCH_FILE} > /dev/null; e=$(date +%s%N); echo $((e - s))"
        ex = await sbx.run_code(cmd, language="bash", timeout=600)
        inside.append((mib << 20) / (int(ex.stdout.strip()) / 1e9) / 1e6)
    return {"bash_cat_service": fig(rates, "MB/s"), "bash_cat_in_guest": fig(inside, "MB/s")}


async def local_references(mib: int, rounds: int) -> dict[str, Any]:
    rates = []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        data = await asyncio.to_thread(_local_bash, mib)
        if i:
            rates.append(len(data) / (time.perf_counter() - t0) / 1e6)
    k = await LocalKernel.start()
    try:
        kernel = []
        for i in range(rounds + 1):
            took, answer = await timed(k.execute(print_code(mib)))
            if i:
                kernel.append(answer.stdout_chars / took / 1e6)
    finally:
        await k.close()
    return {"bash_local_subprocess": fig(rates, "MB/s"), "python_local_ipykernel": fig(kernel, "MB/s")}


def _local_bash(mib: int) -> bytes:
    return subprocess.run(["bash", "-c", bash_code(mib)], capture_output=True, check=True).stdout


async def answered(sbx: AsyncSandbox) -> None:
    ex = await sbx.run_code("1+1", timeout=120)
    assert ex.text == "2", ex


def spare_after_last_fork(svc: Service) -> bool:
    """The last fork's refill is done: a spare made (``vm.fork_spare_ready``) after the last
    fork's copy (a fork takes a spare, or waits for the one being made, before it copies)."""
    ready = svc.log_events("vm.fork_spare_ready")
    copied = svc.log_events("vm.fork_copied")
    return bool(ready) and (not copied or ready[-1]["timestamp"] > copied[-1]["timestamp"])


async def settled(svc: Service, timeout: float = 60) -> None:
    """No background work beside the next fork: the pool full again and the last fork's spare
    RAM copy and its QEMUs made, as a user forking seconds apart finds them."""
    await wait_pool(svc, POOL_SIZE)
    deadline = time.monotonic() + timeout
    while not spare_after_last_fork(svc):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no fork spare made within {timeout}s")
        await asyncio.sleep(0.1)


async def forks(svc: Service, rounds: int) -> dict[str, Any]:
    """fork(1) and fork(5) to every child answering, each from a settled service (``settled``);
    fork(5) also right after a fork(1)'s child answered (its spare not made yet); fork(1) in
    parts: the fork call, the child's first ``1+1`` and its second (a QEMU that has run the code
    before: under TCG a new process translates every guest instruction it runs the first time).
    The parent's pause per fork comes from the service's log (``vm.fork_copied``)."""
    keys = (
        "fork1",
        "fork5",
        "fork5_right_after_fork1",
        "fork1_call",
        "fork1_first_1plus1",
        "fork1_second_1plus1",
        "pool_hit_create",
    )
    out: dict[str, list[float]] = {k: [] for k in keys}

    async def fork(parent: AsyncSandbox, n: int, key: str) -> list[AsyncSandbox]:
        t0 = time.perf_counter()
        kids = await parent.fork(n)
        t1 = time.perf_counter()
        await asyncio.gather(*(answered(k) for k in kids))
        out[key].append(time.perf_counter() - t0)
        if key == "fork1":
            out["fork1_call"].append(t1 - t0)
            out["fork1_first_1plus1"].append(time.perf_counter() - t1)
            took, _ = await timed(answered(kids[0]))
            out["fork1_second_1plus1"].append(took)
        return kids

    async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as parent:
        ex = await parent.run_code(STATE_CELL, timeout=600)
        assert ex.text == "100000000", ex
        for kid in await parent.fork(1):  # the first fork from the template makes its spare
            await kid.close()
        for _ in range(rounds):
            for n, key in ((1, "fork1"), (5, "fork5")):
                await settled(svc)
                for kid in await fork(parent, n, key):
                    await kid.close()
                if n == 1:  # this fork(5) comes before the fork(1)'s spare is made
                    for kid in await fork(parent, 5, "fork5_right_after_fork1"):
                        await kid.close()
            await wait_pool(svc, POOL_SIZE)
            t0 = time.perf_counter()
            async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as other:
                await answered(other)
                out["pool_hit_create"].append(time.perf_counter() - t0)
    figures = {k: fig(v, "s") for k, v in out.items()}
    copies = [e for e in svc.log_events("vm.fork_copied") if "paused_pages" in e]
    paused = [e["paused_pages"] + e["paused_devices"] for e in copies]
    if paused:
        figures["fork_parent_paused"] = fig(paused, "s")
    return figures


async def restarts(svc: Service, rounds: int) -> dict[str, Any]:
    took, first = [], []
    async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as sbx:
        await answered(sbx)
        for _ in range(rounds):
            await sbx.run_code("kept = 1")
            t0 = time.perf_counter()
            await sbx.restart()
            ex = await sbx.run_code("'kept' in globals()", timeout=120)
            took.append(time.perf_counter() - t0)
            assert ex.text == "False", ex
            t1 = time.perf_counter()
            await answered(sbx)
            first.append(time.perf_counter() - t1)
            await asyncio.sleep(25)  # the next standby starts behind the swap (seconds under TCG)
    return {"restart_to_answer": fig(took, "s"), "one_plus_one_after": fig(first, "s")}


async def bash_calls(svc: Service, rounds: int) -> dict[str, Any]:
    """A bash call (``echo``) right after another, and after a 0.5 s pause (its bash started
    ahead meanwhile); reference: Python ``1+1`` in the same sandbox."""
    out: dict[str, list[float]] = {"bash_back_to_back": [], "bash_after_pause": [], "python_1plus1": []}
    async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as sbx:
        await sbx.run_code("echo warm", language="bash", timeout=60)
        await wait_pool(svc, POOL_SIZE)  # settled: the refill of this hand-out is done
        for _ in range(rounds * 2):
            for key, pause, code, language in (
                ("bash_back_to_back", 0.0, "echo hi", "bash"),
                ("bash_after_pause", 0.5, "echo hi", "bash"),
                ("python_1plus1", 0.5, "1+1", "python"),
            ):
                await asyncio.sleep(pause)
                took, ex = await timed(sbx.run_code(code, language=language, timeout=60))
                assert ex.status == "ok", ex
                out[key].append(took)
    return {k: fig(v, "s") for k, v in out.items()}


async def pool_hits(svc: Service, rounds: int) -> dict[str, Any]:
    """Each round from a settled service: the pool full again (POOL_SIZE), so no refill of an
    earlier round's hand-out runs beside the calls measured (the hand-out's own refill starts
    pool.REFILL_DELAY later, after these calls)."""
    first, second = [], []
    for _ in range(rounds):
        await wait_pool(svc, POOL_SIZE)
        async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as sbx:
            await sbx.info()
            t, _ = await timed(answered(sbx))
            first.append(t)
            t, _ = await timed(answered(sbx))
            second.append(t)
    return {"first_1plus1": fig(first, "s"), "second_1plus1": fig(second, "s")}


async def column(tmp: Path, accel: str, r: argparse.Namespace) -> dict[str, Any]:
    # the output figures alone: no pool refilling beside them (a booting VM takes a core)
    pool = "0" if r.only == {"stream"} else str(POOL_SIZE)
    env = {"KERNELHOST_ACCEL": accel, "KERNELHOST_POOL_SIZE": pool}
    async with service(
        tmp, f"speed-{accel}", KERNELHOST_MAX_OUTPUT_BYTES=str((r.mib + 8) << 20), **env
    ) as svc:
        h = await healthz(svc)
        out: dict[str, Any] = {"accel": h.get("accel"), "accel_reason": h.get("accel_reason")}
        print(f"[{accel}] acceleration: {out['accel']} ({out['accel_reason']})", flush=True)
        if "stream" in r.only:
            async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as sbx:
                out.update(await throughput(sbx, r.mib, r.rounds))
            for name in THROUGHPUT_FIGURES:
                show(f"[{accel}] {name}", out[name])
        if "bash" in r.only:
            out.update(await bash_calls(svc, r.rounds))
            show(f"[{accel}] bash echo right after another", out["bash_back_to_back"], out["python_1plus1"])
            show(f"[{accel}] bash echo after a 0.5 s pause", out["bash_after_pause"], out["python_1plus1"])
            show(f"[{accel}] python 1+1 (reference)", out["python_1plus1"])
        if "pool" in r.only:
            out.update(await pool_hits(svc, max(r.rounds, 5)))
            show(f"[{accel}] pool hit: first 1+1", out["first_1plus1"], out["second_1plus1"])
            show(f"[{accel}] pool hit: second 1+1", out["second_1plus1"])
        if "fork" in r.only:
            out.update(await forks(svc, r.rounds))
            for name in ("fork1", "fork5", "fork5_right_after_fork1", "pool_hit_create"):
                show(f"[{accel}] {name} (100 MB parent) to answering", out[name])
            show(f"[{accel}] fork1: the fork call", out["fork1_call"])
            show(f"[{accel}] fork1: child's first 1+1", out["fork1_first_1plus1"], out["fork1_second_1plus1"])
            show(f"[{accel}] fork1: child's second 1+1", out["fork1_second_1plus1"])
            if "fork_parent_paused" in out:
                show(f"[{accel}] fork: the parent paused", out["fork_parent_paused"])
        if "restart" in r.only:
            out.update(await restarts(svc, min(r.rounds, 3)))
            show(
                f"[{accel}] kernel restart to an answer", out["restart_to_answer"], out["one_plus_one_after"]
            )
        return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds and a smaller stream")
    parser.add_argument(
        "--throughput", action="store_true", help="the output figures alone, TCG only (--only stream)"
    )
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated parts to run, of {','.join(PARTS)}"
    )
    r = parser.parse_args()
    r.only = {"stream"} if r.throughput else set(r.only.split(","))
    if not r.only <= set(PARTS):
        parser.error(f"--only {','.join(sorted(r.only))}: choose from {','.join(PARTS)}")
    if r.quick:
        r.mib, r.rounds = 16, 3
    res: dict[str, Any] = {"machine": machine_facts(), "mib": r.mib, "rounds": r.rounds, "columns": {}}
    with tempfile.TemporaryDirectory(prefix="kh-bench-speed-") as tmp:
        res["local"] = await local_references(r.mib, r.rounds) if "stream" in r.only else {}
        for name, figure in res["local"].items():
            show(f"[host] {name}", figure)
        res["columns"]["tcg"] = await column(Path(tmp), "tcg", r)
        if r.throughput:
            _write(res, r.out, "speed-throughput.json")
            return
        probe = await column_probe(Path(tmp))
        res["kvm_probe"] = probe
        if probe["accel"] == "kvm":
            res["columns"]["kvm"] = await column(Path(tmp), "kvm", r)
        else:
            print(f"KVM column: not measured, the acceleration probe says: {probe['accel_reason']}")
    _write(res, r.out, "speed.json")


def _write(res: dict[str, Any], out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(res, indent=1))
    print(f"wrote {out / name}")


async def column_probe(tmp: Path) -> dict[str, Any]:
    """The acceleration probe's verdict on this host (a service with accel=auto)."""
    async with service(tmp, "speed-probe", KERNELHOST_POOL_SIZE="0") as svc:
        h = await healthz(svc)
        return {"accel": h.get("accel"), "accel_reason": h.get("accel_reason")}


if __name__ == "__main__":
    run_main(main)
