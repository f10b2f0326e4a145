"""``/metrics``: Prometheus text that the client library's parser reads, moving with the work.

The HTTP part runs on libvirt's test driver (a create there fails to boot, which is counted);
the hooks the manager calls are checked on a ``Metrics`` of their own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from kernelhost.api import init_app
from kernelhost.metrics import Metrics, StateCollector

from .offline import fake_image_dir, offline_settings

pytestmark = pytest.mark.unit

KEY = "unit-test-key-0123456789"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    settings = offline_settings(
        tmp_path,
        image_dir=fake_image_dir(tmp_path),
        domain_prefix="khmetrics-",
        boot_timeout=1.0,
        pool_size=0,
        api_keys=(KEY,),
    )
    async with TestClient(TestServer(init_app(settings))) as c:
        yield c


async def test_metrics_is_public_prometheus_text(client: TestClient[web.Request, web.Application]) -> None:
    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(await r.text())}
    assert {
        "kernelhost_sandboxes",
        "kernelhost_pool_ready",
        "kernelhost_pool_hits",
        "kernelhost_pool_misses",
        "kernelhost_vms",
        "kernelhost_sandbox_create_seconds",
        "kernelhost_execute_seconds",
        "kernelhost_relayed_bytes",
        "kernelhost_kernel_deaths",
        "kernelhost_execution_timeouts",
    } <= names
    assert value(await r.text(), "kernelhost_vms", accel="tcg") == 0


async def test_a_failed_create_is_counted(client: TestClient[web.Request, web.Application]) -> None:
    before = await (await client.get("/metrics")).text()
    r = await client.post(
        "/v1/sandboxes", json={"template": "python"}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status == 503
    after = await (await client.get("/metrics")).text()
    name = "kernelhost_sandbox_create_failures_total"
    assert value(after, name, template="python") == value(before, name, template="python") + 1


def test_hooks_move_the_counters() -> None:
    m = Metrics()
    m.observe_create("python", "pool", 0.004)
    m.observe_fork("python", 3, 1.5)
    m.observe_wake("python", 0.8)
    m.observe_end("python", "ok", None, 0.05)
    m.observe_end("python", "timeout", "interrupted", 2)
    m.observe_end("bash", "timeout", "vm_replaced", 9)
    m.count_kernel_death("kernel")
    m.count_relayed("execute", "out", 120)
    text = m.render().decode()
    assert value(text, "kernelhost_sandbox_create_seconds_count", template="python", how="pool") == 1
    assert (
        value(text, "kernelhost_sandbox_create_seconds_bucket", template="python", how="pool", le="0.005")
        == 1
    )
    assert value(text, "kernelhost_sandbox_forked_children_total", template="python") == 3
    assert value(text, "kernelhost_sandbox_wake_seconds_count", template="python") == 1
    assert value(text, "kernelhost_execute_seconds_count", language="python") == 2
    assert value(text, "kernelhost_executions_total", language="python", status="ok") == 1
    assert value(text, "kernelhost_execution_timeouts_total", rung="interrupted") == 1
    assert value(text, "kernelhost_execution_timeouts_total", rung="vm_replaced") == 1
    assert value(text, "kernelhost_kernel_deaths_total", cause="kernel") == 1
    assert value(text, "kernelhost_relayed_bytes_total", kind="execute", direction="out") == 120


def test_state_is_read_from_the_manager_at_scrape_time() -> None:
    class Pool:
        size, hits, misses = 2, 5, 1

        def ready(self, template: str) -> int:
            return {"python": 2, "python-datasci": 1}[template]

    def sbx(state: str, template: str = "python") -> SimpleNamespace:
        return SimpleNamespace(record=SimpleNamespace(state=state, template=template, accel="tcg"))

    sandboxes = {
        "a": sbx("running"),
        "b": sbx("running"),
        "c": sbx("hibernated"),
        "d": sbx("running", "python-datasci"),
    }
    manager = SimpleNamespace(
        all=lambda: list(sandboxes.values()),
        accel="tcg",
        pool=Pool(),
        templates=lambda: ["python", "python-datasci"],
    )
    m = Metrics()
    m.registry.register(StateCollector(manager))
    text = m.render().decode()
    assert value(text, "kernelhost_sandboxes", state="running", template="python") == 2
    assert value(text, "kernelhost_sandboxes", state="hibernated", template="python") == 1
    assert value(text, "kernelhost_pool_ready", template="python") == 2
    assert value(text, "kernelhost_pool_target") == 2
    assert value(text, "kernelhost_pool_hits_total") == 5
    assert value(text, "kernelhost_pool_misses_total") == 1
    assert value(text, "kernelhost_vms", accel="tcg") == 3 + 3  # sandboxes + pooled clones
    sandboxes.pop("a")
    assert value(m.render().decode(), "kernelhost_sandboxes", state="running", template="python") == 1


async def test_console_page_is_public_under_a_strict_policy(
    client: TestClient[web.Request, web.Application],
) -> None:
    """The web console (``/``) shares this file: its three files need no key."""
    for path, kind in (("/", "text/html"), ("/console.js", "text/javascript"), ("/console.css", "text/css")):
        r = await client.get(path)
        assert r.status == 200 and r.content_type == kind, path
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    assert 'src="/console.js"' in await (await client.get("/")).text()
    assert (await client.get("/favicon.ico")).status == 401  # nothing else opens up
