#!/usr/bin/env python3
"""The benchmark suite: kernelhost, a local ipykernel (jupyter_client) and jupyter-kernel-gateway
(local kernels), measured side by side in one run on this machine.

    make bench                        (full run; rewrites the README's Performance block)
    .venv/bin/python bench/run.py [--quick] [--update-readme] [--only local,gateway,kernelhost]

Writes bench/results/bench.json and bench/results/bench.md (bench/report.py renders the table
and rewrites the README block between ``<!-- bench:start -->`` and ``<!-- bench:end -->``).
Prints every figure as soon as it is measured. Figures (medians and p95 over repeated runs):

- time to a usable kernel: from the request until ``1+1`` has answered. kernelhost: cold boot
  (snapshots off), snapshot restore (create that misses the warm pool) and pool hit; local:
  start an ipykernel; gateway: POST /api/kernels, then the WebSocket's first execute.
- ``1+1`` round trip; streamed stdout throughput (MB/s) of a cell printing N MiB;
- pandas: read a ~50 MB CSV (made on the host, the same bytes for every system; kernelhost
  uploads it through the files API into a ``python-datasci`` sandbox) and group by a column;
- fork(1) to a usable child (kernelhost only);
- memory per idle kernel (PSS of each QEMU process, or of each kernel process) with several idle
  at once, and the idle kernels that would fit in MemAvailable (an estimate).

Everything started here (services and their VMs, the gateway and its kernels, local kernels) is
stopped on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    RESULTS,
    Answer,
    Kernel,
    LocalKernel,
    descendants,
    domains_of,
    healthz,
    machine_facts,
    make_csv,
    mem_available_mib,
    ms,
    now_utc,
    pandas_code,
    print_code,
    qemu_pid,
    report,
    service,
    smaps_mib,
    summary,
    wait_pool,
)
from gateway import Gateway
from report import render, update_readme

from kernelhost import AsyncSandbox


@dataclass(frozen=True)
class Rounds:
    start: int = 15  # kernel starts per system (restore and pool hit for kernelhost)
    cold_boot: int = 3  # kernelhost cold boots (~12 s each under TCG on a quiet machine)
    roundtrip: int = 100
    stream_mib: int = 16
    stream: int = 3
    pandas: int = 5
    fork: int = 5
    idle: int = 4  # kernels kept idle side by side for the memory figure
    csv_mb: float = 50.0


QUICK = Rounds(start=3, cold_boot=1, roundtrip=10, stream_mib=8, stream=1, pandas=1, fork=2, idle=3)


class Sbx(Kernel):
    """A kernelhost sandbox as the suite drives it (through the SDK, HTTP included)."""

    name = "kernelhost"

    def __init__(self, sbx: AsyncSandbox) -> None:
        self.sbx = sbx

    @classmethod
    async def create(cls, svc: Any, template: str = "python") -> Sbx:
        return cls(
            await AsyncSandbox.create(template=template, url=svc.url, api_key=svc.api_key, timeout=600)
        )

    async def execute(self, code: str, timeout: float = 600) -> Answer:
        e = await self.sbx.run_code(code, timeout=timeout)
        return Answer(e.status, e.text, len(e.stdout))

    async def close(self) -> None:
        try:
            await self.sbx.close()
        except Exception as exc:  # the service's cleanup destroys what is left; keep measuring
            print(f"  (warning: deleting sandbox {self.sbx.id} failed: {exc})", flush=True)


# -- figures measured the same way on every system ------------------------------------------------


async def to_usable(start: Callable[[], Awaitable[Kernel]]) -> tuple[float, float, Kernel]:
    """(seconds until the start request returned, seconds until the first ``1+1`` answered)."""
    t0 = time.perf_counter()
    k = await start()
    started = time.perf_counter() - t0
    try:
        a = await k.execute("1+1")
    except BaseException:
        await k.close()
        raise
    took = time.perf_counter() - t0
    assert a.text == "2", a
    return started, took, k


async def start_figure(
    out: dict[str, Any],
    key: str,
    label: str,
    n: int,
    start: Callable[[], Awaitable[Kernel]],
    before_each: Callable[[], Awaitable[None]] | None = None,
) -> None:
    samples, requests = [], []
    for _ in range(n):
        if before_each is not None:
            await before_each()
        started, took, k = await to_usable(start)
        samples.append(took)
        requests.append(started)
        await k.close()
    report(out, key, summary(samples), label)
    out[key.replace("_s", "_request_s")] = fig = summary(requests)
    print(f"  {'  of which the start request':44} {ms(fig)}", flush=True)


async def roundtrip_and_stream(out: dict[str, Any], k: Kernel, r: Rounds) -> None:
    samples = []
    for i in range(r.roundtrip + 3):  # three to warm up
        t0 = time.perf_counter()
        a = await k.execute("1+1")
        if i >= 3:
            samples.append(time.perf_counter() - t0)
        assert a.text == "2", a
    report(out, "roundtrip_s", summary(samples), "1+1 round trip")
    rates = []
    code = print_code(r.stream_mib)
    for i in range(r.stream + 1):  # the first warms up
        t0 = time.perf_counter()
        a = await k.execute(code)
        took = time.perf_counter() - t0
        assert a.status == "ok" and a.stdout_chars == r.stream_mib << 20, a
        if i:
            rates.append(a.stdout_chars / took / 1e6)
    fig = summary(rates)
    out["stdout_mb_s"] = fig
    print(
        f"  {'stdout throughput':44} {fig['median']:9.1f} MB/s (worst {fig['min']:.1f}) n={fig['n']}",
        flush=True,
    )


async def pandas_figure(
    out: dict[str, Any], k: Kernel, path: str, r: Rounds, expect: str | None
) -> str | None:
    a = await k.execute("import pandas as pd\npd.__version__")
    out["pandas_version"] = (a.text or "").strip("'")
    samples, text = [], None
    for _ in range(r.pandas):
        t0 = time.perf_counter()
        a = await k.execute(pandas_code(path))
        samples.append(time.perf_counter() - t0)
        assert a.status == "ok" and a.text and (expect is None or a.text == expect), a
        text = a.text
    report(out, "pandas_s", summary(samples), f"pandas read_csv + groupby (pandas {out['pandas_version']})")
    return text


def memory_figure(out: dict[str, Any], pids: list[int], what: str) -> None:
    pss = [smaps_mib(p, "Pss") for p in pids]
    uss = [smaps_mib(p, "Private_Clean") + smaps_mib(p, "Private_Dirty") for p in pids]
    avail = mem_available_mib()
    m = summary(pss)
    out["idle_memory"] = {
        "what": what,
        "kernels": len(pids),
        "pss_mib": m,
        "private_mib": summary(uss),
        "mem_available_mib": round(avail),
        "fit_estimate": int(avail // m["median"]),
    }
    print(
        f"  {'memory per idle kernel (PSS)':44} {m['median']:9.1f} MiB (private "
        f"{summary(uss)['median']:.1f} MiB), {len(pids)} idle side by side; {what}",
        flush=True,
    )
    print(
        f"  {'idle kernels that fit (estimate)':44} {int(avail // m['median']):9d}  "
        f"(MemAvailable {avail:.0f} MiB / PSS)",
        flush=True,
    )


# -- the three systems ---------------------------------------------------------------------------


async def bench_local(r: Rounds, csv: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    print("local ipykernel (jupyter_client)", flush=True)
    await start_figure(out, "start_cold_s", "start a kernel, to 1+1 answered", r.start, LocalKernel.start)
    async with contextlib.AsyncExitStack() as stack:
        k = await LocalKernel.start()
        stack.push_async_callback(k.close)
        await roundtrip_and_stream(out, k, r)
        out["pandas_result"] = await pandas_figure(out, k, str(csv), r, None)
        idle = []
        for _ in range(r.idle):
            ik = await LocalKernel.start()
            stack.push_async_callback(ik.close)
            assert (await ik.execute("1+1")).text == "2"
            idle.append(ik)
        await asyncio.sleep(2)
        memory_figure(out, [ik.pid for ik in idle], "the ipykernel process")
    return out


async def bench_gateway(r: Rounds, csv: Path, tmp: Path, expect: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gw = Gateway(tmp / "gateway.log")
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(gw.stop)
        t0 = time.perf_counter()
        await gw.start()
        out["version"] = gw.version
        print(f"jupyter-kernel-gateway {gw.version} (local kernels, REST + WebSocket)", flush=True)
        report(out, "server_start_s", round(time.perf_counter() - t0, 2), "gateway server start")
        await start_figure(
            out, "start_cold_s", "POST /api/kernels, to 1+1 answered", r.start, gw.start_kernel
        )
        k = await gw.start_kernel()
        stack.push_async_callback(k.close)
        await roundtrip_and_stream(out, k, r)
        out["pandas_result"] = await pandas_figure(out, k, str(csv), r, expect)
        for _ in range(r.idle):
            ik = await gw.start_kernel()
            stack.push_async_callback(ik.close)
            assert (await ik.execute("1+1")).text == "2"
        await asyncio.sleep(2)
        kernels = [p for p in gw.kernel_pids()]
        assert gw.proc is not None
        out["server_pss_mib"] = round(smaps_mib(gw.proc.pid), 1)
        # the kernel kept busy above is one of them; the idle ones are the r.idle newest
        memory_figure(
            out,
            sorted(kernels)[-r.idle :],
            f"each kernel process; the gateway server itself adds {out['server_pss_mib']} MiB once",
        )
    return out


def sandbox_domains(svc: Any, ids: list[str]) -> list[str]:
    db = sqlite3.connect(f"file:{svc.state_dir / 'kernelhost.sqlite3'}?mode=ro", uri=True)
    try:
        return [row[0] for i in ids for row in db.execute("SELECT domain FROM sandboxes WHERE id = ?", (i,))]
    finally:
        db.close()


async def bench_kernelhost(r: Rounds, csv: Path, tmp: Path, expect: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    print("kernelhost (QEMU/libvirt sandboxes, through the SDK and HTTP)", flush=True)
    env = {
        "KERNELHOST_POOL_SIZE": "0",
        "KERNELHOST_IDLE_ACTION": "delete",
        "KERNELHOST_MAX_OUTPUT_BYTES": str((r.stream_mib + 8) << 20),
        "KERNELHOST_MAX_CONCURRENT_BOOTS": "2",
    }
    async with service(tmp, "kh-main", **env) as svc:
        h = await healthz(svc)
        out["accel"], out["accel_reason"] = h["accel"], h.get("accel_reason")
        reason = " ".join(str(h.get("accel_reason")).split())
        print(f"  acceleration: {h['accel']} ({reason})", flush=True)
        async with contextlib.AsyncExitStack() as stack:
            # the first create of each template builds its snapshot if it is not cached yet
            for template in ("python", "python-datasci"):
                _, took, k = await to_usable(lambda t=template: Sbx.create(svc, t))  # type: ignore[misc]
                await k.close()
                report(
                    out,
                    f"first_create_{template}_s",
                    round(took, 2),
                    f"first create, {template} (snapshot build if needed)",
                )
            await start_figure(
                out, "start_cold_s", "snapshot restore (pool miss), to 1+1", r.start, lambda: Sbx.create(svc)
            )
            k = await Sbx.create(svc)
            stack.push_async_callback(k.close)
            await roundtrip_and_stream(out, k, r)
            forks = []
            for _ in range(r.fork):
                t0 = time.perf_counter()
                kids = await k.sbx.fork(1)
                try:
                    assert (await kids[0].run_code("1+1")).text == "2"
                    forks.append(time.perf_counter() - t0)
                finally:
                    for kid in kids:
                        await kid.close()
            report(out, "fork1_s", summary(forks), "fork(1), to 1+1 answered in the child")
            idle = []
            for _ in range(r.idle):
                ik = await Sbx.create(svc)
                stack.push_async_callback(ik.close)
                assert (await ik.execute("1+1")).text == "2"
                idle.append(ik)
            await asyncio.sleep(3)
            domains = sandbox_domains(svc, [ik.sbx.id for ik in idle])
            assert len(domains) == r.idle and set(domains) <= set(domains_of(svc)), domains
            memory_figure(
                out,
                [qemu_pid(d) for d in domains],
                "each sandbox's QEMU process (guest RAM and device model)",
            )
            for ik in idle:
                await ik.close()
            # pandas in the python-datasci template, the CSV uploaded through the files API
            ds = await Sbx.create(svc, "python-datasci")
            stack.push_async_callback(ds.close)
            t0 = time.perf_counter()
            await ds.sbx.files.write("data.csv", csv.read_bytes(), timeout=600)
            report(
                out,
                "csv_upload_s",
                round(time.perf_counter() - t0, 2),
                f"upload the {csv.stat().st_size / 1e6:.0f} MB CSV (files API)",
            )
            out["pandas_result"] = await pandas_figure(out, ds, "data.csv", r, expect)
    env_pool = {**env, "KERNELHOST_POOL_SIZE": "2"}
    async with service(tmp, "kh-pool", **env_pool) as svc:
        await start_figure(
            out,
            "start_warm_s",
            "pool hit, to 1+1 answered",
            r.start,
            lambda: Sbx.create(svc),
            before_each=lambda: wait_pool(svc, 2),
        )
    env_cold = {**env, "KERNELHOST_SNAPSHOTS": "off"}
    async with service(tmp, "kh-cold", **env_cold) as svc:
        await start_figure(
            out, "start_boot_s", "cold boot (snapshots off), to 1+1", r.cold_boot, lambda: Sbx.create(svc)
        )
    prev = RESULTS / "fast_start.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        d = json.loads(prev.read_text())["density"]
        out["density_measured"] = {
            "started": d["started"],
            "answered": d["answered"],
            "host_mem_used_mib": d["host_mem_used_mib"],
            "source": "bench/results/fast_start.json (previous bench_fast_start.py run)",
        }
        print(
            f"  {'density, measured earlier':44} {d['answered']} idle sandboxes answering "
            f"in {d['host_mem_used_mib']} MiB (bench_fast_start.py)",
            flush=True,
        )
    return out


# -- the run -------------------------------------------------------------------------------------


def save(res: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(res, indent=1))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke run")
    parser.add_argument(
        "--update-readme", action="store_true", help="rewrite the README's Performance block from this run"
    )
    parser.add_argument(
        "--only", default="local,gateway,kernelhost", help="comma-separated subset of systems"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    r = QUICK if args.quick else Rounds()
    systems = [s.strip() for s in args.only.split(",") if s.strip()]
    res: dict[str, Any] = {
        "when": now_utc(),
        "mode": "quick" if args.quick else "full",
        "machine": machine_facts(),
        "rounds": asdict(r),
        "systems": {},
    }
    m = res["machine"]
    print(
        f"machine: {m['cores']} cores, {m['mem_total_mib'] / 1024:.1f} GiB RAM, {m['cpu_model']}, "
        f"load {m['load_avg_at_start']}; mode {res['mode']}",
        flush=True,
    )
    began = time.perf_counter()
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        with tempfile.TemporaryDirectory(prefix="kh-bench-") as tmpdir:
            tmp = Path(tmpdir)
            csv = tmp / "data.csv"
            size = await asyncio.to_thread(make_csv, csv, r.csv_mb)
            res["csv_bytes"] = size
            expect = None
            for name in systems:
                if name == "local":
                    got = await bench_local(r, csv)
                elif name == "gateway":
                    got = await bench_gateway(r, csv, tmp, expect)
                elif name == "kernelhost":
                    got = await bench_kernelhost(r, csv, tmp, expect)
                else:
                    raise SystemExit(f"unknown system {name!r}; use local, gateway, kernelhost")
                expect = expect or got.get("pandas_result")
                res["systems"][name] = got
                save(res, args.out)
    finally:
        # last resort after an interruption: a kernel whose shutdown was itself interrupted
        for pid in descendants(os.getpid()):  # only processes this run started
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    res["accel"] = res["systems"].get("kernelhost", {}).get("accel")
    res["took_s"] = round(time.perf_counter() - began, 1)
    save(res, args.out)
    md = render(res)
    (args.out / "bench.md").write_text(md)
    print("\n" + md, flush=True)
    if args.update_readme:
        update_readme(md)
        print("README.md: Performance block rewritten", flush=True)
    print(f"whole run: {res['took_s']:.0f} s; wrote {args.out / 'bench.json'} and bench.md", flush=True)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, or SIGTERM
        print("interrupted: what this run started has been stopped", file=sys.stderr)
        sys.exit(130)
