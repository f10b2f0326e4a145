#!/usr/bin/env python3
"""The first calls in a new sandbox against the same calls once it is warm; writes
bench/results/first_call.json.

    .venv/bin/python bench/bench_first_call.py [--sandboxes 10]

For each of ``--sandboxes`` sandboxes handed out by the warm pool: the first ``1+1``, then a
second one (the reference, measured in the same sandbox), then the first error (``1/0``: its
traceback is formatted by IPython modules a fresh kernel has not used yet) and a second error.
Medians and p95, and the first/second ratios. The template's warm-up (guest agent,
``op_prepare_snapshot``) exists to keep these ratios near 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine_facts, now_utc, report, run_main, service, summary, wait_pool

from kernelhost import AsyncSandbox


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=10)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"first 1+1": [], "second 1+1": [], "first error": [], "second error": []}
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts()}
    with tempfile.TemporaryDirectory(prefix="kh-bench-first-") as tmp:
        async with service(Path(tmp), "first-call", KERNELHOST_POOL_SIZE="2") as svc:
            for _ in range(args.sandboxes):
                await wait_pool(svc, 2)  # every sandbox is a pool hand-over
                sbx = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
                try:
                    for label, code in (
                        ("first 1+1", "1+1"),
                        ("second 1+1", "1+1"),
                        ("first error", "1/0"),
                        ("second error", "1/0"),
                    ):
                        t0 = time.perf_counter()
                        ex = await sbx.run_code(code, timeout=120)
                        times[label].append(time.perf_counter() - t0)
                        assert (ex.error is None) == (code == "1+1"), ex
                finally:
                    await sbx.close()
    print(f"first calls in {args.sandboxes} new sandboxes (pool hits), median and p95:")
    for label, samples in times.items():
        report(out, label, summary(samples), label)
    for what in ("1+1", "error"):
        ratio = out[f"first {what}"]["median"] / out[f"second {what}"]["median"]
        report(out, f"first/second {what}", round(ratio, 2), f"first/second {what} (ratio)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "first_call.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
