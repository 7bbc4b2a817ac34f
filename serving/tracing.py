"""Optional OpenTelemetry tracing (the ``otel`` extra), off unless ``--otlp-endpoint`` is set.

A W3C ``traceparent`` arriving in HTTP headers or gRPC metadata becomes the parent of the
server's spans, and the router passes its own on to the replica in the call's metadata, so
one trace shows a request from the client through the router (tokenize, index lookup,
decision, relay) into the replica (queue, prefill, first token). While tracing is off every
call here is a no-op that imports nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

_tracer = None  # an opentelemetry Tracer once configured
_propagator = None


def enabled() -> bool:
    return _tracer is not None


def configure(service_name: str, endpoint: str | None = None, exporter: Any = None) -> None:
    """Send spans to an OTLP/gRPC collector at ``endpoint`` (or to ``exporter``, for tests).

    ImportError naming the extra when the OpenTelemetry SDK is not installed."""
    global _tracer, _propagator
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        raise ImportError("tracing needs the OpenTelemetry SDK: pip install 'kvmesh[otel]'") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ImportError("tracing needs the OTLP exporter: pip install 'kvmesh[otel]'") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    _tracer = provider.get_tracer("kvmesh")
    _propagator = TraceContextTextMapPropagator()


def disable() -> None:
    global _tracer, _propagator
    _tracer = _propagator = None


def extract(carrier: Mapping[str, str] | None) -> Any:
    """The trace context in incoming headers or metadata (None when off or absent)."""
    if _propagator is None or not carrier:
        return None
    return _propagator.extract({k.lower(): v for k, v in carrier.items()})


def inject(parent: Any) -> list[tuple[str, str]]:
    """``parent``'s ``traceparent`` as gRPC metadata for an outgoing call."""
    if _propagator is None or parent is None:
        return []
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=_context(parent))
    return list(carrier.items())


def start(name: str, parent: Any = None, **attributes: Any) -> Any:
    """A span, child of ``parent`` (a span or an extracted context); None when off.

    Parents are passed explicitly, never through the "current span": these spans live
    across the yields of streaming generators, where a context variable would leak."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=_context(parent), attributes=_clean(attributes))


def set_attributes(current: Any, **attributes: Any) -> None:
    if current is not None:
        current.set_attributes(_clean(attributes))


def end(current: Any, **attributes: Any) -> None:
    if current is not None:
        current.set_attributes(_clean(attributes))
        current.end()


@contextlib.contextmanager
def span(name: str, parent: Any = None, **attributes: Any) -> Iterator[Any]:
    """A span around a block that does not yield (None when off)."""
    current = start(name, parent, **attributes)
    try:
        yield current
    finally:
        end(current)


def record_phases(
    parent: Any, phases: list[tuple[str, float | None, float | None]], **attributes: Any
) -> None:
    """Spans for phases already over, children of ``parent``: (name, start, end) in
    ``time.monotonic()`` seconds (the engine times its requests that way); a phase with
    an unknown start or end is left out."""
    if _tracer is None or parent is None:
        return
    offset = time.time_ns() - time.monotonic_ns()
    for name, begin, finish in phases:
        if begin is None or finish is None:
            continue
        s = _tracer.start_span(
            name,
            context=_context(parent),
            start_time=int(begin * 1e9) + offset,
            attributes=_clean(attributes),
        )
        s.end(end_time=int(finish * 1e9) + offset)


def _context(parent: Any) -> Any:
    if parent is None:
        return None
    from opentelemetry import trace

    return trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}
