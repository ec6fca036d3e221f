"""The forward stage: the pick, and after a worker fails before its first token the next pick
(router/core/attempts.py), each attempt relayed (relay.py) until one streams or none is left.

Request migration (Dynamo's ``--migration-limit``): a worker that fails mid-stream (it died, or its
drain outlasted its grace) is replaced by the next pick, which continues from the client's prompt plus
the tokens already sent, for the tokens still owed; the client sees one stream. Greedy output is the
same tokens an undisturbed run gives (the continuation's prefill computes the same positions).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

from kvmesh.contract.errors import Unavailable
from kvmesh.router.core.attempts import Attempts
from kvmesh.router.core.decide import Decided
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import Failure, WorkerError, WorkerPool, WorkerRequest
from kvmesh.router.generate_types import GenerateOutput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.request.context import RequestContext
from kvmesh.router.request.relay import Cut, Relay, Sent

log = logging.getLogger("kvmesh.router")


class Forward:
    """Args:
    core: the router's decision state.
    pool: the model's workers (marks a worker that is down).
    relay: one attempt's stream.
    max_attempts: ``--max-attempts``.
    metrics: counts retries and migrations.
    migration_limit: ``--migration-limit``: migrations of one request at most (0: a worker failing
        mid-stream ends the stream).
    replan: the decide stage: a migration's continuation is routed afresh (a new Lookup of the prompt
        plus the tokens sent, the pool's workers now: one that joined since the request was routed
        included, one that left since not). None: the next of the first plan's candidates.
    """

    name = "forward"

    def __init__(self, core: RoutingCore, pool: WorkerPool, relay: Relay, max_attempts: int,
                 metrics: RouterMetrics, migration_limit: int = 0,
                 replan: Callable[..., Awaitable[None]] | None = None) -> None:
        self.core = core
        self.pool = pool
        self.relay = relay
        self.max_attempts = max_attempts
        self.metrics = metrics
        self.migration_limit = migration_limit
        self.replan = replan

    async def stream(self, ctx: RequestContext, request: WorkerRequest) -> AsyncIterator[GenerateOutput]:
        decided = ctx.decided
        assert decided is not None
        attempts = Attempts(self.core, decided.plan, decided.decision, self.max_attempts, ctx.deadline,
                            self.pool.mark_unhealthy)
        sent = self.relay.sent(ctx, len(request.prompt_token_ids))
        first = True
        while (decision := attempts.next(time.monotonic())) is not None:
            endpoint = decided.plan.endpoints[decision.worker_id]
            ctx.tried = decision
            try:
                async for out in self.relay.stream(ctx, endpoint, request, ctx.deadline - time.monotonic(), sent):
                    if first:
                        out, first = replace(out, request_id=ctx.request_id), False
                    yield out
                return
            except WorkerError as exc:  # before this attempt's first token
                if exc.failure is Failure.CANCELLED:
                    return
                # NOTE: an INVALID failure raises with the worker's own words, without who said it.
                if not attempts.failed(endpoint.worker_id, exc.failure, f"{endpoint.address}: {exc}", exc.details):
                    break
                self.metrics.retries.labels(exc.failure.value).inc()
                log.info("request %s: worker %s at %s %s before the first token (%s); trying another",
                         ctx.request_id, endpoint.worker_id, endpoint.address, exc.failure.value, exc)
            except Cut as cut:
                if cut.failure is Failure.UNAVAILABLE:
                    self.pool.mark_unhealthy(endpoint.worker_id)
                why = self._no_migration(sent, request)
                if why:
                    raise Unavailable(f"the worker serving the request failed mid-stream ({cut.failure.value}) "
                                      f"and {why}; the tokens already sent stand") from None
                sent.migrations += 1
                request = continued(request, sent, ctx.request_id)
                self.metrics.migrations.inc()
                log.warning("request %s: migrating after %d tokens (migration %d of at most %d): %s",
                            ctx.request_id, sent.completion, sent.migrations, self.migration_limit, cut)
                if self.replan is None:
                    attempts.max_attempts += 1  # NOTE: a migration is not a retry: it gets an attempt of its own
                    continue
                decided = await self._replan(ctx, request, endpoint.worker_id, cut)
                attempts = Attempts(self.core, decided.plan, decided.decision, self.max_attempts, ctx.deadline,
                                    self.pool.mark_unhealthy)
        if attempts.failures:
            log.warning("request %s: no worker took it: %s", ctx.request_id,
                        "; ".join(f"{w}: {f.value} ({m})" for w, f, m in attempts.failures))
        if sent.completion:
            raise Unavailable(f"the worker serving the request failed mid-stream after {sent.completion} tokens and "
                              "no other worker could continue it (every one tried failed, none is left, or the "
                              "deadline passed); the tokens already sent stand")
        raise attempts.error()

    async def _replan(self, ctx: RequestContext, request: WorkerRequest, failed: str, cut: Cut) -> Decided:
        """The continuation routed as a request of its own (its id, its prompt), away from the worker that
        failed; the request's plan becomes the continuation's (its in-flight share, its log line).

        NOTE: in a P/D fleet the continuation goes to the decode pick as a whole request (it prefills
        itself): the tokens sent make it a short extension of a prompt the fleet just computed."""
        assert self.replan is not None
        cont = replace(ctx, request_id=request.request_id, token_ids=list(request.prompt_token_ids), decided=None)
        try:
            await self.replan(cont, lambda worker_id, _address: worker_id != failed, refuse=False)
        except Unavailable as exc:
            raise Unavailable(f"the worker serving the request failed mid-stream ({cut.failure.value}) and no "
                              f"other worker could continue it ({exc}); the tokens already sent stand") from None
        assert cont.decided is not None
        ctx.decided = cont.decided
        return cont.decided

    def _no_migration(self, sent: Sent, request: WorkerRequest) -> str:
        """Why the cut stream cannot go on elsewhere ('' when it can)."""
        if sent.migrations >= self.migration_limit:
            return f"it was migrated {sent.migrations} time(s) already (--migration-limit {self.migration_limit})"
        if not sent.kept:
            return "it is longer than --migration-max-seq-len"
        if request.sampling.max_tokens is not None and sent.completion >= request.sampling.max_tokens + len(
                request.prompt_token_ids) - sent.prompt_len:
            return "it has all its tokens"
        return ""


def continued(request: WorkerRequest, sent: Sent, request_id: str) -> WorkerRequest:
    """The request a migration sends: the client's prompt and the tokens sent so far, for the tokens still
    owed, as a plain request (a P/D decode leg continues as a whole request: its KV source is gone)."""
    prompt = list(request.prompt_token_ids[:sent.prompt_len]) + sent.token_ids
    sampling = request.sampling
    if sampling.max_tokens is not None:
        owed = sampling.max_tokens + len(request.prompt_token_ids) - sent.prompt_len  # the client's max_tokens
        sampling = replace(sampling, max_tokens=owed - sent.completion)
    return replace(request, request_id=f"{request_id}.m{sent.migrations}", prompt_token_ids=prompt,
                   sampling=sampling, prefill_leg=False, kv_source=None)
