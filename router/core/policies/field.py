"""Two of the field's routing policies: ``llm-d`` and ``lmetric``, each from its source (the
docstrings cite them). ``dynamo`` and ``preble`` keep state of their own and have modules of their
own (dynamo.py, preble.py); SGLang's are approx_tree.py and basic.py's ``prefix-hash``. Written for
kvmesh's candidates; no code of those projects is copied. docs/router.md lists what still differs
from each source and which way it biases a comparison.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvmesh.contract.types import Load
from kvmesh.router.core.policies.base import (
    Candidate,
    Decision,
    PolicyConfig,
    RouteQuery,
    RouterPolicy,
    busy_requests,
    queued_prefill,
)


class LlmdPolicy(RouterPolicy):
    """llm-d's inference scheduler with its precise-prefix-cache profile: a weighted sum of three
    scorers, each clamped to [0, 1], highest wins, ties at random (max-score picker: shuffle, then
    stable sort). Follows (read at these commits; no code copied):

    - llm-d/llm-d-inference-scheduler @520af47896e5: ``deploy/config/epp-precise-prefix-cache-config.yaml``
      (profile and weights), ``pkg/epp/scheduling/scheduler_profile.go`` (weighted sum),
      ``.../scorer/preciseprefixcache/precise_prefix_cache.go`` and ``utils.go`` (prefix score),
      ``.../scorer/queuedepth/queue.go``, ``.../scorer/kvcacheutilization/kvcache_utilization.go``,
      ``.../picker/maxscore/picker.go``, ``pkg/epp/server/options.go`` (``RefreshMetricsInterval`` 50 ms);
    - llm-d/llm-d-kv-cache @7be76e119ca5: ``pkg/kvcache/kvblock_scorer.go`` (``LongestPrefixScorer``);
    - llm-d/llm-d @019a3f3f ``guides/precise-prefix-cache-aware/`` (the guide's values: the same weights);
    - the cache tiers: llm-d/llm-d-kv-cache ``pkg/kvcache/kvblock_scorer.go`` @24d82ea07f5e
      (``LongestPrefixScorer``: a pod stays in the match while it holds the block in any tier, and
      scores the block's largest tier weight, ``getMaxWeight``) and ``pkg/kvcache/backend.go`` @5fe8e2050c07
      (``DefaultKVCacheBackendConfig``: gpu 1.0, cpu 0.8). Not tier-blind: a host block scores 0.8.

    ::

        score_w  = 2 * prefix_w + 1 * queue_w + 1 * kv_w
        prefix_w = min(1, (device blocks + 0.8 * host blocks of the leading run the index says w holds)
                          / the prompt's blocks)   (absolute)
        queue_w  = (maxQ - q_w) / (maxQ - minQ), 1 when all are equal;   q = waiting requests
        kv_w     = 1 - (total - free) / total blocks   (the engine's usage: idle cached blocks count as free)

    The queue and usage are the workers' own figures, as llm-d scrapes them every 50 ms: no router-side
    view. With scrapes (:attr:`scrape_interval_s`, the simulator models them per router) the policy reads
    its last scrape; without (live) the load the index holds. The prefix is the index's answer alone
    (llm-d's speculative indexing is off by default).
    """

    name = "llm-d"
    uses_index = True
    weights = (2.0, 1.0, 1.0)
    """prefix, queue, kv-cache utilisation."""
    medium_weights: ClassVar[dict[str, float]] = {"gpu": 1.0, "cpu": 0.8}
    """llm-d-kv-cache's default backend weights: a block's score by the tier that holds it."""
    scrape_interval_s = 0.05

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._scraped: dict[str, Load] = {}

    def scraped(self, worker_id: str, load: Load) -> None:
        self._scraped[worker_id] = load

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        loads = [self._scraped.get(c.worker_id, c.load) for c in candidates]
        scores = self.scores(query, candidates, loads)
        best = max(scores)
        i = self._choice_index([i for i, v in enumerate(scores) if v == best])
        chosen = candidates[i]
        return Decision(chosen.worker_id, "prefix" if chosen.indexed_blocks or chosen.indexed_host_blocks else "load",
                        round(best * 1000))

    def scores(self, query: RouteQuery, candidates: Sequence[Candidate], loads: Sequence[Load]) -> list[float]:
        """Each candidate's weighted sum (highest wins), ``loads`` being what the policy read of each."""
        total_blocks = len(query.block_hashes)
        queues = [load.num_waiting for load in loads]
        lo, hi = min(queues), max(queues)
        wp, wq, wk = self.weights
        scores = []
        for c, load, q in zip(candidates, loads, queues, strict=True):
            held = c.indexed_blocks + self.medium_weights["cpu"] * c.indexed_host_blocks
            prefix = min(1.0, held / total_blocks) if total_blocks else 0.0
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            total = load.num_total_blocks
            usage = min(1.0, max(0.0, (total - load.num_free_blocks) / total)) if total else 0.0
            scores.append(wp * prefix + wq * queue + wk * (1.0 - usage))
        return scores


class LmetricPolicy(RouterPolicy):
    """LMetric (Zhang et al., "Simple is Better: Multiplication May Be All You Need for LLM Request
    Scheduling", arXiv 2603.15202): the product of a KV-cache indicator and a load indicator, lowest
    wins, no weights to tune:

        score = P_tokens x BS

    P_tokens = the prefill tokens the worker would have if the request went there (pending prefill +
    this request's tokens not on its device), BS = the worker's batch size (its requests). An idle
    worker scores 0 whatever its cache; ties go to the fewest P_tokens, then at random. Tier-blind:
    the paper predates KV tiers, so a host-tier block counts as uncached.

    Source: the paper's abstract only (no authors' code was found). The one code found, a third-party
    port (sgl-project/sglang ``sgl-model-gateway/src/policies/lmetric.rs`` @acaa759a), scores
    ``new_prefill_work * (inflight + 1)``, so the cache still counts on an idle worker; kvmesh keeps the
    abstract's reading (docs/router.md, deviations).
    """

    name = "lmetric"
    uses_index = True

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        keys = []
        for c in candidates:
            p = queued_prefill(c) + max(0, query.prompt_len - c.matched_blocks * query.block_size)
            keys.append((p * busy_requests(c), p))
        best = min(keys)
        i = self._choice_index([i for i, k in enumerate(keys) if k == best])
        chosen = candidates[i]
        return Decision(chosen.worker_id, "prefix" if chosen.matched_blocks else "load", best[0])
