"""OpenTelemetry traces, off unless the operator turns them on (docs/tracing.md).

The service's code names the stages a call goes through and nothing more::

    with tracing.span("sandbox.wake", sandbox_id=sbx.id):
        ...

With tracing off (the default) ``span`` returns one shared no-op context manager: no span, no
allocation, no change to the current context. ``setup`` turns it on at service start from the
standard ``OTEL_*`` variables (``OTEL_TRACES_EXPORTER=otlp``: the OTLP/HTTP protobuf exporter,
whose endpoint, headers and timeout come from ``OTEL_EXPORTER_OTLP_*``; the sampler from
``OTEL_TRACES_SAMPLER``; the batch from ``OTEL_BSP_*``); ``shutdown`` flushes what is left at
service stop. Only the API is imported here; the SDK and the exporter only when tracing is on.

Nothing here knows HTTP: the API layer hands ``server_span`` and ``inject`` its headers as a
mapping. The W3C trace context (``traceparent``, ``tracestate``) is the only propagation format.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "Attr",
    "TracingConfigError",
    "client_span",
    "current_ids",
    "detached_span",
    "disable",
    "enable",
    "enabled",
    "inject",
    "mark_error",
    "server_span",
    "set_attributes",
    "setup",
    "shutdown",
    "span",
]

Attr = str | int | float | bool | None
#: an attribute named without a namespace is the service's own: ``sandbox_id`` is sent as
#: ``kernelhost.sandbox_id``
PREFIX = "kernelhost."
#: how long the last spans may take to leave at service stop
FLUSH_MILLIS = 5000
#: the exporters ``OTEL_TRACES_EXPORTER`` may name (a comma-separated list)
EXPORTERS = ("otlp", "console", "none")
TRACE_HEADERS = ("traceparent", "tracestate")
#: the OTLP protocol, the traces' own first
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")

_NOOP: contextlib.nullcontext[None] = contextlib.nullcontext()
_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None


class TracingConfigError(ValueError):
    """An ``OTEL_*`` variable asks for something this service cannot do."""


def enabled() -> bool:
    return _tracer is not None


def _attributes(attributes: Mapping[str, Attr]) -> dict[str, str | int | float | bool]:
    return {
        (name if "." in name else PREFIX + name): value
        for name, value in attributes.items()
        if value is not None
    }


def span(name: str, **attributes: Attr) -> contextlib.AbstractContextManager[Any]:
    """A span for one stage, child of the current one and current inside the block (an
    exception ends it as an error); a no-op with tracing off."""
    if _tracer is None:
        return _NOOP
    return _tracer.start_as_current_span(name, attributes=_attributes(attributes))


def client_span(name: str, **attributes: Attr) -> contextlib.AbstractContextManager[Any]:
    """``span`` for a call this service makes to another (a peer node): its ``traceparent``
    goes with the call (``inject``), so the callee's server span is its child."""
    if _tracer is None:
        return _NOOP
    return _tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT, attributes=_attributes(attributes))


def detached_span(name: str, **attributes: Attr) -> contextlib.AbstractContextManager[Any]:
    """A span child of the current one that does not become current: for a stage inside an
    async generator, whose block spans ``yield``s (the consumer's code between them must not
    run inside it, and the context is never left changed when the generator is dropped)."""
    if _tracer is None:
        return _NOOP
    return _detached(_tracer, name, _attributes(attributes))


@contextlib.contextmanager
def _detached(tracer: trace.Tracer, name: str, attributes: dict[str, Any]) -> Iterator[trace.Span]:
    current = tracer.start_span(name, attributes=attributes)
    try:
        yield current
    except Exception as exc:
        current.record_exception(exc)
        current.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200])
        raise
    except BaseException:  # cancelled, or the generator closed early: not an error of its own
        current.set_attribute(PREFIX + "ended_early", True)
        raise
    finally:
        current.end()


def server_span(
    name: str, headers: Mapping[str, str], **attributes: Attr
) -> contextlib.AbstractContextManager[Any]:
    """The span of one call the service answers, child of the caller's ``traceparent`` in
    ``headers`` when it sent a valid one; it yields the span (None with tracing off)."""
    if _tracer is None:
        return _NOOP
    parent = _PROPAGATOR.extract(headers)
    return _tracer.start_as_current_span(
        name, context=parent, kind=trace.SpanKind.SERVER, attributes=_attributes(attributes)
    )


def set_attributes(target: Any = None, /, **attributes: Attr) -> None:
    """Add attributes to ``target`` (a span from ``server_span``), or to the current span."""
    if _tracer is None:
        return
    current = target if isinstance(target, trace.Span) else trace.get_current_span()
    if current.is_recording():
        current.set_attributes(_attributes(attributes))


def mark_error(target: Any, description: str) -> None:
    """End ``target`` (a span from ``server_span``) as an error, saying why."""
    if isinstance(target, trace.Span) and target.is_recording():
        target.set_status(trace.StatusCode.ERROR, description)


def current_ids() -> tuple[str, str] | None:
    """The current span's trace and span ids (hex), for a log line to name; None when off or
    outside any span."""
    if _tracer is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def inject(headers: MutableMapping[str, str]) -> None:
    """Put the current span's ``traceparent`` (and ``tracestate``) into ``headers``, replacing
    any the caller sent; with tracing off, or no current span, ``headers`` is left as it is (a
    caller's trace context passes through a node that does not trace)."""
    if _tracer is None or not trace.get_current_span().get_span_context().is_valid:
        return
    for name in [k for k in headers if k.lower() in TRACE_HEADERS]:
        del headers[name]
    _PROPAGATOR.inject(headers)


# -- on and off ----------------------------------------------------------------------------------


def enable(provider: TracerProvider) -> None:
    """Trace into ``provider`` from now on (``setup`` builds one from the environment; tests
    pass one with an in-memory exporter)."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer("kernelhost")


def disable() -> None:
    """Stop tracing; the provider is not shut down (``shutdown`` does that)."""
    global _tracer, _provider
    _tracer, _provider = None, None


def _exporters(env: Mapping[str, str]) -> list[str]:
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER={env['OTEL_TRACES_EXPORTER']!r}: {', '.join(unknown)} is not "
            f"an exporter kernelhost has; use one of {', '.join(EXPORTERS)}"
        )
    var = next((v for v in PROTOCOL_VARS if env.get(v)), None)
    if var is not None and "otlp" in names and env[var] != "http/protobuf":
        raise TracingConfigError(
            f"{var}={env[var]!r}: kernelhost exports OTLP over HTTP with protobuf only; set it "
            "to 'http/protobuf' (or unset it) and point the endpoint at the collector's HTTP "
            "port (4318)"
        )
    return [n for n in names if n != "none"]


def setup(version: str = "", instance: str = "", env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on if the environment asks for it (``OTEL_TRACES_EXPORTER``; off when unset,
    ``none``, or ``OTEL_SDK_DISABLED=true``); whether it is on. Raises ``TracingConfigError``
    for an exporter or protocol this service does not have."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = _exporters(env)
    if not names:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    own = {"service.version": version, "service.instance.id": instance}
    resource = Resource.create({k: v for k, v in own.items() if v})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "kernelhost"}))
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER
    for name in names:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, _HEADERS, ...
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    enable(provider)
    return True


def shutdown() -> None:
    """Flush the spans still queued (for at most ``FLUSH_MILLIS``) and stop the exporters."""
    provider = _provider
    disable()
    if provider is not None:
        provider.force_flush(FLUSH_MILLIS)
        provider.shutdown()
