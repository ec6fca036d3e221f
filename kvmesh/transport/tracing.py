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
from collections.abc import Callable, Iterator, Mapping, Sequence
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
          kind: str = "internal", start_ns: int | None = None, links: Sequence[Any] = ()) -> Any:
    """A span that is ended by hand (``.end()``); not made current. None while off. ``links``: spans
    this one follows from (a span link each, not a parent)."""
    if not ON:
        return None
    from opentelemetry.trace import Link, SpanKind

    return _tracer.start_span(name, context=_context(parent), attributes=attributes, kind=getattr(SpanKind, kind.upper()),
                              start_time=start_ns, links=[Link(s.get_span_context()) for s in links])


@contextlib.contextmanager
def rpc_span(name: str, parent: Any, attributes: Mapping[str, Any], kind: str,
             code_of: Callable[[BaseException], int]) -> Iterator[Any]:
    """:func:`span` for a gRPC call (server or client; ``attributes`` from :func:`rpc_attributes`): its
    ``rpc.grpc.status_code`` is 0, or ``code_of(the exception)`` with ERROR status (:func:`end_rpc`)."""
    if not ON:
        yield None
        return
    from opentelemetry.trace import SpanKind

    with _tracer.start_as_current_span(name, context=_context(parent), attributes=attributes,
                                       kind=getattr(SpanKind, kind.upper()), record_exception=False,
                                       set_status_on_exception=False) as s:
        try:
            yield s
        except BaseException as exc:
            end_rpc(s, code_of(exc), exc, end=False)
            raise
        s.set_attribute(RPC_STATUS, GRPC_OK)


# -- conventions (OpenTelemetry's semantic conventions for RPC and HTTP spans) ---------------------
RPC_STATUS = "rpc.grpc.status_code"
GRPC_OK = 0
GRPC_CANCELLED = 1
"""The caller went away: the call ended, it did not fail (no ERROR status)."""


def rpc_attributes(service: str, method: str, address: str | None = None) -> dict[str, Any]:
    """A gRPC span's attributes: ``rpc.system``, ``rpc.service`` (the full name, ``kvmesh.v1.Router``),
    ``rpc.method``; a client span's ``server.address`` and ``server.port`` from ``address`` (host:port)."""
    attrs: dict[str, Any] = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    if address:
        attrs.update(server_attributes(address))
    return attrs


def server_attributes(address: str) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of ``host:port``, ``[v6]:port`` or a URL."""
    hostport = address.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or (host.startswith("[") != host.endswith("]")):
        return {"server.address": hostport}
    return {"server.address": host.strip("[]"), "server.port": int(port)}


def http_attributes(method: str, path: str, route: str | None = None, scheme: str = "http") -> dict[str, Any]:
    """An HTTP server span's request attributes (``http.response.status_code`` comes with the answer)."""
    attrs: dict[str, Any] = {"http.request.method": method, "url.path": path, "url.scheme": scheme}
    if route is not None:
        attrs["http.route"] = route
    return attrs


def set_ok(span_: Any) -> None:
    """OK status: the request (``router.request``) was answered."""
    if span_ is not None:
        from opentelemetry.trace import Status, StatusCode

        span_.set_status(Status(StatusCode.OK))


def set_error(span_: Any, exc: BaseException | None = None, message: str = "", error_type: str = "") -> None:
    """ERROR status with the message; ``error.type`` (the exception's class, or ``error_type``) and
    the exception as an event of the span."""
    if span_ is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span_.set_attribute("error.type", error_type or (type(exc).__qualname__ if exc is not None else "_OTHER"))
    if exc is not None:
        span_.record_exception(exc)
    span_.set_status(Status(StatusCode.ERROR, message or (f"{type(exc).__name__}: {exc}" if exc is not None else "")))


def end_rpc(span_: Any, code: int, exc: BaseException | None = None, end: bool = True) -> None:
    """A gRPC span's ``rpc.grpc.status_code``; ERROR status unless OK or CANCELLED; ended (``end``)."""
    if span_ is None:
        return
    span_.set_attribute(RPC_STATUS, code)
    if code not in (GRPC_OK, GRPC_CANCELLED):
        set_error(span_, exc, error_type="" if exc is not None else str(code))
    if end:
        span_.end()


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
