"""Prefill/decode disaggregation as an operator around the forward stage (Dynamo's ``PrefillRouter``, a
forward-only operator before the decode router: ai-dynamo/dynamo ``lib/llm/src/kv_router/prefill_router.rs``).

The decide stage made the P/D decision on the decode pick (router/core/pd.py). When it names a prefill
worker, the prompt goes there first (one token, its KV held for the decode worker); the decode leg then
carries the KV source. A prefill leg that fails leaves the decode worker to prefill the prompt itself; KV
the decode leg never took is released at once, not at its ttl. A model served without roles builds no
such operator (pipeline.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from kvmesh.contract.errors import InvalidArgument
from kvmesh.contract.kv_transfer import KVSource
from kvmesh.contract.types import SamplingParams
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import Failure, WorkerError, WorkerPool, WorkerRequest
from kvmesh.router.generate_types import GenerateOutput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.request.context import PrefillOutcome, RequestContext
from kvmesh.router.request.forward import Forward

log = logging.getLogger("kvmesh.router")


class PrefillLeg:
    """Args:
    inner: the forward stage (the decode leg, or the whole request when no prefill worker is named).
    core: the router's decision state (the leg's in-flight share).
    pool: the model's workers.
    context_len: the model's context now (a split request over it is refused before any KV moves).
    first_token_s: ``--first-token-timeout`` (the leg's budget when shorter than the request's).
    metrics: counts failed legs.
    """

    name = "prefill_leg"

    def __init__(self, inner: Forward, core: RoutingCore, pool: WorkerPool, context_len: Callable[[], int],
                 first_token_s: float, metrics: RouterMetrics) -> None:
        self.inner = inner
        self.core = core
        self.pool = pool
        self.context_len = context_len
        self.first_token_s = first_token_s
        self.metrics = metrics
        self._tasks: set[asyncio.Task] = set()

    async def stream(self, ctx: RequestContext, request: WorkerRequest) -> AsyncIterator[GenerateOutput]:
        pd = ctx.decided.pd if ctx.decided is not None else None
        if pd is None or pd.prefill_worker is None:
            async for out in self.inner.stream(ctx, request):
                yield out
            return
        context, want = self.context_len(), ctx.inp.sampling.max_tokens or 0
        if context and len(ctx.token_ids) + want > context:
            # NOTE: the decode worker would refuse it: refused here, before a prefill leg and any KV moves
            room = context - len(ctx.token_ids)
            raise InvalidArgument(f"max_tokens is {want}, but the prompt's {len(ctx.token_ids)} tokens leave room "
                                  f"for {room} of the model's context ({context}); ask for at most {room}",
                                  param="max_tokens")
        ctx.prefill = await self._prefill(ctx, pd.prefill_worker, request)
        if ctx.prefill is not None:
            request = replace(request, kv_source=ctx.prefill.source)
        try:
            async for out in self.inner.stream(ctx, request):
                yield out
        finally:
            if ctx.prefill is not None and not ctx.prefill.taken:
                self._release(ctx, ctx.prefill.source)

    async def _prefill(self, ctx: RequestContext, worker_id: str, request: WorkerRequest) -> PrefillOutcome | None:
        """The leg on ``worker_id`` (one token, its KV held); None when it failed."""
        plan = ctx.plan
        endpoint = plan.endpoints[worker_id]
        c = next(c for c in plan.prefill_candidates if c.worker_id == worker_id)
        q = plan.query
        ticket = self.core.inflight.start(worker_id, max(0, q.prompt_len - c.matched_blocks * q.block_size),
                                          -(-q.prompt_len // q.block_size) if q.block_size else 0)
        leg = replace(request, sampling=SamplingParams(max_tokens=1, ignore_eos=True), prefill_leg=True)
        call = None
        try:
            timeout = ctx.deadline - time.monotonic()
            first = self.first_token_s
            call = self.pool.generate(endpoint, leg, min(timeout, first) if first > 0 else timeout)
            async for chunk in call:
                if chunk.finish_reason is not None:
                    if chunk.kv_source is None:
                        raise WorkerError(Failure.OTHER, "the prefill leg ended without a KV source")
                    cached = chunk.usage.cached_tokens if chunk.usage is not None else 0
                    return PrefillOutcome(worker_id, cached, chunk.kv_source)
            raise WorkerError(Failure.OTHER, "the prefill leg's stream ended without a finish reason")
        except WorkerError as exc:
            if exc.failure is Failure.CANCELLED:
                raise asyncio.CancelledError() from None
            if exc.failure in (Failure.UNAVAILABLE, Failure.TIMEOUT):
                self.pool.mark_unhealthy(worker_id)
            self.metrics.pd_prefill_failures.labels(exc.failure.value).inc()
            log.warning("request %s: prefill leg on %s at %s failed (%s: %s); the decode worker prefills it",
                        request.request_id, worker_id, endpoint.address, exc.failure.value, exc)
            return None
        finally:
            self.core.inflight.finish(ticket)
            if call is not None:
                call.cancel()

    def _release(self, ctx: RequestContext, source: KVSource) -> None:
        """The decode leg never took the KV (it failed, or the client left): the prefill worker frees its hold."""
        endpoint = ctx.plan.endpoints.get(source.worker_id)
        release = getattr(self.pool, "release_kv", None)
        if endpoint is not None and release is not None:
            task = asyncio.get_running_loop().create_task(release(endpoint, source.request_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
