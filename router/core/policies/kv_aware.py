"""kvmesh's own policy: least predicted time to first token plus what the request costs the others.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvmesh.router.core.policies.base import (
    Candidate,
    Decision,
    PolicyConfig,
    RouteQuery,
    RouterPolicy,
    queued_prefill,
    used_blocks,
    waiting_requests,
)
from kvmesh.router.core.policies.cost import StepCost, StepCostLearner, per_worker


class KvAwarePolicy(RouterPolicy):
    """Least predicted time to first token plus what the request costs the others; rendezvous when blind.

    The prediction for worker w (docs/router.md, "kv-aware"):

        Q = prompt tokens queued for prefill at w, u = this prompt's tokens w does not hold,
        h = those it holds, D = requests running at w, C = context they hold (tokens),
        B = w's token budget per step, S = ceil((Q + u) / B) prefill steps until ours is done,
        H = blocks w's host tier continues its device prefix with, L = w's seconds per loaded block:

        ttft = prefill_token_s * (Q + u)
             + prefill_pair_s * (u * h + u * (u + 1) / 2 + Q * pairs_per_prefill_token)
             + S * (step_s + decode_seq_s * D + decode_context_token_s * C)
             + L * H

    i.e. the queued prefill ahead of it, its own uncached prefill (attention over the cached part
    included), the decodes that share every one of those steps, and the loads of its host-tier
    blocks (the step waits for them). A host block counts as held (in h, not u) at the cost ``L``
    the worker's reports taught (bytes over its host link, router/core/policies/cost.py): the
    prediction weighs that transfer against the prefill it saves, no fixed weight. Until some worker
    reported a load, a host block is priced as one to recompute. The score adds
    ``(decode_harm_weight * D + work_weight * (1 + W)) * own``, ``own`` being the time its own
    prefill takes: the D requests decoding on w wait for it, and a recomputed prefix is capacity
    lost to everyone, the more so the more requests wait (W: the mean waiting per worker).
    The coefficients are learned online from the workers' reports (router/core/policies/cost.py), per
    worker (``--step-cost-fit worker``, the default: a fleet may mix GPU types) or pooled over all
    workers; until there are enough, the same prediction runs in token units (a prefill token costs 1).
    """

    name = "kv-aware"
    uses_index = True
    shares_view = True

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.cost = StepCostLearner(group=per_worker if self.config.step_cost_fit == "worker" else None)

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        for c in candidates:
            self.cost.observe(c.worker_id, c.load)
        if not query.index_ok and not any(c.matched_blocks for c in candidates):
            return self.rendezvous(query, candidates, "fallback")
        # NOTE: until the workers' reports have taught the step cost, the same prediction in
        # token units: a prefill token costs 1, nothing else is known. Once they have, every worker
        # has a fit in seconds (its own, or the pooled one until its own has enough reports).
        # NOTE: whether a fit answers, not the pooled fit itself: solving it per pick was a numpy
        # solve wasted once every worker has its own fit (issue 35, the router's hop).
        learned = self.cost.learned
        lam = self.config.decode_harm_weight
        # NOTE: work delays everyone who arrives while the mesh is backlogged: the more requests
        # wait at the workers, the more a recomputed prefix costs beyond this request's latency.
        waiting = sum(waiting_requests(c) for c in candidates) / len(candidates)
        kappa = self.config.work_weight * (1.0 + waiting)
        scores = []
        for c in candidates:
            model = (self.cost.estimate(c.worker_id) or NOMINAL_COST) if learned else NOMINAL_COST
            # NOTE: the host link is learned in seconds: priced once the step cost is too.
            link = self.cost.load_s_per_block(c.worker_id) if learned and c.host_blocks else None
            ttft, own = predicted_ttft(model, query, c, self.config.default_step_tokens, link)
            scores.append(ttft + (lam * decoders(c) + kappa) * own)
        i = self._sample_index(scores) if self.config.temperature > 0 else self._argmin_index(scores)
        self._scored = (query, {c.worker_id: s for c, s in zip(candidates, scores, strict=True)})
        chosen = candidates[i]
        # NOTE: no token-count guard: a hot spot's queue is in its predicted time already.
        return Decision(chosen.worker_id, "prefix" if chosen.matched_blocks or chosen.host_blocks else "load",
                        round(scores[i] * (1000 if learned else 1)))

    def fallbacks(self, query: RouteQuery, candidates: Sequence[Candidate], n: int) -> list[str]:
        """The next best by the scores the pick of the same query computed (one prediction per request, not
        one per fallback); other queries pick again (RouterPolicy.fallbacks)."""
        scored = getattr(self, "_scored", None)
        if scored is None or scored[0] is not query or any(c.worker_id not in scored[1] for c in candidates):
            return super().fallbacks(query, candidates, n)
        scores = scored[1]
        return [c.worker_id for c in sorted(candidates, key=lambda c: (scores[c.worker_id], c.worker_id))[:n]]

    def _argmin_index(self, scores: Sequence[float]) -> int:
        best = min(scores)
        return self._choice_index([i for i, s in enumerate(scores) if s == best])

    def _sample_index(self, scores: Sequence[float]) -> int:
        """Softmax over the scores normalized to [0, 1] (best 0, worst 1), at ``temperature``."""
        best, worst = min(scores), max(scores)
        if worst <= best:
            return self._argmin_index(scores)
        scale = self.config.temperature * (worst - best)
        weights = [math.exp(-(s - best) / scale) for s in scores]
        with self._lock:  # one RNG shared by the server's threads
            return self._rng.choices(range(len(scores)), weights)[0]


NOMINAL_COST = StepCost(step_s=0.0, prefill_token_s=1.0, prefill_pair_s=0.0, decode_seq_s=0.0,
                        decode_context_token_s=0.0, pairs_per_prefill_token=0.0)
"""kv-aware's step cost before any is learned: time in prefill tokens."""


def decoders(c: Candidate) -> int:
    """Requests at the worker that share its steps: its report (plus the picks it does not cover
    yet) or this router's view, the larger."""
    return max(c.load.num_running + c.pending.requests, c.inflight_requests)


def predicted_ttft(m: StepCost, q: RouteQuery, c: Candidate, default_step_tokens: int = 2048,
                   load_s_per_block: float | None = None) -> tuple[float, float]:
    """(seconds until this request's first token on the candidate, seconds its own prefill and loads
    add to the worker's steps) (see KvAwarePolicy). ``load_s_per_block``: the worker's host link, or
    None to price its host-tier blocks as blocks to recompute."""
    host = c.host_blocks if load_s_per_block is not None else 0
    u = max(0, q.prompt_len - (c.matched_blocks + host) * q.block_size)
    h = q.prompt_len - u
    queue = queued_prefill(c)
    budget = c.load.max_num_batched_tokens or default_step_tokens
    steps = max(1, -(-(queue + u) // budget))
    own_steps = -(-u // budget)
    per_step = m.step_s + m.decode_seq_s * decoders(c) + m.decode_context_token_s * used_blocks(c) * q.block_size
    own = m.prefill_token_s * u + m.prefill_pair_s * (u * h + u * (u + 1) / 2) + own_steps * per_step
    if host:
        own += load_s_per_block * host
    ttft = (m.prefill_token_s * queue + m.prefill_pair_s * queue * m.pairs_per_prefill_token
            + own + (steps - own_steps) * per_step)
    return ttft, own
