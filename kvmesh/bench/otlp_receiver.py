"""An OTLP/gRPC trace receiver in-process: what an OpenTelemetry collector does with the spans the
mesh exports (``--otlp-endpoint``), kept in memory for the tests and benchmarks (docs/tracing.md).
The protocol's own service (``opentelemetry.proto.collector.trace.v1.TraceService/Export``) from
the opentelemetry-proto package, served by a plain grpc server on loopback.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(slots=True, frozen=True)
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict
    kind: str = "internal"
    """server, client, internal, producer or consumer."""
    status: str = "unset"
    """ok, error or unset."""
    status_message: str = ""
    trace_state: str = ""
    events: tuple[tuple[str, dict], ...] = ()
    """(name, attributes) of each span event."""
    links: tuple[tuple[str, str], ...] = ()
    """(trace id, span id) of each span link."""


KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUSES = {0: "unset", 1: "ok", 2: "error"}
"""OTLP's enums (opentelemetry/proto/trace/v1/trace.proto) by number."""


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """``with OtlpReceiver() as r:`` serves on ``r.address``; ``r.spans`` is every span received."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.address = f"{host}:{self.port}"

    def Export(self, request, context):  # noqa: N802 - the protocol's name
        got = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: _value(a.value) for a in s.attributes}
                    events = tuple((e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events)
                    links = tuple((k.trace_id.hex(), k.span_id.hex()) for k in s.links)
                    got.append(ReceivedSpan(service, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                                            s.start_time_unix_nano, s.end_time_unix_nano, attrs, KINDS.get(s.kind, ""),
                                            STATUSES.get(s.status.code, ""), s.status.message, s.trace_state, events,
                                            links))
        with self._lock:
            self.spans += got
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def traces(self) -> dict[str, list[ReceivedSpan]]:
        """Every trace received so far: trace id -> its spans, by start time."""
        with self._lock:
            spans = list(self.spans)
        out: dict[str, list[ReceivedSpan]] = defaultdict(list)
        for s in spans:
            out[s.trace_id].append(s)
        return {t: sorted(v, key=lambda s: s.start_ns) for t, v in out.items()}

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0.5)


def _value(v) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None
