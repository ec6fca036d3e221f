"""The forward stage: the pick, and after a worker fails before its first token the next pick
(router/core/attempts.py), each attempt relayed (relay.py) until one streams or none is left."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from kvmesh.router.core.attempts import Attempts
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import Failure, WorkerError, WorkerPool, WorkerRequest
from kvmesh.router.generate_types import GenerateOutput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.request.context import RequestContext
from kvmesh.router.request.relay import Relay

log = logging.getLogger("kvmesh.router")


class Forward:
    """Args:
    core: the router's decision state.
    pool: the model's workers (marks a worker that is down).
    relay: one attempt's stream.
    max_attempts: ``--max-attempts``.
    metrics: counts retries.
    """

    name = "forward"

    def __init__(self, core: RoutingCore, pool: WorkerPool, relay: Relay, max_attempts: int,
                 metrics: RouterMetrics) -> None:
        self.core = core
        self.pool = pool
        self.relay = relay
        self.max_attempts = max_attempts
        self.metrics = metrics

    async def stream(self, ctx: RequestContext, request: WorkerRequest) -> AsyncIterator[GenerateOutput]:
        decided = ctx.decided
        assert decided is not None
        attempts = Attempts(self.core, decided.plan, decided.decision, self.max_attempts, ctx.deadline,
                            self.pool.mark_unhealthy)
        first = True
        while (decision := attempts.next(time.monotonic())) is not None:
            endpoint = decided.plan.endpoints[decision.worker_id]
            ctx.tried = decision
            try:
                async for out in self.relay.stream(ctx, endpoint, request, ctx.deadline - time.monotonic()):
                    if first:
                        out, first = replace(out, request_id=ctx.request_id), False
                    yield out
                return
            except WorkerError as exc:  # only ever raised before the first token
                if exc.failure is Failure.CANCELLED:
                    return
                # NOTE: an INVALID failure raises with the worker's own words, without who said it.
                if not attempts.failed(endpoint.worker_id, exc.failure, f"{endpoint.address}: {exc}", exc.details):
                    break
                self.metrics.retries.labels(exc.failure.value).inc()
                log.info("request %s: worker %s at %s %s before the first token (%s); trying another",
                         ctx.request_id, endpoint.worker_id, endpoint.address, exc.failure.value, exc)
        if attempts.failures:
            log.warning("request %s: no worker took it: %s", ctx.request_id,
                        "; ".join(f"{w}: {f.value} ({m})" for w, f, m in attempts.failures))
        raise attempts.error()
