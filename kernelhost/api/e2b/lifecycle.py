"""E2B's lifecycle API (``E2B_API_URL=<service>/e2b``) over the sandbox manager: create (from a
template, or from a snapshot: ``snapshots.py``), get, list (v1 and v2, filtered and paginated),
kill, timeout, connect and resume, pause, fork.

E2B's ``timeout`` is how long a sandbox lives without being told otherwise; here it is the
sandbox's idle timeout (counted from the last call, reset by ``set_timeout``), after which it
hibernates (E2B's pause: every variable and file kept) or is deleted, as the service's
``idle_action`` says. What kernelhost does not have answers with the status and
``{code, message}`` body that E2B's SDKs raise as a clear exception naming the feature.
"""

from __future__ import annotations

import asyncio
import datetime
import time
import urllib.parse
from typing import Any

from aiohttp import web

from ...sandboxes import NetworkSpec, Sample, Sandbox, SandboxState, iso_time, parse_network
from ..state import KEY_ID, SETTINGS
from . import snapshots
from .common import (
    ENVD_VERSION,
    MAX_PAGE,
    E2BError,
    access_token,
    lifecycle_view,
    our_template,
    paginate,
    read_body,
    runtime,
)
from .envs import apply_env

DEFAULT_TIMEOUT = 300  # E2B's, seconds
#: whose an E2B sandbox's code is, as on E2B: ``user`` (home /home/user, sudo without a password)
E2B_USER = "user"


def _describe(request: web.Request, sbx: Sandbox, *, secrets: bool = False) -> dict[str, Any]:
    rec = sbx.record
    template = rec.template.split("@", 1)[0]
    out: dict[str, Any] = {
        "sandboxID": sbx.id,
        "templateID": template,
        "alias": template,
        "clientID": "kernelhost",
        "envdVersion": ENVD_VERSION,
        "domain": request.app[SETTINGS].domain or None,  # get_host(port): docs/ports.md
        "startedAt": iso_time(rec.created_at),
        "endAt": iso_time(rec.last_active_at + rec.idle_timeout_seconds),
        "cpuCount": rec.vcpus,
        "memoryMB": rec.memory_mib,
        "diskSizeMB": rec.memory_mib // 2,  # a sandbox's files live in half its VM memory
        "state": "paused" if rec.state == SandboxState.HIBERNATED else "running",
        "metadata": rec.metadata,
    }
    if secrets:  # a new token (only its hash is kept); E2B's SDKs send the code interpreter's
        # context calls with the traffic token alone, so it is the same one
        token = access_token(request, sbx)
        out["envdAccessToken"] = token
        out["trafficAccessToken"] = token
    return out


def _sandbox(request: web.Request) -> Sandbox:
    return runtime(request).manager.get(request[KEY_ID], request.match_info["sandbox_id"])


