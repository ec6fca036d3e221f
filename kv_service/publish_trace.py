"""The trace of a worker's event stream (docs/tracing.md, "Event batches").

An event batch belongs to no request, and a worker publishes many a second: a span (and so a trace) per
batch would bury the requests' traces. A PublishEvents stream is instead what OpenTelemetry's gRPC
instrumentation makes of any streaming call, one server span with an event per message, cut into windows
so that it is exported while the stream lives: a ``kv.publish_events`` span per window of publishing (up
to :data:`WINDOW_BATCHES` batches or :data:`WINDOW_S` seconds), a ``kv.batch`` event per batch (its seq,
its events, what the index did with it, the time it took), each window linked to the one before it. A
stream with nothing to publish has no window open.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvmesh.contract.types import TraceContext
from kvmesh.transport import tracing

WINDOW_S = 10.0
WINDOW_BATCHES = 128
"""The SDK's default bound on a span's events: a window never drops one."""

PUBLISH_RPC = tracing.rpc_attributes("kvmesh.v1.KVService", "PublishEvents")


class PublishTrace:
    """The windows of one stream; ``parent``: the worker's trace context, if it sent one (a window is
    the root of a trace of its own otherwise). Used on the stream's event loop only."""

    def __init__(self, parent: TraceContext | None = None) -> None:
        self.parent = parent
        self.span: Any = None
        self.previous: Any = None
        self.batches = 0
        self.events = 0
        self._timer: asyncio.TimerHandle | None = None

    def received(self, worker_id: str) -> None:
        """A batch arrived: a window opens unless one is."""
        if self.span is not None:
            return
        self.span = tracing.start("kv.publish_events", self.parent, {**PUBLISH_RPC, "kvmesh.worker_id": worker_id},
                                  kind="server", links=(self.previous,) if self.previous is not None else ())
        self._timer = asyncio.get_running_loop().call_later(WINDOW_S, self._close)

    def applied(self, seq: int, events: int, action: str, snapshot: bool, seconds: float) -> None:
        """The batch :meth:`received` announced is applied: its event; the window ends when full."""
        self.batches += 1
        self.events += events
        self.span.add_event("kv.batch", {"kvmesh.seq": seq, "kvmesh.events": events, "kvmesh.action": action,
                                         "kvmesh.snapshot": snapshot, "kvmesh.apply_ms": seconds * 1000})
        if self.batches >= WINDOW_BATCHES:
            self._close()

    def end(self, code: int = tracing.GRPC_OK, exc: BaseException | None = None) -> None:
        """The stream ended with the status ``code`` (the error that ended it: ``exc``)."""
        if self.span is None and code not in (tracing.GRPC_OK, tracing.GRPC_CANCELLED):
            self.received("")  # NOTE: refused before its first batch applied: the failure has its span
        self._close(code, exc)

    def _close(self, code: int = tracing.GRPC_OK, exc: BaseException | None = None) -> None:
        if self.span is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.span.set_attribute("kvmesh.batches", self.batches)
        self.span.set_attribute("kvmesh.events", self.events)
        tracing.end_rpc(self.span, code, exc)
        self.previous, self.span = self.span, None
        self.batches = self.events = 0
