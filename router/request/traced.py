"""Tracing at the edges of the request path (docs/tracing.md): wrappers around the index client, the worker
pool, the decide sequence and the stages, put in place where the pipeline is built (pipeline.py) while
tracing is on, as llm-d wraps its index (``kvblock.NewInstrumentedIndex(next)``). The logic they wrap makes
no span of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from kvmesh.contract.index_protocol import Reservation, ReservationAnswer, WorkerMatch
from kvmesh.router.core.decide import DecideSequence, LookupCall
from kvmesh.router.core.policies.base import Decision
from kvmesh.router.core.upstream import (
    AsyncPrefixIndex,
    WorkerCall,
    WorkerChunk,
    WorkerEndpoint,
    WorkerPool,
    WorkerRequest,
)
from kvmesh.router.request.context import RequestContext
from kvmesh.transport import tracing


class TracedIndex:
    """The kv_service client with a client span per call: ``router.lookup``, ``router.reserve``."""

    def __init__(self, inner: AsyncPrefixIndex) -> None:
        self.inner = inner

    async def lookup(self, model_id: str, block_hashes: Sequence[bytes]) -> list[WorkerMatch]:
        with tracing.span("router.lookup", kind="client"):
            return await self.inner.lookup(model_id, block_hashes)

    async def lookup_reserve(self, model_id: str, block_hashes: Sequence[bytes],
                             reservation: Reservation) -> tuple[list[WorkerMatch], bool]:
        with tracing.span("router.lookup", kind="client", attributes={"kvmesh.folded_reservation": True}):
            return await self.inner.lookup_reserve(model_id, block_hashes, reservation)

    async def reserve(self, reservation: Reservation) -> ReservationAnswer:
        with tracing.span("router.reserve", kind="client", attributes={"kvmesh.worker_id": reservation.worker_id}):
            return await self.inner.reserve(reservation)


class TracedPool:
    """The worker pool with a ``router.forward`` client span per call, a child of the trace context the
    request carries; the worker gets the forward span's context (its spans hang under it)."""

    def __init__(self, inner: WorkerPool) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, endpoint: WorkerEndpoint, request: WorkerRequest, timeout_s: float) -> WorkerCall:
        span = tracing.start("router.forward", request.trace, {"kvmesh.worker_id": endpoint.worker_id,
                                                               "kvmesh.prefill_leg": request.prefill_leg},
                             kind="client")
        call = self.inner.generate(endpoint, replace(request, trace=tracing.carrier_of(span) or request.trace),
                                   timeout_s)
        return TracedCall(call, span)


class TracedCall:
    """A worker call whose span notes the first token and ends with the call (its completion tokens)."""

    __slots__ = ("call", "span", "tokens", "_ended")

    def __init__(self, call: WorkerCall, span: Any) -> None:
        self.call = call
        self.span = span
        self.tokens = 0
        self._ended = span is None

    async def __aiter__(self) -> AsyncIterator[WorkerChunk]:
        try:
            async for chunk in self.call:
                if not self.tokens and chunk.token_ids and self.span is not None:
                    self.span.add_event("first_token")
                self.tokens += len(chunk.token_ids)
                yield chunk
        finally:
            self._end()

    def cancel(self) -> None:
        self.call.cancel()
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self.span.set_attribute("kvmesh.completion_tokens", self.tokens)
            self.span.end()


class TracedSequence(DecideSequence):
    """The decide sequence with a span around its steps that compute: ``router.hash`` (the chain, and the
    tentative pick that rides on the Lookup) and ``router.pick``."""

    __slots__ = ()

    def lookup(self) -> LookupCall | None:
        with tracing.span("router.hash"):
            return super().lookup()

    def pick(self) -> Decision:
        with tracing.span("router.pick"):
            return super().pick()


def traced(stage: Callable[..., Awaitable[None]], name: str) -> Callable[..., Awaitable[None]]:
    """``stage`` inside a span named ``name`` (the request's span is current around the stages)."""

    async def run(ctx: RequestContext, *args: Any) -> None:
        with tracing.span(name):
            await stage(ctx, *args)

    return run
