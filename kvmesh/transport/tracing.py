"""One trace per request across the mesh: OpenTelemetry spans, W3C ``traceparent`` over gRPC
metadata and HTTP headers (docs/tracing.md).

Off by default. ``configure(endpoint, service)`` (each server command's ``--otlp-endpoint``) turns it
on for the process: a TracerProvider of the official SDK whose spans a batch processor exports over
OTLP/gRPC. While it is off, every helper here is a test of the module flag :data:`ON` and a shared
no-op (no OpenTelemetry import, no allocation), so the request path pays a few attribute reads.

What a service does with it:

- on an incoming call, :func:`extract` the caller's context from the gRPC metadata or the HTTP
  headers (a client's or a gateway's ``traceparent``), and open its span under it with :func:`span`;
- on an outgoing call, :func:`grpc_metadata` (or :func:`inject` for HTTP headers) adds the current
  context, so the callee's spans join the trace;
- :func:`record` writes a span after the fact from timestamps taken where the work happened (the
  worker's engine thread keeps a request's timeline; docs/tracing.md lists the spans).

This module imports neither grpc nor redis: metadata are plain tuples, headers plain mappings.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvmesh.contract.types import TraceContext

log = logging.getLogger("kvmesh.tracing")

ON = False
"""Whether this process exports traces (set by :func:`configure`; read on every request)."""

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_tracer: Any = None
_provider: Any = None
_propagator: Any = None
_NOOP = contextlib.nullcontext()


def configure(endpoint: str | None, service: str, *, instance: str = "", insecure: bool = True,
              export_timeout_s: float = 10.0) -> None:
    """Turns tracing on for this process when ``endpoint`` (host:port of an OTLP/gRPC receiver, or a
    URL) is given; ``service`` is the resource's ``service.name`` (``kvmesh-router``, ...), ``instance``
    its ``service.instance.id`` (a worker id)."""
    global ON, _tracer, _provider, _propagator
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    attrs = {"service.name": service}
    if instance:
        attrs["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attrs))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure, timeout=export_timeout_s)
    # NOTE: a small delay: a request's spans reach the receiver within ~0.2 s of its end, and the
    # batch keeps the export off the request path (one background thread per process).
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    _provider = provider
    _tracer = provider.get_tracer("kvmesh")
    _propagator = TraceContextTextMapPropagator()
    ON = True
    log.info("exporting traces over OTLP to %s as %s", endpoint, service)


def shutdown(timeout_s: float = 5.0) -> None:
    """Exports what is buffered and stops (a server's stop); a no-op while off."""
    global ON
    if _provider is None:
        return
    _provider.force_flush(int(timeout_s * 1000))
    _provider.shutdown()
    ON = False


def flush(timeout_s: float = 5.0) -> bool:
    """Exports every finished span now (tests); True when it got through."""
    return _provider is None or _provider.force_flush(int(timeout_s * 1000))


# -- context across processes ---------------------------------------------------------------------
def extract(carrier: Mapping[str, str] | Sequence[tuple[str, Any]] | None) -> TraceContext | None:
    """The caller's context from HTTP headers or gRPC metadata (None while off or when none came)."""
    if not ON or not carrier:
        return None
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    found = {k.lower(): v for k, v in items if k.lower() in (TRACEPARENT, TRACESTATE)}
    if TRACEPARENT not in found:
        return None
    found = {k: v.decode("latin-1") if isinstance(v, bytes) else v for k, v in found.items()}
    return TraceContext(found[TRACEPARENT], found.get(TRACESTATE, ""))


def _context(parent: Any) -> Any:
    """An OpenTelemetry context from a :class:`TraceContext` (anything else is one already, or None)."""
    if isinstance(parent, TraceContext):
        return _propagator.extract(dict(parent.headers()))
    return parent


def carrier_of(span_: Any) -> TraceContext | None:
    """``span_``'s context as it travels to a callee (``traceparent`` and ``tracestate``); None for None."""
    if span_ is None or not ON:
        return None
    from opentelemetry.trace import set_span_in_context

    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=set_span_in_context(span_))
    return TraceContext(carrier[TRACEPARENT], carrier.get(TRACESTATE, "")) if TRACEPARENT in carrier else None


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Adds the current context's ``traceparent`` (and ``tracestate``) to ``headers``; returns them."""
    if ON:
        _propagator.inject(headers)
    return headers


def grpc_metadata(base: Sequence[tuple[str, str]] | None = None) -> Sequence[tuple[str, str]] | None:
    """``base`` (a call's metadata) plus the current context, or ``base`` itself while off."""
    if not ON:
        return base
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    if not carrier:
        return base
    return (*(base or ()), *carrier.items())


def current_traceparent() -> str | None:
    """The current context as a ``traceparent`` value (None while off or outside a span)."""
    if not ON:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get(TRACEPARENT)


# -- spans ------------------------------------------------------------------------------------------
def span(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
         kind: str = "internal") -> contextlib.AbstractContextManager[Any]:
    """A span around a block, current inside it (its children and outgoing calls hang under it);
    ``parent``: an extracted context (default: the current one); ``kind``: internal, server or client.
    While off: a shared no-op context manager."""
    if not ON:
        return _NOOP
    from opentelemetry.trace import SpanKind

    return _tracer.start_as_current_span(name, context=_context(parent), attributes=attributes,
                                         kind=getattr(SpanKind, kind.upper()))


def start(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
          kind: str = "internal", start_ns: int | None = None) -> Any:
    """A span that is ended by hand (``.end()``); not made current. None while off."""
    if not ON:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, context=_context(parent), attributes=attributes, kind=getattr(SpanKind, kind.upper()),
                              start_time=start_ns)


@contextlib.contextmanager
def current(span_: Any) -> Iterator[None]:
    """Makes ``span_`` (from :func:`start`; None = nothing) the current span inside the block."""
    if span_ is None or not ON:
        yield
        return
    from opentelemetry.trace import use_span

    with use_span(span_, end_on_exit=False):
        yield


def context_of(span_: Any) -> Any:
    """The context whose parent is ``span_`` (for :func:`record`'s children); None for None."""
    if span_ is None or not ON:
        return None
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(span_)


def record(name: str, start_ns: int, end_ns: int, parent: Any = None,
           attributes: Mapping[str, Any] | None = None) -> None:
    """A span written after the fact from its wall-clock bounds (ns since the epoch)."""
    if not ON:
        return
    s = _tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns)
    s.end(end_time=max(end_ns, start_ns))


def now_ns() -> int:
    return time.time_ns()


def monotonic_to_ns(t: float) -> int:
    """A ``time.monotonic()`` reading as wall-clock ns since the epoch (spans carry wall time)."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)
