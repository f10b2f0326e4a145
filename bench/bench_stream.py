#!/usr/bin/env python3
"""Streaming and recovery benchmarks: prints medians and ratios, writes bench/results/stream.json.

    .venv/bin/python bench/bench_stream.py [--mib 32] [--rounds 3]

Figures, each the median of ``--rounds`` runs, measured in this one run:
- stdout throughput (MB/s) of a cell writing ``--mib`` MiB as fast as it can, through the service
  (guest kernel -> agent -> virtio-serial -> service -> HTTP NDJSON -> SDK), against the same cell
  on a local ipykernel driven by jupyter_client (the floor), and a bash command through the service
  against the same command run locally;
- time from the timeout to a usable sandbox, for each rung of the ladder: from the moment the
  timeout expires until a following ``6 * 7`` call has answered (interrupt; kernel restart, with a
  kernel that ignores SIGINT; a fresh VM, with a guest agent that is frozen; bash SIGINT; bash
  kill, with a command that ignores SIGINT).

The service runs with its default ladder settings (interrupt_grace 5 s, agent_timeout 10 s) and
``max_output_bytes`` raised so the whole stream is delivered.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, LocalKernel, Service, bash_code, print_code, run_main, service

from kernelhost import AsyncSandbox

TIMEOUT = 2.0  # seconds given to each runaway call of the ladder figures


LADDER = {
    "interrupted (python)": ("python", "while True:\n    pass"),
    "kernel_restarted (python ignores SIGINT)": (
        "python",
        "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
    ),
    "vm_replaced (agent frozen)": (
        "python",
        "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nwhile True:\n    pass",
    ),
    "interrupted (bash)": ("bash", "sleep 1000"),
    "killed (bash ignores SIGINT)": ("bash", "trap '' INT; while :; do :; done"),
}
EXPECTED_RUNG = {
    "interrupted (python)": "interrupted",
    "kernel_restarted (python ignores SIGINT)": "kernel_restarted",
    "vm_replaced (agent frozen)": "vm_replaced",
    "interrupted (bash)": "interrupted",
    "killed (bash ignores SIGINT)": "killed",
}


async def service_throughput(sbx: AsyncSandbox, language: str, code: str, rounds: int) -> list[float]:
    rates = []
    for _ in range(rounds + 1):  # the first run warms up
        t0 = time.perf_counter()
        execution = await sbx.run_code(code, language=language, timeout=600)
        took = time.perf_counter() - t0
        assert execution.status == "ok" and not execution.output_truncated, execution.status
        rates.append(len(execution.stdout) / took / 1e6)
    return rates[1:]


async def local_throughput(code: str, rounds: int) -> list[float]:
    k = await LocalKernel.start()
    try:
        rates = []
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            answer = await k.execute(code)
            took = time.perf_counter() - t0
            assert answer.status == "ok"
            rates.append(answer.stdout_chars / took / 1e6)
        return rates[1:]
    finally:
        await k.close()


def local_bash_throughput(code: str, rounds: int) -> list[float]:
    rates = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        out = subprocess.run(["bash", "-c", code], capture_output=True, check=True).stdout
        rates.append(len(out) / (time.perf_counter() - t0) / 1e6)
    return rates[1:]


async def ladder(svc: Service, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as sbx:
        for label, (language, code) in LADDER.items():
            samples = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                execution = await sbx.run_code(code, language=language, timeout=TIMEOUT)
                assert execution.status == "timeout", (label, execution)
                assert execution.recovery == EXPECTED_RUNG[label], (
                    label,
                    execution.recovery,
                    execution.error,
                )
                after = await sbx.run_code("6 * 7", timeout=120)
                assert after.text == "42", after
                samples.append(time.perf_counter() - t0 - TIMEOUT)
            out[label] = samples
    return out


def med(samples: list[float]) -> float:
    return statistics.median(samples)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=32, help="MiB printed per throughput run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kh-bench-stream-") as tmp:
        async with service(
            Path(tmp),
            "stream",
            KERNELHOST_MAX_OUTPUT_BYTES=str((args.mib + 8) << 20),
            KERNELHOST_POOL_SIZE="1",
        ) as svc:
            async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as sbx:
                ours = await service_throughput(sbx, "python", print_code(args.mib), args.rounds)
                ours_bash = await service_throughput(sbx, "bash", bash_code(args.mib), args.rounds)
                accel = (await sbx.info()).accel
            rungs = await ladder(svc, args.rounds)
    local = await local_throughput(print_code(args.mib), args.rounds)
    local_bash = local_bash_throughput(bash_code(args.mib), args.rounds)

    print(
        f"acceleration: {accel}   host: {platform.node()} {platform.machine()}   "
        f"{args.mib} MiB per run, median of {args.rounds}"
    )
    print(f"{'stdout throughput':44} {'MB/s':>9}")
    for label, samples in [
        ("python print, kernelhost", ours),
        ("python print, local ipykernel", local),
        ("bash, kernelhost", ours_bash),
        ("bash, local subprocess", local_bash),
    ]:
        print(f"{label:44} {med(samples):9.1f}")
    print(f"ratio kernelhost / local ipykernel (python): {med(ours) / med(local):.2f}x")
    print(f"ratio kernelhost / local bash: {med(ours_bash) / med(local_bash):.3f}x")
    print(f"\n{'timeout -> usable sandbox, per rung':44} {'median s':>9} {'max s':>7}")
    for label, samples in rungs.items():
        print(f"{label:44} {med(samples):9.2f} {max(samples):7.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "stream.json").write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "accel": accel,
                "mib": args.mib,
                "rounds": args.rounds,
                "throughput_mb_s": {
                    "service_python": ours,
                    "local_python": local,
                    "service_bash": ours_bash,
                    "local_bash": local_bash,
                },
                "timeout_to_usable_s": rungs,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    run_main(main)
