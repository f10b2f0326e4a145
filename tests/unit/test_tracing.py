"""Traces (docs/tracing.md): the service's HTTP app on the fake VM backend (``fake_backend.py``),
its spans caught by the OpenTelemetry SDK's in-memory exporter.

One server span per call, named by the route; the caller's ``traceparent`` makes it a child of
the caller's span; the stages a call goes through (the key's queue, a VM's launch, a wake, the
kernel's run, the stream out, a fork) are its children; with tracing off nothing is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kernelhost import tracing
from kernelhost.api import init_app
from kernelhost.api.auth import KeyRing, key_id
from kernelhost.api.state import KEYS, RUNTIME, SETTINGS
from kernelhost.sandboxes.vm.launched import Launched

from .fake_agent import WAIT, scripted, short_socket_dir, stream
from .fake_backend import FakeBackend, until
from .offline import fake_image_dir, offline_settings, on_backend

pytestmark = pytest.mark.unit
ApiClient = TestClient[web.Request, web.Application]

KEY = "unit-test-key-0123456789"
REPO = Path(__file__).resolve().parents[2]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on, into memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        yield exporter
    finally:
        tracing.disable()
        provider.shutdown()


@contextlib.asynccontextmanager
async def service(tmp_path: Path, **overrides: Any) -> AsyncIterator[tuple[ApiClient, FakeBackend]]:
    """The service's app (``init_app``: its middlewares and routes) with its manager on a
    ``FakeBackend`` instead of libvirt."""
    settings = offline_settings(
        tmp_path, image_dir=fake_image_dir(tmp_path), pool_size=0, api_keys=(KEY,), **overrides
    )
    app = init_app(settings)
    with short_socket_dir() as sockets:
        backend = FakeBackend(Path(sockets))
        start_vm = backend._start

        async def start_scripted(
            domain: str, state: dict[str, Any], meta: dict[str, str], how: str
        ) -> Launched:
            """Every fake VM (launched, woken, forked) runs a cell as ``print('hi')`` would."""
            launched = await start_vm(domain, state, meta, how)
            backend.vms[domain].agent.on_execute = scripted([stream("hi\n")])
            return launched

        backend._start = start_scripted  # type: ignore[method-assign]

        on_backend(app, settings, backend)
        assert app[SETTINGS] is settings and isinstance(app[KEYS], KeyRing)
        async with TestClient(TestServer(app)) as client:
            yield client, backend


def auth(**extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", **extra}


async def create(client: ApiClient, backend: FakeBackend, **headers: str) -> str:
    r = await client.post("/v1/sandboxes", json={}, headers=auth(**headers))
    assert r.status == 201, await r.text()
    sandbox_id: str = (await r.json())["id"]
    return sandbox_id


async def execute(client: ApiClient, sandbox_id: str, **headers: str) -> list[dict[str, Any]]:
    r = await client.post(
        f"/v1/sandboxes/{sandbox_id}/execute", json={"code": "print('hi')"}, headers=auth(**headers)
    )
    assert r.status == 200, await r.text()
    return [json.loads(line) for line in (await asyncio.wait_for(r.read(), WAIT)).splitlines()]


def servers(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def the(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = named(exporter, name)
    assert len(found) == 1, f"{name}: {[s.name for s in exporter.get_finished_spans()]}"
    return found[0]


# -- the server span ---------------------------------------------------------------------------


async def test_each_call_is_one_server_span_named_by_its_route(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    async with service(tmp_path) as (client, backend):
        sandbox_id = await create(client, backend)
        spans.clear()
        assert (await client.get(f"/v1/sandboxes/{sandbox_id}", headers=auth())).status == 200
        assert (await client.get("/v1/sandboxes/sbx_nope", headers=auth())).status == 404
        assert (await client.get("/v1/sandboxes", headers={"Authorization": "Bearer wrong"})).status == 401
    got = servers(spans)
    assert [s.name for s in got] == [
        "GET /v1/sandboxes/{sandbox_id}",
        "GET /v1/sandboxes/{sandbox_id}",
        "GET /v1/sandboxes",
    ]
    assert [s.attributes["http.response.status_code"] for s in got] == [200, 404, 401]  # type: ignore[index]
    found, missing, refused = (dict(s.attributes or {}) for s in got)
    assert found["http.route"] == "/v1/sandboxes/{sandbox_id}" and found["http.request.method"] == "GET"
    assert found["kernelhost.sandbox_id"] == sandbox_id and missing["kernelhost.sandbox_id"] == "sbx_nope"
    assert found["kernelhost.key_id"] == key_id(KEY) and "kernelhost.key_id" not in refused
    every_value = [str(v) for s in spans.get_finished_spans() for v in (s.attributes or {}).values()]
    assert not [v for v in every_value if KEY in v], "the API key itself is never in a span"
    assert all(s.parent is None for s in got), "no traceparent: each call starts a trace"


async def test_a_create_span_names_the_new_sandbox(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    async with service(tmp_path) as (client, backend):
        sandbox_id = await create(client, backend)
    call = the(spans, "POST /v1/sandboxes")
    assert call.attributes is not None and call.attributes["kernelhost.sandbox_id"] == sandbox_id
    assert call.attributes["http.response.status_code"] == 201


async def test_the_callers_traceparent_makes_the_call_its_child(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    async with service(tmp_path) as (client, backend):
        await create(client, backend, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
        await create(client, backend, traceparent="00-not-a-valid-one-01")
    given, invalid = servers(spans)
    assert given.context is not None and f"{given.context.trace_id:032x}" == TRACE_ID
    assert given.parent is not None and f"{given.parent.span_id:016x}" == PARENT_ID and given.parent.is_remote
    assert invalid.parent is None and invalid.context is not None
    assert f"{invalid.context.trace_id:032x}" != TRACE_ID  # a new trace, not a broken one


# -- the stages --------------------------------------------------------------------------------


async def test_a_creates_stages_nest_under_its_call(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    async with service(tmp_path) as (client, backend):
        sandbox_id = await create(client, backend)
    call, created, launched = (the(spans, n) for n in ("POST /v1/sandboxes", "sandbox.create", "vm.launch"))
    assert call.context is not None and created.context is not None
    assert parent_of(created) == call.context.span_id and parent_of(launched) == created.context.span_id
    assert created.attributes is not None and created.attributes["kernelhost.how"] == "clone"
    assert created.attributes["kernelhost.sandbox_id"] == sandbox_id
    assert {s.context.trace_id for s in spans.get_finished_spans() if s.context} == {call.context.trace_id}


async def test_a_pool_hand_over_is_a_stage_of_the_create(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    async with service(tmp_path) as (client, backend):
        manager = client.app[RUNTIME].manager
        await backend.add_clone("python", manager._ctx.images.get("python"))
        await create(client, backend)
    created, handed = the(spans, "sandbox.create"), the(spans, "sandbox.pool_handover")
    assert created.context is not None and parent_of(handed) == created.context.span_id
    assert created.attributes is not None and created.attributes["kernelhost.how"] == "pool"
    assert not named(spans, "vm.launch")


async def test_an_executes_stages_nest_under_its_call(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    async with service(tmp_path) as (client, backend):
        sandbox_id = await create(client, backend)
        assert (await client.post(f"/v1/sandboxes/{sandbox_id}/hibernate", headers=auth())).status == 200
        spans.clear()
        events = await execute(client, sandbox_id, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
    assert events[0] == {"type": "stdout", "text": "hi\n"} and events[-1]["type"] == "end"
    call = the(spans, "POST /v1/sandboxes/{sandbox_id}/execute")
    assert call.context is not None
    for stage in ("sandbox.wake", "kernel.execute", "execute.stream"):
        assert parent_of(the(spans, stage)) == call.context.span_id, stage
    kernel, streamed = the(spans, "kernel.execute"), the(spans, "execute.stream")
    assert kernel.attributes is not None and kernel.attributes["kernelhost.status"] == "ok"
    assert streamed.attributes is not None and streamed.attributes["kernelhost.events"] == len(events)
    assert {f"{s.context.trace_id:032x}" for s in spans.get_finished_spans() if s.context} == {TRACE_ID}
    wake = the(spans, "sandbox.wake")
    assert wake.end_time is not None and kernel.start_time is not None
    assert wake.end_time <= kernel.start_time, "the wake comes before the kernel runs"


async def test_a_wait_in_the_keys_queue_is_a_stage_of_the_create(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    async with service(tmp_path, max_sandboxes_per_key=1, create_queue_seconds=WAIT) as (client, backend):
        first = await create(client, backend)
        second = asyncio.ensure_future(create(client, backend))
        manager = client.app[RUNTIME].manager
        await until(lambda: bool(manager._ctx.registry._queues))
        assert (await client.delete(f"/v1/sandboxes/{first}", headers=auth())).status == 204
        await asyncio.wait_for(second, WAIT)
    queued = the(spans, "sandbox.queue")
    creates = named(spans, "sandbox.create")
    assert parent_of(queued) in {c.context.span_id for c in creates if c.context}
    assert queued.attributes is not None and queued.attributes["kernelhost.position"] == 1


async def test_a_forks_stages_nest_under_its_call(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    async with service(tmp_path) as (client, backend):
        sandbox_id = await create(client, backend)
        r = await client.post(f"/v1/sandboxes/{sandbox_id}/fork", json={"n": 2}, headers=auth())
        assert r.status == 201, await r.text()
    call, forked, vm = (
        the(spans, n) for n in ("POST /v1/sandboxes/{sandbox_id}/fork", "sandbox.fork", "vm.fork")
    )
    assert call.context is not None and forked.context is not None
    assert parent_of(forked) == call.context.span_id and parent_of(vm) == forked.context.span_id
    assert forked.attributes is not None and forked.attributes["kernelhost.children"] == 2


# -- tracing off -------------------------------------------------------------------------------


async def test_with_tracing_off_no_span_is_made(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # a provider exists, as in an application that traces, but
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # the service was not told to
    assert not tracing.enabled()
    async with service(tmp_path) as (client, backend):
        sandbox_id = await create(client, backend, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
        await execute(client, sandbox_id)
    assert exporter.get_finished_spans() == ()
    provider.shutdown()


def test_with_tracing_off_a_stage_costs_one_shared_no_op() -> None:
    assert not tracing.enabled()
    first, second = tracing.span("a", sandbox_id="x"), tracing.detached_span("b")
    assert first is second is tracing.server_span("c", {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    with first as inside:
        assert inside is None
    headers = {"traceparent": "passed-on"}
    tracing.inject(headers)
    assert headers == {"traceparent": "passed-on"}, "a node that does not trace passes the caller's on"


def test_tracing_is_off_unless_the_environment_asks_and_loads_no_sdk_then() -> None:
    code = (
        "import json, sys\n"
        "from kernelhost import tracing\n"
        "import kernelhost.api\n"
        "on = [tracing.setup(env=e) for e in ({}, {'OTEL_TRACES_EXPORTER': 'none'},"
        " {'OTEL_TRACES_EXPORTER': 'otlp', 'OTEL_SDK_DISABLED': 'true'})]\n"
        "print(json.dumps([on, sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk'))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[False, False, False], []]


def test_setup_reads_the_otel_variables() -> None:
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    try:
        assert tracing.setup("1.2.3", "node-a", env=env)
        provider = tracing._provider
        assert provider is not None
        attributes = provider.resource.attributes
        assert attributes["service.name"] == "kernelhost" and attributes["service.instance.id"] == "node-a"
        assert attributes["service.version"] == "1.2.3"
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


@pytest.mark.parametrize(
    "env, says",
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "zipkin is not an exporter kernelhost has"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json'",
        ),
    ],
)
def test_an_exporter_or_protocol_kernelhost_lacks_is_refused_by_name(env: dict[str, str], says: str) -> None:
    with pytest.raises(tracing.TracingConfigError, match=says.replace("(", r"\(")):
        tracing.setup(env=env)
    assert not tracing.enabled()


def test_a_log_line_inside_a_span_names_its_trace(spans: InMemorySpanExporter) -> None:
    from kernelhost import logs

    assert logs._trace_context(None, "info", {"event": "outside"}) == {"event": "outside"}
    with tracing.span("sandbox.wake") as inside:
        line = logs._trace_context(None, "info", {"event": "sandbox.woken"})
    context = inside.get_span_context()
    assert line == {
        "event": "sandbox.woken",
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
    }
