"""The usage sampler (``sandboxes/sampler.py``) on the fake backend: bounded rings, gone with
their sandbox, a task that stops when the service does; its endpoints: a sandbox's samples for
its owner, ``/metrics/sandboxes`` for an operator key only, ids never on the public ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from kernelhost.api import init_app
from kernelhost.api.auth import key_id
from kernelhost.config import ConfigError, Settings
from kernelhost.sandboxes import SandboxManager
from kernelhost.sandboxes.sampler import UNKNOWN, parse_meminfo

from .fake_agent import short_socket_dir
from .fake_backend import FakeBackend, until
from .offline import fake_image_dir, offline_settings, on_backend

pytestmark = pytest.mark.unit
ApiClient = TestClient[web.Request, web.Application]

KEY = "unit-test-key-0123456789"
OTHER = "unit-test-other-key-abcdefgh"
OPERATOR = "unit-test-operator-key-9876543210"
MEMINFO = (
    b"MemTotal:        1000000 kB\nMemFree:          100000 kB\nMemAvailable:     600000 kB\n"
    b"Buffers:            1000 kB\nCached:            99000 kB\nShmem:             50000 kB\n"
)


@contextlib.asynccontextmanager
async def service(
    tmp_path: Path, **overrides: Any
) -> AsyncIterator[tuple[ApiClient, FakeBackend, SandboxManager]]:
    """``init_app`` with its manager on a ``FakeBackend`` whose agents answer ``/proc/meminfo``."""
    values: dict[str, Any] = dict(pool_size=0, api_keys=(KEY, OTHER), operator_keys=(OPERATOR,))
    values.update(overrides)
    settings = offline_settings(tmp_path, image_dir=fake_image_dir(tmp_path), **values)
    app = init_app(settings)
    with short_socket_dir() as sockets:
        backend = FakeBackend(Path(sockets))
        start_vm = backend._start

        async def start_reading(domain: str, state: dict[str, Any], meta: dict[str, str], how: str) -> Any:
            launched = await start_vm(domain, state, meta, how)
            backend.vms[domain].agent.reply_fields["fs_read"] = {"data": MEMINFO, "size": 0}
            return launched

        backend._start = start_reading  # type: ignore[method-assign]
        managers = on_backend(app, settings, backend)
        async with TestClient(TestServer(app)) as client:
            yield client, backend, managers[0]


def bearer(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def create(client: ApiClient) -> str:
    r = await client.post("/v1/sandboxes", json={"template": "python"}, headers=bearer())
    assert r.status == 201, await r.text()
    return str((await r.json())["id"])


def test_the_interval_is_checked() -> None:
    for bad in (-1, 0.1, 4000, math.nan):
        fix = r"sandbox_metrics_interval has value .*or 0 to take no samples"
        with pytest.raises(ConfigError, match=fix):
            Settings(sandbox_metrics_interval=bad).validate()
    for good in (0, 0.5, 5, 60):
        Settings(sandbox_metrics_interval=good).validate()


def test_meminfo_is_checked() -> None:
    g = parse_meminfo(MEMINFO)
    assert (g.mem_total, g.mem_used, g.mem_cache, g.shmem) == (
        1000000 * 1024,
        400000 * 1024,
        100000 * 1024,
        50000 * 1024,
    )
    for bad in (None, "MemTotal: 1 kB", b"", b"MemTotal: lots kB\nMemAvailable: 1 kB\n"):
        with pytest.raises((ValueError, KeyError)):
            parse_meminfo(bad)
    lying = parse_meminfo(b"MemTotal: 10 kB\nMemAvailable: 99 kB\nShmem: 999999 kB\nCached: 99999 kB\n")
    assert lying.mem_used == 0 and lying.shmem == lying.mem_cache == lying.mem_total == 10240


async def test_rings_are_bounded_measure_cpu_and_go_with_their_sandbox(tmp_path: Path) -> None:
    async with service(tmp_path, sandbox_metrics_interval=0) as (client, backend, manager):
        sampler = manager.sampler
        sampler.keep = 3
        sandbox_id = await create(client)
        vm = backend.vms[manager.find(sandbox_id).record.domain]  # type: ignore[union-attr]
        for _ in range(5):
            vm.cpu_ns += 50_000_000
            assert await sampler.sample() == 1
            await asyncio.sleep(0.1)
        samples = sampler.samples(sandbox_id)
        assert len(samples) == 3 and samples[0].timestamp < samples[-1].timestamp
        last = samples[-1]
        assert last.cpu_ns == 250_000_000 and last.cpu_count == 1 and last.host_rss == 64 << 20
        assert 0 < last.cpu_used_pct <= 100 and last.complete
        assert (last.mem_total, last.mem_used, last.disk_used) == (
            1000000 * 1024,
            400000 * 1024,
            50000 * 1024,
        )
        assert last.disk_total == last.mem_total // 2  # no writable_mib: the guest's default
        assert sampler.samples(sandbox_id, start=last.timestamp) == [last]
        assert sampler.samples(sandbox_id, end=samples[0].timestamp) == [samples[0]]

        # a guest that does not answer: the host's figures, the guest's unknown
        vm.agent.replies["fs_read"] = "error"
        await sampler.sample()
        unread = sampler.samples(sandbox_id)[-1]
        assert unread.mem_total == unread.disk_used == UNKNOWN and not unread.complete
        assert unread.cpu_ns == 250_000_000

        r = await client.delete(f"/v1/sandboxes/{sandbox_id}", headers=bearer())
        assert r.status in (200, 204)
        assert sampler.samples(sandbox_id) == [] and sampler.latest() == []  # at once for readers
        assert await sampler.sample() == 0
        assert len(sampler) == 0  # and its ring is gone at the next pass


async def test_the_sampler_runs_in_the_background_and_stops_with_the_service(tmp_path: Path) -> None:
    async with service(tmp_path, sandbox_metrics_interval=0.5) as (client, _backend, manager):
        task = next(t for t in manager._background if t.get_name() == "usage-sampler")
        sandbox_id = await create(client)
        await until(lambda: len(manager.sampler.samples(sandbox_id)) >= 2, timeout=10)
        assert not task.done()
    assert task.cancelled()  # the manager's close cancelled it (and waited for it)
    async with service(tmp_path / "off", sandbox_metrics_interval=0) as (_client, _backend, manager):
        assert not manager.sampler.enabled
        assert all(t.get_name() != "usage-sampler" for t in manager._background)


async def test_operator_endpoint_needs_an_operator_key_and_public_metrics_carry_no_ids(
    tmp_path: Path,
) -> None:
    async with service(tmp_path, sandbox_metrics_interval=0) as (client, _backend, manager):
        sandbox_id = await create(client)
        await manager.sampler.sample()
        assert (await client.get("/metrics/sandboxes")).status == 401
        refused = await client.get("/metrics/sandboxes", headers=bearer())
        assert refused.status == 403 and "operator" in (await refused.json())["error"]["message"]

        r = await client.get("/metrics/sandboxes", headers=bearer(OPERATOR))
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
        assert (
            "# HELP kernelhost_sandbox_cpu_seconds_total" in text
            and "# TYPE kernelhost_sandbox_cpu_seconds_total counter" in text
        )
        assert KEY not in text and OPERATOR not in text
        found = {
            (s.name, s.labels["sandbox_id"], s.labels["key_id"], s.labels["template"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        labels = (sandbox_id, key_id(KEY), "python")
        assert found[("kernelhost_sandbox_memory_used_bytes", *labels)] == 400000 * 1024
        assert found[("kernelhost_sandbox_disk_used_bytes", *labels)] == 50000 * 1024
        assert found[("kernelhost_sandbox_host_memory_bytes", *labels)] == 64 << 20
        assert ("kernelhost_sandbox_cpu_seconds_total", *labels) in found

        public = await (await client.get("/metrics")).text()
        assert sandbox_id not in public and key_id(KEY) not in public
        assert "kernelhost_sampler_pass_seconds_count 1.0" in public

        await client.delete(f"/v1/sandboxes/{sandbox_id}", headers=bearer())
        after = await (await client.get("/metrics/sandboxes", headers=bearer(OPERATOR))).text()
        assert sandbox_id not in after


async def test_owner_reads_its_samples_natively_and_through_e2b(tmp_path: Path) -> None:
    async with service(tmp_path, sandbox_metrics_interval=0) as (client, backend, manager):
        sandbox_id = await create(client)
        vm = backend.vms[manager.find(sandbox_id).record.domain]  # type: ignore[union-attr]
        for _ in range(3):
            vm.cpu_ns += 10_000_000
            await manager.sampler.sample()
            await asyncio.sleep(0.05)
        r = await client.get(f"/v1/sandboxes/{sandbox_id}/metrics", headers=bearer())
        assert r.status == 200
        body = await r.json()
        assert body["interval_seconds"] == 0 and len(body["samples"]) == 3
        first, last = body["samples"][0], body["samples"][-1]
        assert first["cpu_used_pct"] is None and last["cpu_used_pct"] >= 0
        assert last["mem_used"] == 400000 * 1024 and last["disk_used"] == 50000 * 1024
        assert last["cpu_seconds"] == 0.03 and last["host_memory_bytes"] == 64 << 20
        since = await client.get(
            f"/v1/sandboxes/{sandbox_id}/metrics?start={last['timestamp_unix']}", headers=bearer()
        )
        assert len((await since.json())["samples"]) == 1
        bad = await client.get(f"/v1/sandboxes/{sandbox_id}/metrics?start=soon", headers=bearer())
        assert bad.status == 400
        assert (await client.get(f"/v1/sandboxes/{sandbox_id}/metrics", headers=bearer(OTHER))).status == 404

        e2b = await client.get(f"/e2b/sandboxes/{sandbox_id}/metrics", headers={"X-API-Key": KEY})
        assert e2b.status == 200, await e2b.text()
        entries = await e2b.json()
        assert len(entries) == 2  # the first sample of a VM has no CPU percentage yet
        assert set(entries[-1]) == {
            "timestamp",
            "timestampUnix",
            "cpuCount",
            "cpuUsedPct",
            "memUsed",
            "memTotal",
            "memCache",
            "diskUsed",
            "diskTotal",
        }
        assert entries[-1]["diskUsed"] == 50000 * 1024
        later = int(time.time()) + 60
        none = await client.get(
            f"/e2b/sandboxes/{sandbox_id}/metrics?start={later}", headers={"X-API-Key": KEY}
        )
        assert await none.json() == []


async def test_the_sdk_reads_the_samples(tmp_path: Path) -> None:
    from kernelhost import AsyncSandbox, Sandbox, SandboxMetrics

    async with service(tmp_path, sandbox_metrics_interval=0) as (client, backend, manager):
        sandbox_id = await create(client)
        vm = backend.vms[manager.find(sandbox_id).record.domain]  # type: ignore[union-attr]
        for _ in range(2):
            vm.cpu_ns += 20_000_000
            await manager.sampler.sample()
            await asyncio.sleep(0.05)
        sbx = await AsyncSandbox.connect(sandbox_id, url=str(client.make_url("")), api_key=KEY)
        try:
            first, last = await sbx.get_metrics()
            assert isinstance(last, SandboxMetrics) and first.timestamp < last.timestamp
            assert first.cpu_used_pct is None and last.cpu_used_pct is not None
            assert (last.mem_used, last.disk_used, last.cpu_seconds) == (400000 * 1024, 50000 * 1024, 0.04)
            assert await sbx.get_metrics(start=last.timestamp) == [last]
            assert await sbx.get_metrics(end=first.timestamp.timestamp()) == [first]
            with pytest.raises(ValueError, match="start must be a datetime or a Unix time"):
                await sbx.get_metrics(start="yesterday")  # type: ignore[arg-type]
        finally:
            await sbx.detach()
    assert Sandbox.get_metrics.__doc__ == AsyncSandbox.get_metrics.__doc__
