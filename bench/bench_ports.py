#!/usr/bin/env python3
"""A server in a sandbox reached by its host name (docs/ports.md); writes bench/results/ports.json.

    .venv/bin/python bench/bench_ports.py [--requests 50] [--mib 8]

One service (``domain`` set), one sandbox running ``python -m http.server``. Interleaved so the
machine's noise falls on both: a small GET through ``{port}-{id}.{domain}`` (a tunnel into the
guest per request) against the same round trip through the execute API (``run_code("1")``, the
reference in the same process); then the throughput of one large GET through the port against
reading the same file with the files API.
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

import aiohttp
from common import RESULTS, machine_facts, now_utc, report, run_main, service, summary

from kernelhost import AsyncSandbox

DOMAIN = "sandboxes.bench.test"


async def get(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> bytes:
    async with http.get(url, headers=headers) as r:
        assert r.status == 200, (r.status, await r.text())
        return await r.read()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--mib", type=int, default=8)
    args = ap.parse_args()
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts()}
    small: list[float] = []
    execute: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kh-bench-ports-") as tmp:
        async with service(Path(tmp), "ports", KERNELHOST_DOMAIN=DOMAIN) as svc:
            async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as sbx:
                await sbx.run_code(
                    f"import os; os.makedirs('/tmp/site', exist_ok=True)\n"
                    f"open('/tmp/site/small.txt', 'w').write('ok')\n"
                    f"open('/tmp/site/big.bin', 'wb').write(os.urandom({args.mib} << 20))"
                )
                await sbx.run_code(
                    "cd /tmp/site && nohup python -m http.server 8000 >/dev/null 2>&1 &", language="bash"
                )
                headers = {"Host": f"8000-{sbx.id}.{DOMAIN}", "Authorization": f"Bearer {svc.api_key}"}
                async with aiohttp.ClientSession() as http:
                    deadline = time.monotonic() + 60
                    while True:
                        try:
                            await get(http, f"{svc.url}/small.txt", headers)
                            break
                        except AssertionError:
                            if time.monotonic() > deadline:
                                raise
                            await asyncio.sleep(0.5)
                    for _ in range(args.requests):
                        t0 = time.perf_counter()
                        assert await get(http, f"{svc.url}/small.txt", headers) == b"ok"
                        small.append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        assert (await sbx.run_code("1")).text == "1"
                        execute.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    body = await get(http, f"{svc.url}/big.bin", headers)
                    through_port = time.perf_counter() - t0
                t0 = time.perf_counter()
                via_files = await sbx.files.read("/tmp/site/big.bin")
                through_files = time.perf_counter() - t0
                assert len(body) == len(via_files) == args.mib << 20
    print(f"{args.requests} small GETs through the port, interleaved with as many run_code('1'):")
    report(out, "port GET", summary(small), "GET of 2 bytes through {port}-{id}.{domain}")
    report(out, "run_code", summary(execute), "run_code('1') (the reference)")
    ratio = out["port GET"]["median"] / out["run_code"]["median"]
    report(out, "port/run_code", round(ratio, 2), "port GET / run_code (ratio of medians)")
    report(out, "port MiB/s", round(args.mib / through_port, 1), f"one {args.mib} MiB GET through the port")
    report(out, "files MiB/s", round(args.mib / through_files, 1), "the same file through the files API")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ports.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
