"""Tracing on inside the test process, its spans kept in memory (kvmesh/transport/tracing.py, as
``configure`` sets it, with an in-memory exporter in place of OTLP)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvmesh.transport import tracing


def tracing_in_memory(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    """Turns tracing on for the test (undone after it); every span ends up in the answer's
    ``get_finished_spans()`` as it ends."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_provider", provider)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("kvmesh-test"))
    monkeypatch.setattr(tracing, "_propagator", TraceContextTextMapPropagator())
    monkeypatch.setattr(tracing, "ON", True)
    return exporter


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]
