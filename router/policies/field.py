"""The field's routing policies, each from its published formula and defaults (docs/router.md cites
the sources): ``dynamo``, ``llm-d``, ``preble``, ``lmetric``. Written for kvmesh's candidates; no
code of those projects is copied.

Every policy sees the same inputs as kv-aware: the Lookup's prefix matches (max with the
speculative map), the worker's last reported load and this router's in-flight view, combined as
in router/policies/ (the larger of the report and the own view). Where the original reads a
signal kvmesh does not carry, the nearest one is used and the docstring says so.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvmesh.router.policies.base import (
    Candidate,
    Decision,
    PolicyConfig,
    RouteQuery,
    RouterPolicy,
    busy_requests,
    queued_prefill,
    uncached_tokens,
    used_blocks,
)
from kvmesh.router.policies.cost import StepCostLearner


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) if block_size else 0


class DynamoPolicy(RouterPolicy):
    """NVIDIA Dynamo's KV router (lib/llm/src/kv_router/scheduler.rs, ``DefaultWorkerSelector``):

        logit = overlap_score_weight * potential_prefill_blocks + potential_decode_blocks

    lowest wins (``router_temperature`` 0: the argmin, ties at random). ``potential_prefill_blocks``
    = (prefill tokens already pending on the worker + this request's uncached tokens) / block
    size; ``potential_decode_blocks`` = the worker's active blocks + this request's new blocks.
    Dynamo tracks both in the router (its active sequences); here the pending prefill and the
    active blocks are the larger of the worker's report and this router's in-flight view.
    ``overlap_score_weight`` = ``--overlap-weight`` (default 1, as Dynamo's).
    """

    name = "dynamo"
    uses_index = True

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        bs = query.block_size
        w = self.config.overlap_weight
        prompt_blocks = _blocks(query.prompt_len, bs)
        logits = []
        for c in candidates:
            prefill_blocks = (queued_prefill(c) + uncached_tokens(c, query)) / bs
            decode_blocks = used_blocks(c) + max(0, prompt_blocks - c.matched_blocks)
            logits.append(w * prefill_blocks + decode_blocks)
        best = min(logits)
        i = self._choice_index([i for i, v in enumerate(logits) if v == best])
        chosen = candidates[i]
        return Decision(chosen.worker_id, "prefix" if chosen.matched_blocks else "load", round(best))


class LlmdPolicy(RouterPolicy):
    """llm-d's inference scheduler with its precise-prefix-cache profile: a weighted sum of three
    scorers, highest wins (ties at random):

    - precise prefix-cache scorer (llm-d-inference-scheduler pkg/plugins/scorer/precise_prefix_cache.go
      over llm-d-kv-cache-manager's longest-prefix index): longest consecutive matched blocks /
      the prompt's blocks, weight 3;
    - queue scorer (gateway-api-inference-extension .../scorer/queue.go): (maxQ - q) / (maxQ - minQ)
      over the candidates' waiting queues, 1 when all are equal, weight 2;
    - KV-cache utilisation scorer (.../scorer/kvcache_utilization.go): 1 - usage, weight 2.

    llm-d scrapes the queue and usage from the pods every 50 ms; here they are the larger of the
    worker's report and this router's own view (requests not yet past their first token, blocks).
    """

    name = "llm-d"
    uses_index = True
    weights = (3.0, 2.0, 2.0)

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        prompt_blocks = max(1, len(query.block_hashes))
        queues = [max(c.load.num_waiting, c.inflight_waiting) for c in candidates]
        lo, hi = min(queues), max(queues)
        wp, wq, wk = self.weights
        scores = []
        for c, q in zip(candidates, queues, strict=True):
            prefix = min(1.0, c.matched_blocks / prompt_blocks)
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            total = c.load.num_total_blocks
            usage = min(1.0, used_blocks(c) / total) if total else 0.0
            scores.append(wp * prefix + wq * queue + wk * (1.0 - usage))
        best = max(scores)
        i = self._choice_index([i for i, v in enumerate(scores) if v == best])
        chosen = candidates[i]
        return Decision(chosen.worker_id, "prefix" if chosen.matched_blocks else "load", round(best * 1000))


class PreblePolicy(RouterPolicy):
    """Preble's E2 scheduling (Srivatsa et al., "Preble: Efficient Distributed Prompt Scheduling
    for LLM Serving", ICLR 2025; WukLab/preble multi_node/global_scheduler_with_time.py):

    - **exploit** when the longest cached prefix covers more of the prompt than it leaves to
      compute (cached > missed): among the workers holding that longest prefix, the one with the
      least windowed load;
    - **explore** otherwise: the worker with the least windowed load.

    Windowed load of a worker: over the requests this router sent it in the last ``window_s``
    (Preble: 3 minutes), each one's prefill time (its missed tokens) plus its decode time
    (max_tokens x a decode step). Times come from the learned step cost (router/policies/cost.py; Preble
    fits a profiled model per GPU), a plain token count before enough reports. Preble's
    post-assignment load adjustment is approximated by kvmesh's hot-spot test on those windowed
    loads (an exploit target above ``balance_factor`` x the mean goes to the least loaded worker);
    its eviction cost term and prefix autoscaling are not modelled.
    """

    name = "preble"
    uses_index = True
    window_s = 180.0

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._clock = self.config.clock
        self.cost = StepCostLearner()
        self._history: deque[tuple[float, str, int, int]] = deque()
        # worker -> [missed prefill tokens, decode tokens] sent within the window
        self._sent: dict[str, list[int]] = {}

    def _coefficients(self) -> tuple[float, float]:
        """(seconds per prefill token, seconds per decode token), or a nominal token count."""
        m = self.cost.estimate()
        if m is None:
            return 1.0, float(self.config.decode_cost_tokens)
        return m.prefill_token_s + m.prefill_pair_s * m.pairs_per_prefill_token, m.step_s + m.decode_seq_s

    def _pick_min(self, idx: Sequence[int], keys: Sequence[float]) -> int:
        low = min(keys)
        tied = [i for i, k in zip(idx, keys, strict=True) if k == low]
        return tied[0] if len(tied) == 1 else tied[self._rng.randrange(len(tied))]

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        for c in candidates:
            self.cost.observe(c.worker_id, c.load)
        now = self._clock()
        with self._lock:
            while self._history and self._history[0][0] <= now - self.window_s:
                _, w, p, d = self._history.popleft()
                self._sent[w][0] -= p
                self._sent[w][1] -= d
            per_prefill, per_decode = self._coefficients()
            loads = [per_prefill * s[0] + per_decode * s[1] if (s := self._sent.get(c.worker_id)) else 0.0
                     for c in candidates]
            missed = [uncached_tokens(c, query) for c in candidates]
            least = min(missed)
            cached = query.prompt_len - least
            everyone = range(len(candidates))
            if cached > least:
                holders = [i for i in everyone if missed[i] == least]
                i = self._pick_min(holders, [loads[j] for j in holders])
                reason = "exploit"
                if self._hot(loads[i], loads):
                    i = self._pick_min(everyone, loads)
                    reason = "balance"
            else:
                i = self._pick_min(everyone, loads)
                reason = "explore"
            chosen = candidates[i]
            decode = max(1, query.max_tokens)
            self._history.append((now, chosen.worker_id, missed[i], decode))
            sent = self._sent.setdefault(chosen.worker_id, [0, 0])
            sent[0] += missed[i]
            sent[1] += decode
        return Decision(chosen.worker_id, reason, round(loads[i] * 1000))

    def _hot(self, load: float, all_loads: Sequence[float]) -> bool:
        """The hot-spot test on windowed loads: above ``balance_factor`` x their mean."""
        mean = sum(all_loads) / len(all_loads)
        return mean > 0 and load > self.config.balance_factor * mean


class LmetricPolicy(RouterPolicy):
    """LMetric (Zhang et al., "Simple is Better: Multiplication May Be All You Need for LLM Request
    Scheduling", arXiv 2603.15202): the product of a KV-cache indicator and a load indicator, lowest
    wins, no weights to tune:

        score = P_tokens x BS

    P_tokens = the prefill tokens the worker would have if the request went there (pending prefill +
    this request's uncached tokens), BS = the worker's batch size (its requests). An idle worker
    scores 0 whatever its cache; ties go to the fewest P_tokens, then at random.
    """

    name = "lmetric"
    uses_index = True

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        keys = []
        for c in candidates:
            p = queued_prefill(c) + uncached_tokens(c, query)
            keys.append((p * busy_requests(c), p))
        best = min(keys)
        i = self._choice_index([i for i, k in enumerate(keys) if k == best])
        chosen = candidates[i]
        return Decision(chosen.worker_id, "prefix" if chosen.matched_blocks else "load", best[0])
