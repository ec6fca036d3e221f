"""kvmesh's own policy: least predicted time to first token plus what the request costs the others.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from kvmesh.contract.types import AdapterLevel
from kvmesh.router.core.inflight import Ticket
from kvmesh.router.core.policies.base import (
    Candidate,
    Decision,
    ObjectiveMiss,
    PolicyConfig,
    RouteQuery,
    RouterPolicy,
    queued_prefill,
    used_blocks,
    waiting_requests,
)
from kvmesh.router.core.policies.cost import StepCost, StepCostLearner, per_worker
from kvmesh.router.core.policies.prefix_load import PrefixLoad

PACE_TOLERANCE = 0.05
"""A worker's pace (its seconds over the pooled fit's for the same work) within this of 1 reads as 1: identical GPUs
read 1 ± 0.003 (the linear fit's residual on a roofline's steps), and noise in a price is noise in the picks; GPU
types differ by far more (an A100 beside H100s: 1.5 against 0.6)."""


class KvAwarePolicy(RouterPolicy):
    """Least predicted time to first token plus what the request costs the others; rendezvous when blind.

    The prediction for worker w (docs/router.md, "kv-aware"):

        Q = prompt tokens queued for prefill at w (the prompts without a first token counted whole, as the
            router counts its own: :func:`prefilling`), u = this prompt's tokens w does not hold,
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
    reported a load, a host block is priced as one to recompute. When the worker's KV cannot take the
    prompt beside its running requests' growth, ``ttft`` adds the wait for some to finish (:func:`kv_wait`).
    The score adds ``(decode_harm_weight * D * own + work_weight * (1 + W) * work) / P``, ``P`` being w's pace
    (its seconds over the fleet's mean for the same work, 1 within ``PACE_TOLERANCE``), ``own`` being the
    time its own prefill takes: the D requests decoding on w wait for it; ``work`` is ``own`` as the
    mesh pays for it: a recomputed prefix is capacity lost to everyone, the more so the more requests
    wait (W: the mean waiting per worker), unless the prefix's load needs the copy and it lands in
    free KV (then it is load), or the copy is one a cooling prefix no longer needs on full KV (then
    its hit is priced as a recompute, so the prefix folds back) (:class:`PrefixLoad`, docs/router.md
    "Prefixes over time"). A prompt no worker holds any of is placed where the least content went
    (:meth:`_placement`). The coefficients are learned online from the workers' reports
    (router/core/policies/cost.py), per worker (``--step-cost-fit worker``, the default: a fleet may mix
    GPU types) or pooled over all workers; until there are enough, the same prediction runs in token
    units (a prefill token costs 1).

    **Latency objectives** (docs/router.md, "Latency objectives"): once the step cost is learned, a request's
    TTFT objective is held against ``ttft``: a candidate predicted to miss it loses to every one predicted to
    meet it, and among those the score decides. When none is predicted to meet it, or before the step cost is
    learned (no prediction in seconds yet), the score alone decides. The TPOT objective, held against
    :func:`predicted_tpot` (a decode step of the worker with this request added), does not rank (:meth:`_meets`);
    with the TTFT it decides the refusal (:meth:`objective_miss`).
    """

    name = "kv-aware"
    uses_index = True
    shares_view = True

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.cost = StepCostLearner(group=per_worker if self.config.step_cost_fit == "worker" else None)
        self.prefixes = PrefixLoad()
        self._outputs = 0.0
        self._finished = 0.0

    def started(self, ticket: Ticket, query: RouteQuery, chosen: Candidate) -> None:
        with self._lock:
            self.prefixes.started(ticket.serial, query.block_hashes, chosen.worker_id, ticket.prefill_tokens)

    def finished(self, ticket: Ticket, output_tokens: int) -> None:
        with self._lock:
            self.prefixes.finished(ticket.serial)
            if output_tokens > 0:
                self._outputs = OUTPUT_MEMORY * self._outputs + output_tokens
                self._finished = OUTPUT_MEMORY * self._finished + 1.0

    @property
    def _mean_output(self) -> float:
        """Mean tokens generated by this router's finished requests (0 before one finished)."""
        return self._outputs / self._finished if self._finished else 0.0

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        for c in candidates:
            self.cost.observe(c.worker_id, c.load)
        if not query.index_ok and not any(c.matched_blocks for c in candidates):
            return self.rendezvous(query, candidates, "fallback")
        scores = self.scores(query, candidates)
        meets = self._meets(query, candidates) if query.objectives else None
        if meets is not None and any(meets) and not all(meets):
            # NOTE: every candidate predicted to meet the objectives ranks before every one predicted to
            # miss them (fallbacks too): the misses' scores move past the worst score of all.
            keep = [i for i, ok in enumerate(meets) if ok]
            shift = max(scores) - min(scores) + 1.0
            scores = [s if ok else s + shift for s, ok in zip(scores, meets, strict=True)]
            if self.config.temperature > 0:
                i = keep[self._sample_index([scores[j] for j in keep])]
            else:
                best = min(scores[j] for j in keep)
                i = self._choice_index([j for j in keep if scores[j] == best])
        else:
            meets = None
            i = self._sample_index(scores) if self.config.temperature > 0 else self._argmin_index(scores)
        self._scored = (query, {c.worker_id: s for c, s in zip(candidates, scores, strict=True)})
        if query.adapter and self.prices_adapters and self.cost.learned:
            # NOTE: LoRA: a new prompt is placed only where its adapter need not wait for a slot (the placement
            # balances content, blind to slots; placed on a worker whose slots all serve other adapters, the
            # request would wait there for one to drain), unless every candidate would wait.
            free = [not slot_wait(query, c) for c in candidates]
            if any(free):
                meets = free if meets is None else [a and b for a, b in zip(meets, free, strict=True)]
        placed = self._placement(query, candidates, scores, meets)
        if placed is not None:
            i = placed
        chosen = candidates[i]
        # NOTE: no token-count guard: a hot spot's queue is in its predicted time already.
        return Decision(chosen.worker_id, "prefix" if chosen.matched_blocks or chosen.host_blocks else "load",
                        round(scores[i] * (1000 if self.cost.learned else 1)))

    def scores(self, query: RouteQuery, candidates: Sequence[Candidate]) -> list[float]:
        """Each candidate's score (least wins): seconds once the step cost is learned, else tokens."""
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
        with self._lock:
            share = self.prefixes.replicas(query.block_hashes, [c.worker_id for c in candidates],
                                           [c.matched_blocks for c in candidates])
        scores = []
        # NOTE: what a request costs the others (the decoders' wait, the mesh's work) at the fleet's mean pace: a
        # worker k times slower spends k times the seconds on the same prefill, and its decoders step k times
        # slower anyway; priced in its own seconds, every slow worker looked k times as costly for the same
        # prompt and the long prompts queued on the fast ones (docs/router.md, "kv-aware"). The request's own
        # first token stays in the worker's seconds (it is its latency).
        paces = [p if abs(p - 1.0) > PACE_TOLERANCE else 1.0
                 for p in self.cost.relative_speeds([c.worker_id for c in candidates])] if learned else [1.0] * len(candidates)
        for c, replica, pace in zip(candidates, share, paces, strict=True):
            model = (self.cost.estimate(c.worker_id) or NOMINAL_COST) if learned else NOMINAL_COST
            # NOTE: the host link is learned in seconds: priced once the step cost is too.
            link = self.cost.load_s_per_block(c.worker_id) if learned and c.host_blocks else None
            ttft, own = predicted_ttft(model, query, c, self.config.default_step_tokens, link,
                                       mean_output=self._mean_output if learned else 0.0)
            # NOTE: LoRA (docs/adapters.md): the step that prefills the request first waits for its adapter's
            # load into a GPU slot, and for a slot when every one serves another adapter's requests; priced in
            # seconds once the step cost is (none for a base-model request: its picks are unchanged).
            load = self._adapter_s(model, query, c) if query.adapter and learned else 0.0
            ttft += load
            own += load
            # NOTE: the work a request adds to the mesh: a copy of a prefix that needs one more worker
            # is its load, not a duplicate (where it evicts nothing); where the KV is full, a hit on a
            # copy the prefix no longer needs costs what recomputing it elsewhere would (the prefix
            # folds back, and the copy's blocks go to prefixes that need them).
            work = own
            adjust = copy_in_free_kv(query, c, replica) if replica > 0 else surplus_in_full_kv(query, c, replica)
            if adjust:
                _, work = predicted_ttft(model, query, c, self.config.default_step_tokens, link, extra_held=adjust)
                work += load
            scores.append(ttft + (lam * decoders(c) * own + kappa * work) / pace)
        return scores

    def predictions(self, query: RouteQuery, candidates: Sequence[Candidate]) -> list[tuple[float, float]] | None:
        """Each candidate's predicted (TTFT, TPOT) in seconds for this request; None before the step cost
        is learned (the prediction is then in tokens, and no objective can be judged)."""
        if not self.cost.learned:
            return None
        out = []
        for c in candidates:
            model = self.cost.estimate(c.worker_id)
            if model is None:
                return None
            link = self.cost.load_s_per_block(c.worker_id) if c.host_blocks else None
            ttft, _ = predicted_ttft(model, query, c, self.config.default_step_tokens, link,
                                     mean_output=self._mean_output)
            if query.adapter:
                ttft += self._adapter_s(model, query, c)
            out.append((ttft, predicted_tpot(model, query, c)))
        return out

    prices_adapters: ClassVar[bool] = True
    """Whether a LoRA adapter's residency enters the prediction (``kv-aware-no-residency``: only its prefix,
    keyed by the adapter, does)."""

    def _adapter_s(self, m: StepCost, q: RouteQuery, c: Candidate) -> float:
        if not self.prices_adapters:
            return 0.0
        # NOTE: the load costs the workers' reports taught (router/core/policies/cost.py); the configured ones
        # until a worker reported a load of that kind
        cpu = self.cost.load_s("adapter_cpu", c.worker_id)
        disk = self.cost.load_s("adapter_disk", c.worker_id)
        return adapter_wait_s(m, q, c, self.config.adapter_cpu_load_s if cpu is None else cpu,
                              self.config.adapter_disk_load_s if disk is None else disk, self._mean_output)

    def _meets(self, query: RouteQuery, candidates: Sequence[Candidate]) -> list[bool] | None:
        """Whether each candidate is predicted to meet the query's TTFT objective (the ranking's tier); None when
        none can be judged, or the query has no TTFT objective.

        NOTE: the TPOT objective does not rank: predicted as one decode step with the request added, it leaves
        out the prefills that later share the request's steps, and ranking by it moved requests off their
        prefixes onto workers that then took other long prompts: code-generation's goodput at rate 8 fell to
        0.349 req/s against 0.487 ranking by the TTFT alone (docs/benchmarks.md, "Goodput under latency
        objectives"). It still counts in :meth:`objective_miss` (the refusal)."""
        o = query.objectives
        if not o.ttft_s:
            return None
        predicted = self.predictions(query, candidates)
        if predicted is None:
            return None
        return [ttft <= o.ttft_s for ttft, _ in predicted]

    def objective_miss(self, query: RouteQuery, candidates: Sequence[Candidate]) -> ObjectiveMiss | None:
        """Which objective no candidate is predicted to meet (a TTFT met only where the TPOT is missed is
        named with the best TTFT among the candidates that meet the TPOT); None when one meets both, or
        before the step cost is learned."""
        o = query.objectives
        if not o:
            return None
        predicted = self.predictions(query, candidates)
        if predicted is None:
            return None
        if any((not o.ttft_s or t <= o.ttft_s) and (not o.tpot_s or d <= o.tpot_s) for t, d in predicted):
            return None
        ttft = min(t for t, _ in predicted)
        if o.ttft_s and ttft > o.ttft_s:
            return ObjectiveMiss("ttft", o.ttft_s, ttft)
        tpot = min(d for _, d in predicted)
        if tpot > o.tpot_s:
            return ObjectiveMiss("tpot", o.tpot_s, tpot)
        return ObjectiveMiss("ttft", o.ttft_s, min(t for t, d in predicted if d <= o.tpot_s))

    def _placement(self, query: RouteQuery, candidates: Sequence[Candidate], scores: Sequence[float],
                   meets: Sequence[bool] | None = None) -> int | None:
        """Where a prompt that no worker holds any of goes, while prompts repeat: among the workers
        whose score is no worse than the mean, to the one given the least content to hold, in prefill
        seconds (ties: the best score); None = the score decides (the prompt continues something
        held, or prompts do not repeat). ``meets``: whether each candidate is predicted to meet the
        request's objectives (None = all are): only those are placed on, the mean taken over them.

        NOTE: a new prompt commits its worker to the requests that will share it, which the queue now
        cannot show. Placed by the queue alone, 150 prefix groups landed on 32 workers 2 to 8 apiece
        (whichever were idle as each group began) and their later requests overloaded the workers
        with many; SGLang's router places a new prompt on its smallest tree for the same reason. A
        worker given more than its KV cache holds is full either way: it takes no placement, and when
        every worker is, the score decides. Only workers predicted no worse than the mean are placed
        on: given content is history, and a worker given little may be the one whose queue is long
        now (on synthetic prompts, several routers placing by content alone sent the same burst to
        the same few workers and served 0.58-0.65 of one router's rate)."""
        if not query.block_hashes or any(c.matched_blocks or c.host_blocks for c in candidates):
            return None
        with self._lock:
            if self.prefixes.repeat_share <= 0.0:
                return None
            given = [self.prefixes.given(c.worker_id) for c in candidates]
        eligible = [True] * len(candidates) if meets is None else meets
        kept = [s for s, ok in zip(scores, eligible, strict=True) if ok]
        bound = sum(kept) / len(kept)
        keys = []
        for c, g, score, ok in zip(candidates, given, scores, eligible, strict=True):
            if not ok or score > bound:
                keys.append(math.inf)  # NOTE: predicted worse than the mean now: its queue decides
                continue
            capacity = c.load.num_total_blocks * query.block_size
            if capacity and g >= capacity:
                keys.append(math.inf)  # NOTE: its cache is full either way: no placement to balance
                continue
            # NOTE: in the worker's seconds: a fleet may mix GPUs, and a slower one serves less.
            keys.append(g * self.cost.relative_speed(c.worker_id))
        least = min(keys)
        if least == math.inf:
            return None
        tied = [i for i, k in enumerate(keys) if k == least]
        best = min(scores[i] for i in tied)
        return self._choice_index([i for i in tied if scores[i] == best])

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


class KvAwareNoResidencyPolicy(KvAwarePolicy):
    """kv-aware blind to LoRA residency: the prefix under the adapter counts, the adapter's load and slots do
    not (the ablation of docs/adapters.md)."""

    name = "kv-aware-no-residency"
    prices_adapters = False


OUTPUT_MEMORY = 0.99
"""Weight the mean output length keeps per finished request (~100 requests of memory)."""

NOMINAL_COST = StepCost(step_s=0.0, prefill_token_s=1.0, prefill_pair_s=0.0, decode_seq_s=0.0,
                        decode_context_token_s=0.0, pairs_per_prefill_token=0.0)
"""kv-aware's step cost before any is learned: time in prefill tokens."""


def decoders(c: Candidate) -> int:
    """Requests at the worker that share its steps: its report (plus the picks it does not cover
    yet) or this router's view, the larger."""
    return max(c.load.num_running + c.pending.requests, c.inflight_requests)


def prefilling(c: Candidate) -> int:
    """Uncached prompt tokens of the worker's requests without a token yet, each counted whole until then:
    this router's own count, or the worker's report of every router's (plus the picks it does not cover
    yet), the larger. Several routers see what one router sees of its own (docs/router.md, "Several
    routers"); a worker that does not report it (a bridged engine) leaves its queue to compute."""
    return max(c.load.prefilling_tokens + c.pending.prefill_tokens, c.inflight_prefill_tokens)


def free_kv_blocks(c: Candidate) -> int:
    """Blocks of the worker that hold no cached prefix: what a new prefix fills without evicting one
    (its total less those cached or in use, less the picks not in its report yet); 0 when unknown."""
    total = c.load.num_total_blocks
    if not total:
        return 0
    taken = max(c.load.num_cached_blocks, total - c.load.num_free_blocks)
    return max(0, total - taken - c.pending.blocks)


def copy_in_free_kv(q: RouteQuery, c: Candidate, hot: float) -> float:
    """Of the ``hot`` blocks a copy on the candidate would carry, those whose place is free KV: a copy
    that evicts cached blocks costs what they would have saved, so it is priced as a duplicate (the
    prompt's other new blocks take their places first)."""
    if not hot:
        return 0
    new = -(-max(0, q.prompt_len - c.matched_blocks * q.block_size) // q.block_size)
    return max(0, min(hot, hot - (new - free_kv_blocks(c))))


def surplus_in_full_kv(q: RouteQuery, c: Candidate, surplus: float) -> float:
    """``surplus`` (<= 0: minus the blocks the candidate holds of prefixes that need fewer holders) where
    its KV is full, else 0: a copy in free KV displaces nothing and serves as well as any."""
    if not surplus or not c.load.num_total_blocks:  # NOTE: an unknown pool is not a full one
        return 0
    new = -(-max(0, q.prompt_len - c.matched_blocks * q.block_size) // q.block_size)
    return surplus if free_kv_blocks(c) < new else 0


def kv_wait(per_step: float, q: RouteQuery, c: Candidate, queue: int, u: int, mean_output: float) -> float:
    """Seconds the request waits for KV space on the candidate: the blocks its running requests hold
    and will grow by (half their mean output to go), the queued prompts' and its own, past the
    worker's blocks, freed as running requests finish (each frees its share; they finish at D per
    ``mean_output / 2`` decode steps). 0 while they fit, or before outputs or step costs are known."""
    total = c.load.num_total_blocks
    d = decoders(c)
    if not total or mean_output <= 0 or per_step <= 0 or not d:
        return 0.0
    bs = q.block_size
    used = used_blocks(c)
    deficit = used + (queue + u) / bs + d * mean_output / (2 * bs) - total
    if deficit <= 0 or used <= 0:
        return 0.0
    # NOTE: requests to finish (deficit / blocks each), at D every mean_output / 2 steps
    return deficit / (used / d) * (mean_output / 2) * per_step / d


def adapter_wait_s(m: StepCost, q: RouteQuery, c: Candidate, cpu_load_s: float, disk_load_s: float,
                   mean_output: float) -> float:
    """Seconds the request's first step waits on the candidate for its LoRA adapter (``q.adapter``): 0 in a GPU
    slot; else its load (from CPU memory or disk), plus, when the other adapters with requests in flight fill
    every slot, the wait for slots to drain: the scheduler admits no more distinct adapters than slots, so the
    request waits until n = (those adapters - slots + 1) of them have drained (the ones past the slots wait for a
    slot too, ahead of it); an adapter of k requests drains when the last finishes, k/(k+1) of a mean output of
    decode steps (the expected maximum of k remainders uniform over it); the n with the fewest requests, one
    after another (an upper bound: drains overlap)."""
    mine = c.load.adapter(q.adapter) if q.adapter else None
    if mine is None or mine.level == AdapterLevel.GPU:
        return 0.0
    wait = cpu_load_s if mine.level == AdapterLevel.CPU else disk_load_s
    busy = sorted(a.requests for a in c.load.adapters if a.requests and a.name != q.adapter)
    ahead = len(busy) - c.load.max_loras + 1 if c.load.max_loras else 0
    if ahead > 0 and mean_output > 0:
        per_step = m.step_s + m.decode_seq_s * decoders(c) + m.decode_context_token_s * used_blocks(c) * q.block_size
        wait += per_step * mean_output * sum(k / (k + 1) for k in busy[:ahead])
    return wait


def slot_wait(q: RouteQuery, c: Candidate) -> bool:
    """Whether the request's adapter would wait on the candidate for a GPU slot: not in one, and at least as many
    other adapters with requests in flight as the worker has slots."""
    mine = c.load.adapter(q.adapter) if q.adapter else None
    if mine is None or mine.level == AdapterLevel.GPU or not c.load.max_loras:
        return False
    return sum(1 for a in c.load.adapters if a.requests and a.name != q.adapter) >= c.load.max_loras


def predicted_tpot(m: StepCost, q: RouteQuery, c: Candidate) -> float:
    """Seconds of one decode step on the candidate with this request added: one more sequence, and its
    prompt in the context the step reads (what each of its output tokens after the first waits for)."""
    return (m.step_s + m.decode_seq_s * (decoders(c) + 1)
            + m.decode_context_token_s * (used_blocks(c) * q.block_size + q.prompt_len))


def predicted_ttft(m: StepCost, q: RouteQuery, c: Candidate, default_step_tokens: int = 2048,
                   load_s_per_block: float | None = None, extra_held: float = 0,
                   mean_output: float = 0.0) -> tuple[float, float]:
    """(seconds until this request's first token on the candidate, seconds its own prefill and loads
    add to the worker's steps) (see KvAwarePolicy). ``load_s_per_block``: the worker's host link, or
    None to price its host-tier blocks as blocks to recompute. ``extra_held``: blocks past its match
    to count as held."""
    host = c.host_blocks if load_s_per_block is not None else 0
    u = max(0, q.prompt_len - (c.matched_blocks + extra_held + host) * q.block_size)
    h = q.prompt_len - u
    queue = max(queued_prefill(c), prefilling(c))
    budget = c.load.max_num_batched_tokens or default_step_tokens
    steps = max(1, -(-(queue + u) // budget))
    own_steps = -(-u // budget)
    per_step = m.step_s + m.decode_seq_s * decoders(c) + m.decode_context_token_s * used_blocks(c) * q.block_size
    own = m.prefill_token_s * u + m.prefill_pair_s * (u * h + u * (u + 1) / 2) + own_steps * per_step
    if host:
        own += load_s_per_block * host
    ttft = (m.prefill_token_s * queue + m.prefill_pair_s * queue * m.pairs_per_prefill_token
            + own + (steps - own_steps) * per_step)
    if mean_output:
        ttft += kv_wait(per_step, q, c, queue, u, mean_output)
    return ttft, own
