"""Tracing at the edges of the request path (docs/tracing.md): wrappers around the index client, the worker
pool, the decide sequence and the stages, put in place where the pipeline is built (pipeline.py) while
tracing is on, as llm-d wraps its index (``kvblock.NewInstrumentedIndex(next)``). The logic they wrap makes
no span of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from kvmesh.contract.index_protocol import IndexUnavailable, Reservation, ReservationAnswer, WorkerMatch
from kvmesh.router.core.decide import DecideSequence, LookupCall
from kvmesh.router.core.policies.base import Decision
from kvmesh.router.core.upstream import (
    AsyncPrefixIndex,
    Failure,
    WorkerCall,
    WorkerChunk,
    WorkerEndpoint,
    WorkerError,
    WorkerPool,
    WorkerRequest,
)
from kvmesh.router.request.context import RequestContext
from kvmesh.transport import tracing

KV_SERVICE = "kvmesh.v1.KVService"
WORKER = "kvmesh.v1.Worker"

# NOTE: gRPC's status code numbers (a protocol constant, as HTTP's are): the request path imports no grpc.
CODE_OF_FAILURE = {Failure.INVALID: 3, Failure.UNAVAILABLE: 14, Failure.BUSY: 8, Failure.TIMEOUT: 4,
                   Failure.CANCELLED: 1, Failure.OTHER: 2}
UNKNOWN = 2


def index_code(exc: BaseException) -> int:
    """A kv_service call's status code number from what the client raised."""
    if isinstance(exc, asyncio.CancelledError):
        return tracing.GRPC_CANCELLED
    return exc.code if isinstance(exc, IndexUnavailable) and exc.code is not None else UNKNOWN


class TracedIndex:
    """The kv_service client with a client span per call: ``router.lookup``, ``router.reserve``, with the RPC
    conventions' attributes (the kv_service's address: its client's ``target``)."""

    def __init__(self, inner: AsyncPrefixIndex) -> None:
        self.inner = inner
        target = getattr(inner, "target", None)
        self._lookup = tracing.rpc_attributes(KV_SERVICE, "Lookup", target)
        self._folded = {**self._lookup, "kvmesh.folded_reservation": True}
        self._reserve = tracing.rpc_attributes(KV_SERVICE, "Reserve", target)

    async def lookup(self, model_id: str, block_hashes: Sequence[bytes]) -> list[WorkerMatch]:
        with tracing.rpc_span("router.lookup", None, self._lookup, "client", index_code):
            return await self.inner.lookup(model_id, block_hashes)

    async def lookup_reserve(self, model_id: str, block_hashes: Sequence[bytes],
                             reservation: Reservation) -> tuple[list[WorkerMatch], bool]:
        with tracing.rpc_span("router.lookup", None, self._folded, "client", index_code):
            return await self.inner.lookup_reserve(model_id, block_hashes, reservation)

    async def reserve(self, reservation: Reservation) -> ReservationAnswer:
        with tracing.rpc_span("router.reserve", None, {**self._reserve, "kvmesh.worker_id": reservation.worker_id},
                              "client", index_code):
            return await self.inner.reserve(reservation)


class TracedPool:
    """The worker pool with a ``router.forward`` client span per call, a child of the trace context the
    request carries; the worker gets the forward span's context (its spans hang under it)."""

    def __init__(self, inner: WorkerPool) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, endpoint: WorkerEndpoint, request: WorkerRequest, timeout_s: float) -> WorkerCall:
        address = endpoint.address
        # NOTE: a worker served over the OpenAI API (an engine behind its HTTP address) is no gRPC call.
        protocol = ({"http.request.method": "POST", **tracing.server_attributes(address)}
                    if address.startswith(("http://", "https://")) else tracing.rpc_attributes(WORKER, "Generate", address))
        span = tracing.start("router.forward", request.trace, {**protocol, "kvmesh.worker_id": endpoint.worker_id,
                                                               "kvmesh.prefill_leg": request.prefill_leg},
                             kind="client")
        call = self.inner.generate(endpoint, replace(request, trace=tracing.carrier_of(span) or request.trace),
                                   timeout_s)
        return TracedCall(call, span, "rpc.system" in protocol)


class TracedCall:
    """A worker call whose span notes the first token and ends with the call (its completion tokens)."""

    __slots__ = ("call", "span", "tokens", "finished", "_ended", "_grpc")

    def __init__(self, call: WorkerCall, span: Any, grpc: bool = True) -> None:
        self.call = call
        self.span = span
        self.tokens = 0
        self.finished = False
        self._ended = span is None
        self._grpc = grpc

    async def __aiter__(self) -> AsyncIterator[WorkerChunk]:
        try:
            async for chunk in self.call:
                if not self.tokens and chunk.token_ids and self.span is not None:
                    self.span.add_event("first_token")
                self.tokens += len(chunk.token_ids)
                self.finished = chunk.finish_reason is not None
                yield chunk
        except WorkerError as exc:
            self._end(CODE_OF_FAILURE[exc.failure], exc)
            raise
        except Exception as exc:
            self._end(UNKNOWN, exc)
            raise
        finally:
            # NOTE: the relay stops reading at the last chunk (and cancels the call); before it, the call is cancelled.
            self._end(tracing.GRPC_OK if self.finished else tracing.GRPC_CANCELLED)

    def cancel(self) -> None:
        self.call.cancel()
        self._end(tracing.GRPC_OK if self.finished else tracing.GRPC_CANCELLED)

    def _end(self, code: int, exc: BaseException | None = None) -> None:
        if not self._ended:
            self._ended = True
            self.span.set_attribute("kvmesh.completion_tokens", self.tokens)
            if self._grpc:
                tracing.end_rpc(self.span, code, exc)
            else:
                if code not in (tracing.GRPC_OK, tracing.GRPC_CANCELLED):
                    tracing.set_error(self.span, exc)
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
