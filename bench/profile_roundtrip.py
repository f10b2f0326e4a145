#!/usr/bin/env python3
"""Where a ``1+1`` round trip's time goes on kernelhost's request path.

    .venv/bin/python bench/profile_roundtrip.py [--rounds 60] [--py-spy]

Starts ``kernelhost serve`` with timing hooks (bench/_serve_instrumented.py; kernelhost's own code
is unchanged), creates one sandbox, and measures, over ``--rounds`` calls each:

- the client's view: ``1+1`` through the SDK, and through a bare aiohttp POST (no SDK);
- stages inside the service, from its own clock: request in -> execute_request written to the
  channel -> first frame back from the guest (status busy) -> status idle arrived -> response
  finished; plus the guest kernel's own busy->idle time (from its message header dates) and an
  agent ping round trip (service -> virtio-serial -> agent -> back, no kernel involved);
- CPU time per call of the service process, the sandbox's QEMU process and this client
  (from /proc, no sampling overhead);
- a cProfile of the service over the same calls (top functions by own time), and with
  ``--py-spy`` a py-spy sampling of it too.

Prints the figures and writes bench/results/profile.json (and profile-service.pstats).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
from common import REPO, RESULTS, Service, domains_of, qemu_pid, summary

from kernelhost import AsyncSandbox

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def start_instrumented(svc: Service, timeout: float = 120.0) -> None:
    """``Service.start`` with bench/_serve_instrumented.py in place of ``kernelhost serve``."""
    with svc.log_path.open("ab") as log:
        svc.proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "_serve_instrumented.py")],
            env=svc.env, stdout=log, stderr=log, cwd=REPO)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            raise RuntimeError(f"service exited: {svc.log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(svc.url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("instrumented service did not answer")


def ms_line(label: str, samples: list[float]) -> dict[str, float]:
    fig = summary(samples)
    print(f"  {label:58} {fig['median'] * 1000:8.2f} ms  p95 {fig['p95'] * 1000:8.2f} ms",
          flush=True)
    return fig


def guest_time(date: str | None) -> float | None:
    if not date:
        return None
    return datetime.fromisoformat(date.replace("Z", "+00:00")).timestamp()


def stage_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, list[float]] = {k: [] for k in (
        "in_to_sent", "sent_to_written", "written_to_busy", "busy_to_idle_host",
        "kernel_busy_to_idle_guest", "kernel_started_to_reply_guest", "idle_to_out",
        "last_frame_to_out", "in_to_out")}
    arrivals: dict[str, list[float]] = {}
    for r in records:
        frames = r.get("frames") or []
        busy = next((f for f in frames if f["type"] == "status" and f["state"] == "busy"), None)
        idle = next((f for f in frames if f["type"] == "status" and f["state"] == "idle"), None)
        reply = next((f for f in frames if f["type"] == "execute_reply"), None)
        if not (busy and idle and "sent" in r):
            continue
        rows["in_to_sent"].append(r["sent"] - r["in"])
        rows["sent_to_written"].append(r["written"] - r["sent"])
        rows["written_to_busy"].append(busy["t"] - r["written"])
        rows["busy_to_idle_host"].append(idle["t"] - busy["t"])
        gb, gi = guest_time(busy["date"]), guest_time(idle["date"])
        if gb is not None and gi is not None:
            rows["kernel_busy_to_idle_guest"].append(gi - gb)
        if reply and reply.get("started") and reply.get("date"):
            gs, gr = guest_time(reply["started"]), guest_time(reply["date"])
            if gs is not None and gr is not None:
                rows["kernel_started_to_reply_guest"].append(gr - gs)
        rows["idle_to_out"].append(r["out"] - idle["t"])
        rows["last_frame_to_out"].append(r["out"] - max(f["t"] for f in frames))
        for f in frames:
            key = f"{f['channel']}/{f['type']}" + (f"/{f['state']}" if f["state"] else "")
            arrivals.setdefault(key, []).append(f["t"] - r["written"])
        rows["in_to_out"].append(r["out"] - r["in"])
    labels = {
        "in_to_out": "service: request in -> response finished",
        "in_to_sent": "  request in -> execute_request handed to the channel",
        "sent_to_written": "  channel: encode + write to the socket",
        "written_to_busy": "  written -> guest's first frame (status busy) arrived",
        "busy_to_idle_host": "  busy -> idle arrived (host clock)",
        "kernel_busy_to_idle_guest": "    same, kernel's own header dates (guest clock)",
        "kernel_started_to_reply_guest": "    kernel: execute started -> reply (guest clock)",
        "idle_to_out": "  idle arrived -> response finished",
        "last_frame_to_out": "  last frame arrived -> response finished",
    }
    figs = {k: ms_line(labels[k], v) for k, v in rows.items() if v}
    print("  arrival of each frame after the execute_request was written:", flush=True)
    figs["arrivals"] = {k: ms_line(f"    {k}", v)
                        for k, v in sorted(arrivals.items(), key=lambda kv: summary(kv[1])["median"])}
    return figs


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--py-spy", action="store_true", help="also sample with py-spy")
    parser.add_argument("--label", default="", help="stored with the figures (e.g. before/after)")
    parser.add_argument("--old-execute", action="store_true",
                        help="serve the execute route as it was before the end event and the "
                             "end of the body were written together")
    args = parser.parse_args()
    n = args.rounds
    out: dict[str, Any] = {"label": args.label, "rounds": n, "old_execute": args.old_execute,
                           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "load_avg": os.getloadavg()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kh-profile-") as tmpdir:
        svc = Service.make(Path(tmpdir), KERNELHOST_POOL_SIZE="0",
                           KH_BENCH_OLD_EXECUTE="1" if args.old_execute else "0")
        try:
            await asyncio.to_thread(start_instrumented, svc)
            headers = {"Authorization": f"Bearer {svc.api_key}"}
            async with AsyncSandbox(url=svc.url, api_key=svc.api_key) as sbx, \
                    aiohttp.ClientSession(headers=headers) as http:
                out["accel"] = (await sbx.info()).accel
                print(f"acceleration: {out['accel']}; {n} calls per figure; execute route "
                      f"{'before' if args.old_execute else 'after'} the change; load "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
                for _ in range(10):
                    await sbx.run_code("1+1")
                qemu = qemu_pid(domains_of(svc)[0])
                assert svc.proc is not None
                me, spid = os.getpid(), svc.proc.pid

                # 1. the client's view, with CPU per call of each process
                async with http.get(f"{svc.url}/_bench/stages") as r:
                    await r.json()  # clear the warm-up's stamps
                c0 = (cpu_s(spid), cpu_s(qemu), cpu_s(me))
                sdk = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    e = await sbx.run_code("1+1")
                    sdk.append(time.perf_counter() - t0)
                    assert e.text == "2"
                c1 = (cpu_s(spid), cpu_s(qemu), cpu_s(me))
                print("client", flush=True)
                out["sdk"] = ms_line("1+1 through the SDK", sdk)
                server = []
                async with http.get(f"{svc.url}/_bench/stages") as r:
                    records = await r.json()
                conns = len({tuple(r["peer"]) for r in records if r.get("peer")})
                out["sdk_connections"] = conns
                print(f"  {'TCP connections the SDK used for these calls':58} {conns:8d}",
                      flush=True)
                url = f"{svc.url}/v1/sandboxes/{sbx.id}/execute"
                raw = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    async with http.post(url, json={"code": "1+1"}) as r:
                        body = await r.read()
                    raw.append(time.perf_counter() - t0)
                    server.append(json.loads(body.splitlines()[-1])["duration_ms"] / 1000)
                out["raw_http"] = ms_line("1+1 through a bare aiohttp POST (no SDK)", raw)
                out["end_duration"] = ms_line("  of which run_cell's duration_ms (service side)",
                                              server)
                async with http.get(f"{svc.url}/_bench/stages") as r:
                    records += await r.json()
                print("service stages (service clock, both runs)", flush=True)
                out["stages"] = stage_figures(records)
                async with http.post(f"{svc.url}/_bench/ping/{sbx.id}?n={n}") as r:
                    pings = await r.json()
                out["agent_ping"] = ms_line("agent ping: service -> agent -> service", pings)
                cpu = {"service": (c1[0] - c0[0]) / n, "qemu": (c1[1] - c0[1]) / n,
                       "client": (c1[2] - c0[2]) / n}
                # the same processes with nothing to do, over as long as the calls took
                i0, t0 = (cpu_s(spid), cpu_s(qemu)), time.perf_counter()
                await asyncio.sleep(min(10.0, sum(sdk)))
                idle_s = time.perf_counter() - t0
                cpu["service_idle_same_time"] = (cpu_s(spid) - i0[0]) / idle_s * sum(sdk) / n
                cpu["qemu_idle_same_time"] = (cpu_s(qemu) - i0[1]) / idle_s * sum(sdk) / n
                out["cpu_per_call_s"] = cpu
                print("CPU time per 1+1 call (SDK run); *_idle_same_time: the same process "
                      "doing nothing for as long, per call", flush=True)
                for k, v in cpu.items():
                    print(f"  {k:58} {v * 1000:8.2f} ms", flush=True)

                # 2. cProfile of the service over the same calls
                prof = RESULTS / "profile-service.pstats"
                async with http.post(f"{svc.url}/_bench/cprofile/start") as r:
                    await r.read()
                for _ in range(n):
                    await sbx.run_code("1+1")
                async with http.post(f"{svc.url}/_bench/cprofile/stop",
                                     params={"path": str(prof)}) as r:
                    await r.read()
                print(f"cProfile of the service, {n} calls: top by own time "
                      f"(full: {prof})", flush=True)
                st = pstats.Stats(str(prof))
                st.sort_stats("tottime")
                top = []
                for (file, line, fn), (_cc, nc, tt, ct, _callers) in sorted(
                        st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]:
                    where = f"{Path(file).name}:{line}({fn})"
                    top.append({"where": where, "calls_per_req": nc / n,
                                "own_ms_per_req": tt / n * 1000, "cum_ms_per_req": ct / n * 1000})
                    print(f"  {where[:62]:62} {nc / n:7.1f}/req  own {tt / n * 1000:6.3f} ms  "
                          f"cum {ct / n * 1000:7.3f} ms", flush=True)
                out["cprofile_top"] = top

                # 3. py-spy, sampling (no instrumentation overhead)
                spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
                if args.py_spy and Path(spy).exists():
                    raw_path = RESULTS / "profile-service.pyspy.txt"
                    proc = await asyncio.create_subprocess_exec(
                        spy, "record", "--pid", str(spid), "--rate", "250", "--format", "raw",
                        "--output", str(raw_path), "--nonblocking",
                        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
                    await asyncio.sleep(1.0)
                    for _ in range(n):
                        await sbx.run_code("1+1")
                    proc.send_signal(2)
                    await proc.wait()
                    out["py_spy"] = str(raw_path)
                    print(f"py-spy samples written to {raw_path}", flush=True)
        finally:
            svc.stop()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(svc.cleanup)
            with contextlib.suppress(OSError):
                shutil.copy(svc.log_path, REPO / "results" / "bench-profile-service.log")
    path = RESULTS / f"profile{'-' + args.label if args.label else ''}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
