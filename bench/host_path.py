#!/usr/bin/env python3
"""The host's share of a ``1+1`` round trip, with no VM: the real aiohttp app, manager and channel
client, in one process with the SDK, talking to the unit tests' fake guest agent (which answers an
execute_request at once with busy, execute_input, execute_result, idle and execute_reply).

    .venv/bin/python bench/host_path.py [--rounds 2000]

Per call: wall time through the SDK and through a bare aiohttp POST, CPU time of this process
(service + SDK + fake agent together), and how many TCP connections the SDK used. Under TCG the
guest takes ~95% of a ``1+1``; on a KVM host this part is what is left to cut.
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

import aiohttp
from aiohttp import web
from common import REPO, run_main, summary

from kernelhost import AsyncSandbox
from kernelhost.api import init_app
from kernelhost.api.auth import key_id
from kernelhost.api.state import RUNTIME
from kernelhost.channel import AgentClient
from kernelhost.sandboxes import Sandbox, SandboxState
from kernelhost.sandboxes.store.sandboxes import SandboxRecord
from tests.harness import _free_port
from tests.unit.fake_agent import FakeAgent, execute_result, short_socket_dir
from tests.unit.offline import fake_image_dir, offline_settings

KEY = "bench-host-path-key-0123456789"


async def answer(agent: FakeAgent, request: dict[str, Any]) -> None:
    await agent.run_execute(request, [execute_result({"text/plain": "2"})])


async def raw_calls(http: aiohttp.ClientSession, url: str, n: int) -> tuple[list[float], float]:
    """``n`` executes of ``1+1`` with a bare aiohttp client: wall times, and CPU seconds a call."""
    walls = []
    c0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        async with http.post(url, json={"code": "1+1"}) as r:
            await r.read()
        walls.append(time.perf_counter() - t0)
    return walls, (time.process_time() - c0) / n


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    n = args.rounds
    peers: set[tuple[Any, ...]] = set()

    @web.middleware
    async def count_peers(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.transport is not None and request.path.endswith("/execute"):
            peers.add(tuple(request.transport.get_extra_info("peername")))
        return await handler(request)  # type: ignore[no-any-return]

    with tempfile.TemporaryDirectory(prefix="kh-hostpath-") as tmpdir, short_socket_dir() as sockdir:
        tmp = Path(tmpdir)
        settings = offline_settings(
            tmp,
            image_dir=fake_image_dir(tmp),
            snapshots="off",
            pool_size=0,
            api_keys=(KEY,),
            log_level="warning",
        )
        app = init_app(settings)
        app.middlewares.insert(0, count_peers)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        port = _free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        fake = await FakeAgent(f"{sockdir}/agent.sock").start()
        fake.on_execute = answer
        try:
            manager = app[RUNTIME].manager
            now = time.time()
            rec = SandboxRecord(
                "sbx_hostpath",
                key_id(KEY),
                "python",
                "khunit-hostpath",
                SandboxState.RUNNING,
                now,
                now,
                600,
                512,
                1,
                "tcg",
                "k1",
            )
            sbx = Sandbox(rec)
            agent = AgentClient(f"{sockdir}/agent.sock")
            await agent.connect(5)
            # the fake agent stands in for a VM, which no public call can adopt
            registry = manager._ctx.registry
            registry.record(rec)
            manager._lifecycle.bind(sbx, agent)
            registry.add(sbx)
            url = f"http://127.0.0.1:{port}"
            client = await AsyncSandbox.connect(rec.id, url=url, api_key=KEY)
            out: dict[str, Any] = {"label": args.label, "rounds": n}
            for _ in range(50):
                await client.run_code("1+1")
            peers.clear()
            walls = []
            c0 = time.process_time()
            for _ in range(n):
                t0 = time.perf_counter()
                e = await client.run_code("1+1")
                walls.append(time.perf_counter() - t0)
                assert e.text == "2", e
            cpu = (time.process_time() - c0) / n
            out["sdk"] = summary(walls)
            out["sdk_cpu_s"] = cpu
            out["sdk_connections"] = len(peers)
            print(
                f"1+1 via the SDK, fake agent: median {summary(walls)['median'] * 1e3:.3f} ms, "
                f"p95 {summary(walls)['p95'] * 1e3:.3f} ms, CPU {cpu * 1e3:.3f} ms/call, "
                f"{len(peers)} TCP connections for {n} calls",
                flush=True,
            )
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
                walls, cpu = await raw_calls(http, f"{url}/v1/sandboxes/{rec.id}/execute", n)
            out["raw"] = summary(walls)
            out["raw_cpu_s"] = cpu
            print(
                f"1+1 via bare aiohttp, fake agent: median {summary(walls)['median'] * 1e3:.3f} "
                f"ms, p95 {summary(walls)['p95'] * 1e3:.3f} ms, CPU {cpu * 1e3:.3f} ms/call",
                flush=True,
            )
            # what a client pays when its connection is not reused: a new one for every call
            async with aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {KEY}"}, connector=aiohttp.TCPConnector(force_close=True)
            ) as http:
                walls, cpu = await raw_calls(http, f"{url}/v1/sandboxes/{rec.id}/execute", n)
            out["raw_new_connection"] = summary(walls)
            out["raw_new_connection_cpu_s"] = cpu
            print(
                f"same, a new TCP connection per call: median "
                f"{summary(walls)['median'] * 1e3:.3f} ms, p95 {summary(walls)['p95'] * 1e3:.3f} "
                f"ms, CPU {cpu * 1e3:.3f} ms/call",
                flush=True,
            )
            await client._http.aclose()
            await agent.close()
        finally:
            await fake.stop()
            await runner.cleanup()
    res = REPO / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    path = res / f"host_path{'-' + args.label if args.label else ''}.json"
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_main(main)
