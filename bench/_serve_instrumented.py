"""``kernelhost serve`` with timing hooks, for bench/profile_roundtrip.py only.

Patches, in this process only (kernelhost's code is unchanged): a first middleware that stamps
each request's arrival and completion; ``AgentClient.send_jupyter`` and ``AgentClient._dispatch``
to stamp when the execute_request leaves for the guest and when each reply frame arrives (with the
guest kernel's own header date). Extra routes under ``/_bench/`` (API key needed like /v1):

- ``GET /_bench/stages``: the stamps of the execute requests since the last call (then cleared)
- ``POST /_bench/ping/{sandbox_id}?n=N``: N agent pings timed inside the service (seconds)
- ``POST /_bench/cprofile/start`` / ``POST /_bench/cprofile/stop?path=P``: cProfile the process

With ``KH_BENCH_OLD_EXECUTE=1`` the execute route is the one before the end event and the end of
the body were written together (for a before/after comparison in one checkout).
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aiohttp import web  # noqa: E402

import kernelhost.api as api  # noqa: E402
from kernelhost.api import routes as api_routes  # noqa: E402
from kernelhost.api.state import KEY_ID, RUNTIME  # noqa: E402
from kernelhost.channel.client import AgentClient  # noqa: E402

RECORDS: list[dict[str, Any]] = []
CURRENT: dict[str, Any] | None = None
PROFILER: cProfile.Profile | None = None

_send_jupyter = AgentClient.send_jupyter
_dispatch = AgentClient._dispatch


async def send_jupyter(self: AgentClient, channel: str, msg: dict[str, Any]) -> None:
    if CURRENT is not None and msg["header"].get("msg_type") == "execute_request":
        CURRENT["run_id"] = msg["header"]["msg_id"]
        CURRENT["sent"] = time.perf_counter()
    await _send_jupyter(self, channel, msg)
    if CURRENT is not None and "sent" in CURRENT and "written" not in CURRENT:
        CURRENT["written"] = time.perf_counter()


async def dispatch(self: AgentClient, frame: dict[str, Any], size: int = 0) -> None:
    now = time.perf_counter()
    if CURRENT is not None and frame.get("op") == "jupyter":
        msg = frame.get("msg") or {}
        parent = (msg.get("parent_header") or {}).get("msg_id")
        if parent is not None and parent == CURRENT.get("run_id"):
            header = msg.get("header") or {}
            CURRENT.setdefault("frames", []).append({
                "t": now, "type": header.get("msg_type"), "channel": frame.get("channel"),
                "state": (msg.get("content") or {}).get("execution_state"),
                "date": header.get("date"),
                "started": (msg.get("metadata") or {}).get("started"),
            })
    await _dispatch(self, frame, size)


@web.middleware
async def stamp(request: web.Request, handler: Any) -> web.StreamResponse:
    global CURRENT
    if not request.path.endswith("/execute"):
        return await handler(request)
    peer = request.transport.get_extra_info("peername") if request.transport else None
    rec: dict[str, Any] = {"in": time.perf_counter(), "peer": list(peer) if peer else None}
    CURRENT = rec
    try:
        return await handler(request)
    finally:
        rec["out"] = time.perf_counter()
        CURRENT = None
        RECORDS.append(rec)


async def stages(request: web.Request) -> web.Response:
    out = list(RECORDS)
    RECORDS.clear()
    return web.json_response(out)


async def ping(request: web.Request) -> web.Response:
    sbx = request.app[RUNTIME].manager.get(request[KEY_ID], request.match_info["sandbox_id"])
    samples = []
    for _ in range(int(request.query.get("n", "20"))):
        t0 = time.perf_counter()
        await sbx.agent.request("ping", timeout=10)
        samples.append(time.perf_counter() - t0)
    return web.json_response(samples)


async def cprofile_start(request: web.Request) -> web.Response:
    global PROFILER
    PROFILER = cProfile.Profile()
    PROFILER.enable()
    return web.json_response({"ok": True})


async def cprofile_stop(request: web.Request) -> web.Response:
    global PROFILER
    assert PROFILER is not None
    PROFILER.disable()
    PROFILER.dump_stats(request.query["path"])
    PROFILER = None
    return web.json_response({"ok": True})


async def old_execute(request: web.Request) -> web.StreamResponse:
    """kernelhost/api/routes.py's execute before the change: end event and EOF written apart."""
    sbx = api_routes._sandbox(request)
    body = await api_routes._json_body(request)
    code = api_routes._field(body, "code", str, required=True)
    language = api_routes._field(body, "language", str, "python")
    timeout = api_routes._field(body, "timeout", (int, float))
    manager = api_routes._runtime(request).manager
    events = await manager.execute(sbx, code, language, timeout)
    manager.metrics.count_relayed("execute", "in", len(code.encode()))
    resp = web.StreamResponse(headers={
        "Content-Type": "application/x-ndjson", "Cache-Control": "no-store",
        "X-Accel-Buffering": "no",
    })
    await resp.prepare(request)
    async with contextlib.aclosing(events):
        async for event in events:
            line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
            manager.metrics.count_relayed("execute", "out", len(line))
            await resp.write(line)
    await resp.write_eof()
    return resp


def main() -> None:
    AgentClient.send_jupyter = send_jupyter  # type: ignore[method-assign]
    AgentClient._dispatch = dispatch  # type: ignore[method-assign]
    orig = api.init_app

    def init_app(settings: Any, keys: Any = None) -> web.Application:
        app = orig(settings, keys)
        app.middlewares.insert(0, stamp)
        if os.environ.get("KH_BENCH_OLD_EXECUTE") == "1":
            for route in app.router.routes():
                info = route.resource.get_info() if route.resource is not None else {}
                if route.method == "POST" and info.get("formatter", "").endswith("/execute"):
                    route._handler = old_execute
        app.router.add_get("/_bench/stages", stages)
        app.router.add_post("/_bench/ping/{sandbox_id}", ping)
        app.router.add_post("/_bench/cprofile/start", cprofile_start)
        app.router.add_post("/_bench/cprofile/stop", cprofile_stop)
        return app

    api.init_app = init_app  # type: ignore[assignment]
    from kernelhost.cli import main as cli_main
    sys.argv = ["kernelhost", "serve"]
    cli_main()


if __name__ == "__main__":
    main()
