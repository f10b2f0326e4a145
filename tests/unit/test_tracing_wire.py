"""The trace context on the wire (docs/tracing.md): the SDK sends the caller's ``traceparent``
when the application has OpenTelemetry and a span is current, and nothing otherwise; a call
one node forwards to another carries that node's span, so both nodes' spans are one trace."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kernelhost import AsyncSandbox, Sandbox, tracing
from kernelhost.api.cluster.forward import forward, new_session
from kernelhost.api.middleware import trace_middleware

from .client_fake import KEY, FakeKernelHost
from .offline import serving, serving_in_thread

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """An application's tracer provider (not the process-wide one: the SDK must find the span
    through the context alone)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def traceparent_of(span: trace.Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


@pytest.fixture
async def fake() -> AsyncIterator[FakeKernelHost]:
    server = FakeKernelHost()
    async with serving(server):
        yield server


# -- the SDK -------------------------------------------------------------------------------------


async def test_the_sdk_sends_the_current_spans_traceparent(
    fake: FakeKernelHost, provider: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    tracer = provider[0].get_tracer("app")
    with tracer.start_as_current_span("agent step") as step:
        async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
            await sbx.run_code("1+1")
    expected = traceparent_of(step)
    assert [h.get("traceparent") for h in fake.headers] == [expected] * 3  # create, execute, delete
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:  # no span current: no header
        await sbx.run_code("1+1")
    assert [h for h in fake.headers[3:] if "traceparent" in {k.lower() for k in h}] == []


def test_the_sync_sdk_sends_the_callers_traceparent_from_its_loop_thread(
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    server = FakeKernelHost()
    with serving_in_thread(server):
        with provider[0].get_tracer("app").start_as_current_span("notebook cell") as cell:
            with Sandbox(url=server.url, api_key=KEY) as sbx:
                assert sbx.run_code("1+1").text == "2"
        assert [h.get("traceparent") for h in server.headers] == [traceparent_of(cell)] * 3


def test_without_opentelemetry_the_sdk_sends_no_trace_context() -> None:
    code = (
        "import importlib.abc, json, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.partition('.')[0] == 'opentelemetry':\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from kernelhost.client._http import trace_headers\n"
        "print(json.dumps(trace_headers()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {}


# -- between nodes -------------------------------------------------------------------------------


@dataclass
class Peer:
    """The node that holds the sandbox: records the headers of what reaches it."""

    app: web.Application = field(default_factory=lambda: web.Application(middlewares=[trace_middleware]))
    url: str = ""
    headers: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.app.router.add_post("/v1/sandboxes/{sandbox_id}/execute", self.execute)

    async def execute(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        return web.json_response({"ok": True})


@dataclass
class Node:
    """The node the client called: forwards the call to the peer."""

    peer: Peer
    app: web.Application = field(default_factory=lambda: web.Application(middlewares=[trace_middleware]))
    url: str = ""

    def __post_init__(self) -> None:
        self.app.router.add_post("/v1/sandboxes/{sandbox_id}/execute", self.execute)

    async def execute(self, request: web.Request) -> web.StreamResponse:
        async with new_session() as session:
            return await forward(session, request, self.peer.url, lambda binding: {}, b"{}")


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[Node]:
    peer = Peer()
    node = Node(peer)
    async with serving(peer), serving(node):
        yield node


async def _call(node: Node) -> None:
    async with new_session() as session:
        url = f"{node.url}/v1/sandboxes/sbx_1/execute"
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
        async with session.post(url, data=b"{}", headers=headers) as resp:
            assert resp.status == 200, await resp.text()


async def test_a_forwarded_call_joins_both_nodes_spans_in_one_trace(
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    tracing.enable(provider[0])
    try:
        async with cluster() as node:
            await _call(node)
    finally:
        tracing.disable()
    spans = provider[1].get_finished_spans()
    calls = [s for s in spans if s.kind == SpanKind.SERVER]
    hops = [s for s in spans if s.name == "cluster.forward"]
    assert len(calls) == 2 and len(hops) == 1 and hops[0].kind == SpanKind.CLIENT
    hop = hops[0]
    # the client's span -> the node's call -> the hop -> the peer's call, one trace
    first = next(s for s in calls if s.parent and f"{s.parent.span_id:016x}" == PARENT_ID)
    second = next(s for s in calls if s is not first)
    assert first.context is not None and hop.context is not None
    assert parent_of(hop) == first.context.span_id and parent_of(second) == hop.context.span_id
    assert {f"{s.context.trace_id:032x}" for s in spans if s.context} == {TRACE_ID}
    sent = node.peer.headers[0]["traceparent"]
    assert sent.startswith(f"00-{TRACE_ID}-{hop.context.span_id:016x}-")


async def test_a_node_that_does_not_trace_passes_the_callers_traceparent_on() -> None:
    assert not tracing.enabled()
    async with cluster() as node:
        await _call(node)
    assert node.peer.headers[0]["traceparent"] == f"00-{TRACE_ID}-{PARENT_ID}-01"