def _timeout(body: dict[str, Any], default: int | None, least: int = 1) -> int | None:
    value = body.get("timeout", default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise E2BError(400, f"timeout={value!r} must be a whole number of seconds, at least {least}")
    return value


def _memory(body: dict[str, Any]) -> bool:
    """A pause's or connect's ``memory`` (E2B's ``mode``/``on_resume``): False for files only."""
    memory = body.get("memory", True)
    if not isinstance(memory, bool):
        raise E2BError(400, f"memory={memory!r} must be true or false")
    return memory


def _network(body: dict[str, Any]) -> NetworkSpec | None:
    """E2B's network options as our network modes: internet access is ``outbound``, an
    ``allowOut`` list is ``allowlist``; without either, the template's default."""
    net = body.get("network")
    if isinstance(net, dict) and net.get("allowOut"):
        allow = net["allowOut"]
        if not isinstance(allow, list) or not all(isinstance(a, str) for a in allow):
            raise E2BError(400, "network.allowOut must be a list of host[:port] strings")
        return parse_network({"mode": "allowlist", "allow": allow})
    access = body.get("allow_internet_access", body.get("allowInternetAccess"))
    if access is None:
        return None
    if not isinstance(access, bool):
        raise E2BError(400, f"allow_internet_access={access!r} must be true or false")
    return NetworkSpec("outbound" if access else "none")


def _strings(body: dict[str, Any], field: str) -> dict[str, str]:
    value = body.get(field) or {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise E2BError(400, f"{field} must be an object of strings")
    return {str(k): v for k, v in value.items()}


@lifecycle_view
async def create(request: web.Request) -> web.Response:
    body = await read_body(request)
    # autoPause and autoResume are what a kernelhost sandbox does when the service's
    # idle_action is hibernate (the default): paused when idle, resumed by its next call
    for unsupported, what in (("volumeMounts", "volume mounts"), ("mcp", "MCP servers in the sandbox")):
        if body.get(unsupported):
            raise E2BError(400, f"{what} ({unsupported}) are not supported by kernelhost; create without")
    lifecycle_options = _lifecycle(body)
    template = body.get("templateID") or "base"
    if not isinstance(template, str):
        raise E2BError(400, f"templateID={template!r} must be a template name")
    manager = runtime(request).manager
    owner, timeout, metadata = request[KEY_ID], _timeout(body, DEFAULT_TIMEOUT), _strings(body, "metadata")
    snapshot = snapshots.find(manager, owner, template)
    if snapshot is not None:  # a new sandbox holding the snapshot's state: a branch
        sbx = await manager.branch(owner, snapshot, timeout, metadata, _network(body))
    else:
        template = our_template(request, template)
        sbx = await manager.create(owner, template, timeout, metadata, _network(body), run_as=E2B_USER)
    env = _strings(body, "envVars")
    try:
        manager.set_idle_action(sbx, *lifecycle_options)
        if env:
            await apply_env(manager, sbx, env)
    except BaseException:
        await asyncio.shield(manager.delete(sbx.record.owner, sbx.id))
        raise
    return web.json_response(_describe(request, sbx, secrets=True), status=201)


def _lifecycle(body: dict[str, Any]) -> tuple[str | None, bool]:
    """E2B's ``lifecycle`` (``autoPause``, ``autoPauseMemory``, ``autoResume``) as the
    sandbox's idle action (None: the service's ``idle_action``) and whether a call wakes it
    once paused."""
    pause, memory, resume = body.get("autoPause"), body.get("autoPauseMemory"), body.get("autoResume")
    if pause is not None and not isinstance(pause, bool):
        raise E2BError(400, f"autoPause={pause!r} must be true or false")
    if memory is False:
        raise E2BError(
            400,
            "on_timeout mode 'filesystem' (autoPauseMemory=false) is not supported by kernelhost: "
            "a timed-out sandbox pauses with its memory; call pause(mode='filesystem') yourself",
        )
    enabled = resume.get("enabled") if isinstance(resume, dict) else resume
    if enabled is not None and not isinstance(enabled, bool):
        raise E2BError(400, f"autoResume={resume!r} must be {{'enabled': true or false}}")
    action = None if pause is None else "hibernate" if pause else "delete"
    return action, enabled is not False


@lifecycle_view
async def get_sandbox(request: web.Request) -> web.Response:
    return web.json_response(_describe(request, _sandbox(request)))


@lifecycle_view
async def metrics(request: web.Request) -> web.Response:
    """The sandbox's samples from ``start`` to ``end`` (the sampler's, every
    ``sandbox_metrics_interval`` seconds; the first of a VM has no CPU figure yet and is left
    out); a running sandbox with none yet (or sampling off) gets one reading of now instead, and
    a paused one without samples none."""
    sbx = _sandbox(request)
    window = [_unix(request, name) for name in ("start", "end")]
    manager = runtime(request).manager
    end = window[1] + 1 if window[1] is not None else None
    if (
        any(s.complete for s in manager.sampler.samples(sbx.id))
        or sbx.record.state == SandboxState.HIBERNATED
    ):
        samples = [s for s in manager.sampler.samples(sbx.id, window[0], end) if s.complete]
        return web.json_response([_metric(*_fields(s)) for s in samples])
    u = await manager.usage.read(sbx)
    if (window[0] is not None and u.timestamp < window[0]) or (end is not None and u.timestamp > end):
        return web.json_response([])
    fields = (u.cpu_count, u.cpu_used_pct, u.mem_used, u.mem_total, u.mem_cache, u.disk_used, u.disk_total)
    return web.json_response([_metric(u.timestamp, *fields)])


def _fields(s: Sample) -> tuple[float, int, float, int, int, int, int, int]:
    return (
        s.timestamp,
        s.cpu_count,
        s.cpu_used_pct,
        s.mem_used,
        s.mem_total,
        s.mem_cache,
        s.disk_used,
        s.disk_total,
    )


def _metric(
    ts: float, cpus: int, cpu_pct: float, used: int, total: int, cache: int, disk: int, disk_total: int
) -> dict[str, Any]:
    """One entry of E2B's ``SandboxMetric``."""
    return {
        "timestamp": iso_time(ts),
        "timestampUnix": int(ts),
        "cpuCount": cpus,
        "cpuUsedPct": cpu_pct,
        "memUsed": used,
        "memTotal": total,
        "memCache": cache,
        "diskUsed": disk,
        "diskTotal": disk_total,
    }


def _unix(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise E2BError(400, f"{name}={raw!r} must be a Unix time in seconds") from None


def _started_after(raw: str | None) -> float | None:
    """``startedAfter`` (ISO 8601, as the SDKs send it) as a Unix time; naive is UTC."""
    if not raw:
        return None
    try:
        when = datetime.datetime.fromisoformat(raw.replace(" ", "+"))
    except ValueError:
        raise E2BError(400, f"startedAfter={raw!r} must be an ISO 8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def _filtered(request: web.Request) -> list[Sandbox]:
    """The caller's sandboxes as E2B lists them: newest first unless ``order=asc``, those
    started at or after ``startedAfter``, filtered by metadata, state and template."""
    query = request.query
    wanted: dict[str, str] = {}
    if query.get("metadata"):
        wanted = dict(urllib.parse.parse_qsl(query["metadata"], keep_blank_values=True))
    states = {s for s in query.get("state", "").split(",") if s}
    template = query.get("template")
    if states - {"running", "paused"}:
        raise E2BError(400, f"state={query['state']!r}: use running, paused or both, comma-separated")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise E2BError(400, f"order={order!r}: use asc (oldest first) or desc (newest first, the default)")
    after = _started_after(query.get("startedAfter"))
    owned = runtime(request).manager.owned(request[KEY_ID])
    out = []
    for sbx in sorted(owned, key=lambda s: s.record.created_at, reverse=order == "desc"):
        rec = sbx.record
        if rec.state not in (SandboxState.RUNNING, SandboxState.HIBERNATED, SandboxState.REPLACING):
            continue
        if after is not None and rec.created_at < after:
            continue
        state = "paused" if rec.state == SandboxState.HIBERNATED else "running"
        if states and state not in states:
            continue
        if any(rec.metadata.get(k) != v for k, v in wanted.items()):
            continue
        if template and our_template(request, template) != rec.template.split("@", 1)[0]:
            continue
        out.append(sbx)
    return out


@lifecycle_view
async def list_v1(request: web.Request) -> web.Response:
    return web.json_response([_describe(request, s) for s in _filtered(request)])


@lifecycle_view
async def list_v2(request: web.Request) -> web.Response:
    found = _filtered(request)
    page, headers = paginate(request, found, MAX_PAGE)
    return web.json_response([_describe(request, s) for s in page], headers=headers)


@lifecycle_view
async def kill(request: web.Request) -> web.Response:
    manager = runtime(request).manager
    await asyncio.shield(manager.delete(request[KEY_ID], request.match_info["sandbox_id"]))
    return web.Response(status=204)


@lifecycle_view
async def set_timeout(request: web.Request) -> web.Response:
    """A new timeout from now; 0 ends it now, as its timeout would (paused or killed)."""
    sbx = _sandbox(request)
    timeout = _timeout(await read_body(request), None, least=0)
    if timeout is None:
        raise E2BError(400, "timeout is required (seconds)")
    manager = runtime(request).manager
    if timeout > 0:
        manager.set_idle_timeout(sbx, timeout)
    elif sbx.record.state != SandboxState.HIBERNATED:
        await manager.expire(sbx)
    return web.Response(status=204)


@lifecycle_view
async def pause(request: web.Request) -> web.Response:
    """Pause: the whole VM saved. ``memory`` false (``mode="filesystem"``) keeps the files
    only: the kernel is restarted and the code contexts ended (variables, imports and processes
    gone) before the save."""
    sbx = _sandbox(request)
    memory = _memory(await read_body(request))
    if sbx.record.state == SandboxState.HIBERNATED:
        raise E2BError(409, f"sandbox {sbx.id} is already paused")
    manager = runtime(request).manager
    if not memory:
        await manager.contexts.stop_all(sbx)
        await manager.restart(sbx)
    await manager.hibernate(sbx)
    return web.Response(status=204)


@lifecycle_view
async def connect(request: web.Request) -> web.Response:
    """Connect (and resume a paused sandbox): it runs again when this answers. A ``timeout``
    only ever extends a running sandbox's end (E2B's rule), and sets a resumed one's;
    ``memory`` false (``on_resume="reboot"``) resumes a paused one with a fresh kernel."""
    sbx = _sandbox(request)
    body = await read_body(request)
    timeout, memory = _timeout(body, None), _memory(body)
    manager = runtime(request).manager
    was_paused = sbx.record.state == SandboxState.HIBERNATED
    end = sbx.record.last_active_at + sbx.record.idle_timeout_seconds
    await manager.wake(sbx)
    if was_paused and not memory:
        await manager.contexts.stop_all(sbx)
        await manager.restart(sbx)
    if timeout is not None and (was_paused or time.time() + timeout > end):
        manager.set_idle_timeout(sbx, timeout)
    return web.json_response(_describe(request, sbx, secrets=True), status=201 if was_paused else 200)


@lifecycle_view
async def update_network(request: web.Request) -> web.Response:
    """``update_network``: refused (a sandbox's network mode is set when it is made)."""
    _sandbox(request)  # another key's or an unknown sandbox: 404, as everywhere
    raise E2BError(
        501,
        "update_network (PUT /sandboxes/{id}/network) is not supported by kernelhost: a sandbox's "
        "network is fixed when it is made; create it with network={'allow_out': [...]} or "
        "allow_internet_access",
    )


@lifecycle_view
async def fork(request: web.Request) -> web.Response:
    """``count`` children from one freeze of the sandbox (ours: the fork), which runs on."""
    body = await read_body(request)
    count = body.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise E2BError(400, f"count={count!r} must be a whole number, at least 1")
    timeout = _timeout(body, None)
    manager = runtime(request).manager
    children = await manager.fork(request[KEY_ID], request.match_info["sandbox_id"], count)
    if timeout is not None:
        for child in children:
            manager.set_idle_timeout(child, timeout)
    return web.json_response([{"sandbox": _describe(request, c, secrets=True)} for c in children], status=201)


def unsupported(feature: str, status: int = 501) -> Any:
    @lifecycle_view
    async def view(request: web.Request) -> web.Response:
        raise E2BError(status, f"{feature} is not supported by kernelhost's E2B surface")

    return view


def add_routes(app: web.Application, prefix: str) -> None:
    r = app.router
    r.add_post(f"{prefix}/v2/sandboxes", create)
    r.add_post(f"{prefix}/sandboxes", create)
    r.add_get(f"{prefix}/sandboxes", list_v1)
    r.add_get(f"{prefix}/v2/sandboxes", list_v2)
    r.add_get(f"{prefix}/sandboxes/{{sandbox_id}}", get_sandbox)
    r.add_delete(f"{prefix}/sandboxes/{{sandbox_id}}", kill)
    r.add_post(f"{prefix}/sandboxes/{{sandbox_id}}/timeout", set_timeout)
    r.add_post(f"{prefix}/sandboxes/{{sandbox_id}}/refreshes", set_timeout)
    r.add_post(f"{prefix}/sandboxes/{{sandbox_id}}/pause", pause)
    r.add_post(f"{prefix}/sandboxes/{{sandbox_id}}/resume", connect)
    r.add_post(f"{prefix}/sandboxes/{{sandbox_id}}/connect", connect)
    r.add_post(f"{prefix}/sandboxes/{{sandbox_id}}/fork", fork)
    r.add_post(f"{prefix}/v2/sandboxes/{{sandbox_id}}/connect", connect)
    r.add_get(f"{prefix}/sandboxes/{{sandbox_id}}/metrics", metrics)
    r.add_put(f"{prefix}/sandboxes/{{sandbox_id}}/network", update_network)
    snapshots.add_routes(app, prefix)
    for path, feature in (
        ("/sandboxes/metrics", "metrics of several sandboxes at once (ask each sandbox's)"),
        ("/volumes", "volumes"),
        ("/volumes/{tail:.*}", "volumes"),
        ("/secrets", "secrets"),
        ("/templates", "template builds through E2B's builder (use POST /v1/templates)"),
        ("/templates/{tail:.*}", "template builds through E2B's builder (use POST /v1/templates)"),
        ("/v2/templates", "template builds through E2B's builder (use POST /v1/templates)"),
        ("/v3/templates", "template builds through E2B's builder (use POST /v1/templates)"),
    ):
        r.add_route("*", prefix + path, unsupported(feature))
