"""Traces from a real service (docs/tracing.md): ``kernelhost serve`` with ``OTEL_*`` pointing at
an OTLP/HTTP receiver this test runs, a sandbox created and a cell run through the SDK under the
test's own span. The spans that arrive are one trace, child of the test's span, and the execute
call's span has the kernel's run of the cell as a child."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider

from kernelhost import AsyncSandbox

from ..harness import running_service
from ..unit.offline import serving

pytestmark = pytest.mark.vm

CREATE = "POST /v1/sandboxes"
EXECUTE = "POST /v1/sandboxes/{sandbox_id}/execute"
DELETE = "DELETE /v1/sandboxes/{sandbox_id}"
ARRIVAL_SECONDS = 30.0  # the service exports every 200 ms (OTEL_BSP_SCHEDULE_DELAY)


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    service: str
    attributes: dict[str, str]


@dataclass
class Receiver:
    """An OTLP/HTTP trace receiver (what a collector's port 4318 does), keeping what arrives."""

    app: web.Application = field(default_factory=web.Application)
    url: str = ""
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.app.router.add_post("/v1/traces", self.traces)

    async def traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.read())
        with self.lock:
            for resource in export.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        self.spans.append(
                            Span(
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                attributes.get("service.name", ""),
                                {a.key: a.value.string_value for a in s.attributes},
                            )
                        )
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    def received(self) -> list[Span]:
        with self.lock:
            return list(self.spans)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """The receiver on a loop of its own: it must answer while the test blocks (the service's
    start and stop are waited for synchronously)."""
    recv = Receiver()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="otlp-receiver", daemon=True)
    thread.start()
    served = serving(recv)
    asyncio.run_coroutine_threadsafe(served.__aenter__(), loop).result(10)
    try:
        yield recv
    finally:
        asyncio.run_coroutine_threadsafe(served.__aexit__(None, None, None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _arrived(receiver: Receiver, trace_id: str, names: set[str]) -> list[Span]:
    deadline = time.monotonic() + ARRIVAL_SECONDS
    while time.monotonic() < deadline:
        mine = [s for s in receiver.received() if s.trace_id == trace_id]
        if names <= {s.name for s in mine}:
            return mine
        await asyncio.sleep(0.2)
    got = sorted({(s.name, s.trace_id) for s in receiver.received()})
    raise AssertionError(f"spans {sorted(names)} of trace {trace_id} did not arrive; got {got}")


@pytest.mark.timeout(600)
async def test_an_execute_is_one_trace_with_the_kernels_run_in_it(tmp_path: Path, receiver: Receiver) -> None:
    with running_service(
        tmp_path,
        "tracing",
        # one VM: no pool, so the create launches it (a clone of the python template's snapshot,
        # shared with the services before this one; built by this create when run alone)
        KERNELHOST_POOL_SIZE="0",
        KERNELHOST_BOOT_TIMEOUT="300",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{receiver.url}/v1/traces",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME="kernelhost-vm-test",
        OTEL_BSP_SCHEDULE_DELAY="200",
    ) as svc:
        provider = TracerProvider()  # the test's own: its span is the caller's
        try:
            with provider.get_tracer("test").start_as_current_span("agent turn") as turn:
                async with AsyncSandbox(
                    template="python", url=svc.url, api_key=svc.api_key, timeout=360
                ) as sbx:
                    assert (await sbx.run_code("print(6 * 7)")).stdout == "42\n"
                    sandbox_id = sbx.id
        finally:
            provider.shutdown()
        trace_id = f"{turn.get_span_context().trace_id:032x}"
        caller = f"{turn.get_span_context().span_id:016x}"
        names = {CREATE, "sandbox.create", "vm.launch", EXECUTE, "kernel.execute", "execute.stream", DELETE}
        spans = await _arrived(receiver, trace_id, names)
    assert {s.service for s in spans} == {"kernelhost-vm-test"}
    calls = {s.name: s for s in spans if s.parent_id == caller}
    assert {CREATE, EXECUTE, DELETE} <= set(calls), "each call is a child of the caller's span"
    execute = calls[EXECUTE]
    assert execute.attributes["kernelhost.sandbox_id"] == sandbox_id
    by_name = {s.name: s for s in spans}
    assert by_name["kernel.execute"].parent_id == execute.span_id
    assert by_name["execute.stream"].parent_id == execute.span_id
    assert by_name["vm.launch"].parent_id == by_name["sandbox.create"].span_id
    assert by_name["sandbox.create"].parent_id == calls[CREATE].span_id
