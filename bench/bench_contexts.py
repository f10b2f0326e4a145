#!/usr/bin/env python3
"""Code contexts through E2B's SDK: what a context costs; writes bench/results/contexts.json.

    .venv/bin/python bench/bench_contexts.py [--contexts 3] [--calls 20]

One service, one sandbox of E2B's default template (``python-datasci``). Starting ``--contexts``
code contexts (a kernel each in the VM), one after the other; then ``--calls`` ``1+1`` in the
main kernel and in a context, alternating so the machine's noise falls on both; the VM's memory
(QEMU's PSS) before the contexts and with them. Medians, and the context/main ratio of a call
(the reference run is the main kernel's, in the same process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    domains_of,
    machine_facts,
    now_utc,
    qemu_pss_mib,
    report,
    run_main,
    service,
    summary,
)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts()}
    with tempfile.TemporaryDirectory(prefix="kh-bench-contexts-") as tmp:
        async with service(Path(tmp), "contexts", KERNELHOST_POOL_SIZE="1") as svc:
            await asyncio.to_thread(svc.wait_pool, "python-datasci")
            os.environ.update(
                E2B_API_URL=f"{svc.url}/e2b",
                E2B_SANDBOX_URL=f"{svc.url}/e2b/sandbox",
                E2B_API_KEY=svc.api_key,
            )
            from e2b_code_interpreter import AsyncSandbox

            sbx = await AsyncSandbox.create()
            try:
                await sbx.run_code("1+1")
                before = sum(qemu_pss_mib(d) for d in domains_of(svc))
                starts: list[float] = []
                made: list[Any] = []
                for _ in range(args.contexts):
                    t0 = time.perf_counter()
                    made.append(await sbx.create_code_context())
                    starts.append(time.perf_counter() - t0)
                after = sum(qemu_pss_mib(d) for d in domains_of(svc))
                main_calls: list[float] = []
                ctx_calls: list[float] = []
                for _ in range(args.calls):
                    for where, times in ((None, main_calls), (made[0], ctx_calls)):
                        t0 = time.perf_counter()
                        assert (await sbx.run_code("1+1", context=where)).text == "2"
                        times.append(time.perf_counter() - t0)
            finally:
                await sbx.kill()
    print(f"{args.contexts} contexts started in one sandbox, {args.calls} calls each:")
    report(out, "context start", summary(starts), "create_code_context (a kernel started in the VM)")
    report(out, "main 1+1", summary(main_calls), "run_code('1+1') on the main kernel")
    report(out, "context 1+1", summary(ctx_calls), "run_code('1+1') in a context")
    ratio = out["context 1+1"]["median"] / out["main 1+1"]["median"]
    report(out, "context/main 1+1", round(ratio, 2), "context / main kernel, 1+1 (ratio of medians)")
    per = (after - before) / max(1, args.contexts)
    report(out, "MiB per context", round(per, 1), "the service's VMs' PSS grown per context (MiB)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "contexts.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
