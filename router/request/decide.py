"""The decide stage: router/core/decide.py's sequence driven against the kv_service, each call awaited.

The same sequence runs in the endpoint picker (through this stage) and in the simulator (its calls on the
virtual clock); here only the awaits are added. A kv_service that fails a Lookup leaves the request to the
rendezvous fallback; one that fails a Reserve leaves the pick as it is (the request is not held up for the
shared view).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvmesh.contract.errors import ResourceExhausted, Unavailable
from kvmesh.contract.index_protocol import IndexUnavailable, WorkerMatch
from kvmesh.contract.types import DEFAULT_MAX_TOKENS
from kvmesh.router.core.decide import Decided, DecideSequence, Fleet, NoWorker, SplitDecider
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import AsyncPrefixIndex, WorkerPool
from kvmesh.router.request.context import RequestContext

log = logging.getLogger("kvmesh.router")

HASH_ON_LOOP_TOKENS = 16_384
"""Prompts up to this long are hashed on the event loop (1,024 blocks of 16: ~1.5 ms of SHA-256)."""


class Decide:
    """Args:
    core: the router's decision state.
    pool: the model's workers.
    index: the kv_service (None: route without an index).
    pd_mode: ``--pd-mode`` (the fleet's roles come from discovery).
    decider: the P/D decision (a fleet with roles).
    reservations: counts each reservation's outcome: ``folded``, ``reserved``, ``conflict``, ``failed``.
    sequence_type: the decide sequence (a traced one while tracing is on, router/request/traced.py).
    offload: ``offload(fn, *args)`` runs ``fn`` off the loop (the tokenizer pool); None: on the loop.
    refused: ``--slo-refuse``: counts a request refused because the policy predicts no worker meets its latency
        objectives (by the objective missed), before it is refused; None: such a request is served.
    """

    name = "decide"

    def __init__(self, core: RoutingCore, pool: WorkerPool, index: AsyncPrefixIndex | None, pd_mode: str,
                 decider: SplitDecider, reservations: Callable[[str], None],
                 sequence_type: type[DecideSequence] = DecideSequence,
                 offload: Callable[..., Awaitable[Any]] | None = None,
                 refused: Callable[[str], None] | None = None) -> None:
        self.sequence_type = sequence_type
        self.refused = refused
        self.offload = offload
        self.core = core
        self.pool = pool
        self.index = index
        self.pd_mode = pd_mode
        self.decider = decider
        self.reservations = reservations

    async def __call__(self, ctx: RequestContext, only: Callable[[str, str], bool] | None = None, *,
                       refuse: bool = True) -> None:
        """``refuse``: False for a migration's continuation (its stream has begun: it is never refused)."""
        chain = None
        if self.offload is not None and len(ctx.token_ids) > HASH_ON_LOOP_TOKENS:
            # NOTE: a long chain is hashed on the tokenizer pool, never on the loop (the chain cache keeps
            # what it shares with recent prompts: router/core/chain_cache.py)
            chain = await self.offload(self.core.chain, self.pool.model_spec(), ctx.token_ids, ctx.inp.cache_salt,
                                       ctx.inp.adapter)
        ctx.decided = await self.decide(self.sequence(ctx, only, chain), refuse)

    def sequence(self, ctx: RequestContext, only: Callable[[str, str], bool] | None = None,
                 chain: list[bytes] | None = None) -> DecideSequence:
        endpoints = self.pool.endpoints()
        inp = ctx.inp
        return self.sequence_type(self.core, self.pool.model_spec(), ctx.token_ids, endpoints, chain=chain,
                              request_id=ctx.request_id, cache_salt=inp.cache_salt,
                              max_tokens=inp.sampling.max_tokens or DEFAULT_MAX_TOKENS, objectives=inp.objectives,
                              adapter=inp.adapter, have_index=self.index is not None, adopt=self.pool.discovers_from_index,
                              healthy=self.pool.healthy, fleet=Fleet({e.worker_id: e.role for e in endpoints},
                                                                     self.pd_mode),
                              decider=self.decider, only=only)

    async def decide(self, seq: DecideSequence, refuse: bool = True) -> Decided:
        call = seq.lookup()
        outcome: Sequence[WorkerMatch] | IndexUnavailable | None = None
        reserved = False
        t0 = time.perf_counter()
        if call is not None:
            assert self.index is not None
            try:
                if call.folded is not None:
                    outcome, reserved = await self.index.lookup_reserve(call.model_id, call.block_hashes, call.folded)
                else:
                    outcome = await self.index.lookup(call.model_id, call.block_hashes)
            except IndexUnavailable as exc:
                outcome = exc
        try:
            seq.answered(outcome, time.perf_counter() - t0, reserved)
        except NoWorker as exc:
            if exc.kind == "none":
                why = self.pool.problem or "none has a live lease in kv_service (or answers in --workers)"
                raise Unavailable(f"no worker is available for model {seq.spec.model_id!r}: {why}") from None
            raise
        if refuse and self.refused is not None and seq.objectives:
            self._refuse_missed(seq)
        seq.pick()
        assert seq.loop is not None
        if seq.loop.folded:
            self.reservations("folded")
        while (reservation := seq.reservation()) is not None:
            assert self.index is not None
            try:
                answer = await self.index.reserve(reservation)
            except IndexUnavailable as exc:
                self.reservations("failed")
                log.debug("reserve failed, forwarding unreserved: %s", exc)
                seq.unreserved()
                break
            self.reservations("reserved" if seq.reserved(answer) else "conflict")
        return seq.commit()

    def _refuse_missed(self, seq: DecideSequence) -> None:
        """Raises ResourceExhausted when the policy predicts no candidate meets the request's objectives
        (before the pick: nothing is reserved or counted in flight for a refused request)."""
        plan = seq.plan
        assert plan is not None and self.refused is not None
        miss = self.core.policy.objective_miss(plan.query, plan.candidates)
        if miss is not None:
            self.refused(miss.objective)
            raise ResourceExhausted(f"{miss} (--slo-refuse)")
