"""Each sandbox's CPU, memory and disk over time (the sampler's rings, ``sandboxes/sampler.py``):
``GET /v1/sandboxes/{id}/metrics`` for its owner, ``GET /metrics/sandboxes`` (Prometheus text,
the last sample of every sandbox of this node) for an operator key only: its labels carry
sandbox and key ids, which the public ``/metrics`` never does."""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from ...metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ...metrics import render_usage
from ...sandboxes import InvalidRequest, Sample, iso_time
from ..cluster import is_operator
from ..errors import error_response
from .requests import runtime, sandbox

usage_routes = web.RouteTableDef()


@usage_routes.get("/v1/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(request: web.Request) -> web.Response:
    """The sandbox's samples from ``start`` to ``end`` (Unix seconds, both optional), oldest
    first; ``interval_seconds`` 0: the service takes none (``sandbox_metrics_interval``)."""
    sbx = sandbox(request)
    start, end = (unix_param(request, name) for name in ("start", "end"))
    sampler = runtime(request).manager.sampler
    samples = sampler.samples(sbx.id, start, end)
    return web.json_response(
        {"interval_seconds": sampler.interval, "samples": [sample_view(s) for s in samples]}
    )


@usage_routes.get("/metrics/sandboxes")
async def operator_metrics(request: web.Request) -> web.Response:
    """Prometheus text: the last sample of every sandbox of this node, by sandbox id, key id
    and template (a key's own: its name, as ``sandbox_view``); an operator key only."""
    if not is_operator(request):
        return error_response(
            403,
            "forbidden",
            "/metrics/sandboxes needs an operator key (operator_keys, KERNELHOST_OPERATOR_KEYS): "
            "its labels name every tenant's sandboxes; the public /metrics has the counts",
        )
    rows = [
        ((sbx.id, sbx.record.owner, sbx.record.template.split("@", 1)[0]), sample)
        for sbx, sample in runtime(request).manager.sampler.latest()
    ]
    return web.Response(body=render_usage(rows), headers={"Content-Type": METRICS_CONTENT_TYPE})


def unix_param(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidRequest(f"{name}={raw[:40]!r} must be a Unix time in seconds", field=name)
    return value


def sample_view(s: Sample) -> dict[str, Any]:
    """One sample as the native API shows it (null: the guest did not answer that time)."""

    def guest(value: int) -> int | None:
        return value if value >= 0 else None

    return {
        "timestamp": iso_time(s.timestamp),
        "timestamp_unix": s.timestamp,
        "cpu_count": s.cpu_count,
        "cpu_used_pct": s.cpu_used_pct if s.cpu_used_pct >= 0 else None,
        "cpu_seconds": round(s.cpu_ns / 1e9, 3),
        "host_memory_bytes": s.host_rss,
        "mem_total": guest(s.mem_total),
        "mem_used": guest(s.mem_used),
        "mem_cache": guest(s.mem_cache),
        "disk_used": guest(s.disk_used),
        "disk_total": guest(s.disk_total),
    }
