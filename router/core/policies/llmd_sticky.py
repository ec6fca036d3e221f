"""llm-d's "sticky until saturated" scheduler (its default since 2026-08): ``llm-d-sticky`` (prefill-bound,
token-load scorer) and ``llm-d-sticky-decode`` (decode-bound, active-request scorer).

Sources (read 2026-11-29; no code copied):

- llm-d/llm-d.github.io @25e593b2 ``blog/2026-08-17_bottleneck-aware-scheduling-for-llm-inference.mdx``
  (the two matched configurations, the derivation of the saturation threshold, explorationProbability 0);
- llm-d/llm-d-router (llm-d-inference-scheduler's new name) @ebab6879:
  ``pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go`` (the filter and its defaults),
  ``.../scheduling/scorer/tokenload/token_load.go``, ``.../scheduling/scorer/activerequest/active_request.go``,
  ``.../scheduling/picker/maxscore/picker.go``, ``.../requestcontrol/dataproducer/inflightload/producer.go``
  (what the in-flight counters hold and when they are released);
- llm-d/llm-d @0a3b0c93 ``guides/optimized-baseline/router/optimized-baseline.values.yaml`` (the profile).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvmesh.router.core.inflight import Ticket
from kvmesh.router.core.policies.base import Candidate, Decision, PolicyConfig, RouteQuery, RouterPolicy


class LlmdStickyPolicy(RouterPolicy):
    """llm-d's prefill-bound matched configuration: ``prefix-cache-affinity-filter`` → ``token-load-scorer``
    → ``max-score-picker``.

    ::

        hit_w      = indexed blocks of w / the prompt's blocks           (PrefixCacheMatchInfo)
        sticky     = {w : hit_w >= 0.8};  none sticky -> every worker stays
        gate       = (min over sticky of inflight_w - min over the rest of inflight_w) / R_peak * 1000
                     > maxTTFTPenaltyMs  -> every worker stays (stickiness broken), else only the sticky
        load_w     = inflight_w + (prompt_len - indexed blocks of w * block size)
        score_w    = 1 - min(1, load_w / 4,194,304);  highest wins, ties at random

    ``inflight_w`` is this router's own count (llm-d's ``inflight-load-producer``): the uncached prompt tokens
    of its requests to w, counted at dispatch with w's match then, released at the request's first streamed
    chunk (``addEstimatedOutputTokens`` false, the default) or its end. The policy keeps it from the router's
    :meth:`started`, :meth:`prefilled` and :meth:`finished` calls; it reads no worker report.

    Saturation threshold τ = R_peak × T_max, as llm-d's calibration recipe measures it
    (``peakPrefillThroughput = CHUNK_SIZE / TTFT`` of one cache-miss chunk on an idle endpoint): on the
    simulator's cost model (model_worker/simulated/step_time.py, roofline of Llama-3.1-8B on the default
    H100, ``max-num-batched-tokens`` 8192) one 8192-token chunk takes 0.4317 s, so R_peak = 18,975 tok/s;
    T_max = the filter's shipped ``maxTTFTPenaltyMs`` 18,000 ms, so τ ≈ 341,546 tokens (llm-d's reference:
    15,928 × 18 s = 286,704). tests/router/core/policies/test_llmd_sticky.py checks R_peak against the cost model.

    Deviations (docs/router.md, "Peers: what differs from the source"; for = flatters kvmesh):

    - the prefix score is kvmesh's KV-event index (``indexed_blocks``, llm-d's precise producer's view) and not
      the optimized-baseline guide's ``approx-prefix-cache-producer`` (a router-side, LRU-bounded record of its
      own picks): against, likely (the index sees evictions and the other routers' placements; it lags the
      router's own picks by the event delay);
    - tier-blind: a host-tier block counts as uncached, as in the approximate producer: neutral;
    - one R_peak for every worker (the default GPU's), as llm-d has one value per filter: for, on a mixed fleet
      (a slower GPU's saturation is seen late);
    - several routers: each keeps its own counters (llm-d's per-replica producer; its cross-replica state
      sharing is not modelled): for, slightly;
    - τ from the simulator's step time of one cold chunk; llm-d's recipe takes the median TTFT through the whole
      request path, a lower R_peak (its reference path: 22 % under its single-request fit): unknown, small;
    - token counts are exact (llm-d counts tokens from its tokenizer producer too): neutral.
    """

    name = "llm-d-sticky"
    uses_index = True
    affinity_threshold: ClassVar[float] = 0.8
    exploration_probability: ClassVar[float] = 0.0
    peak_prefill_throughput: ClassVar[float] = 18_975.0
    """R_peak, tokens/s: 8192 / the simulator's step time of one 8192-token cache-miss chunk (H100 roofline)."""
    max_ttft_penalty_ms: ClassVar[float] = 18_000.0
    """T_max: the filter's shipped default."""
    queue_threshold_tokens: ClassVar[int] = 4_194_304
    """The token-load scorer's normalisation: a load at or past it scores 0."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._tokens: dict[str, int] = {}
        """worker -> uncached prompt tokens of this router's requests not yet past their first chunk."""
        self._requests: dict[str, int] = {}
        """worker -> this router's requests not finished."""
        self._open: dict[int, list] = {}
        """ticket serial -> [worker, tokens still counted]."""

    @property
    def saturation_tokens(self) -> float:
        """τ: the in-flight gap (tokens) past which stickiness breaks."""
        return self.peak_prefill_throughput * self.max_ttft_penalty_ms / 1000

    def inflight_tokens(self, worker_id: str) -> int:
        return self._tokens.get(worker_id, 0)

    def inflight_requests(self, worker_id: str) -> int:
        return self._requests.get(worker_id, 0)

    # -- the pipeline ---------------------------------------------------------------------
    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        with self._lock:
            kept, reason = self._affinity_filter(query, candidates)
            scores = [self._score(query, c, kept) for c in kept]
        best = max(scores)
        chosen = kept[self._choice_index([i for i, s in enumerate(scores) if s == best])]
        return Decision(chosen.worker_id, reason, self._load(query, chosen))

    def _affinity_filter(self, query: RouteQuery, candidates: Sequence[Candidate]) -> tuple[Sequence[Candidate], str]:
        """``prefix-cache-affinity-filter``: the sticky workers, unless none is or the TTFT gate breaks."""
        if len(candidates) <= 1 or self.affinity_threshold <= 0:
            return candidates, "load"
        if self.exploration_probability and self._rng.random() < self.exploration_probability:
            return candidates, "load"
        total = len(query.block_hashes)
        sticky: list[Candidate] = []
        rest: list[Candidate] = []
        for c in candidates:
            (sticky if total and c.indexed_blocks / total >= self.affinity_threshold else rest).append(c)
        if not sticky:
            return candidates, "load"
        if self.max_ttft_penalty_ms > 0 and rest:
            gap_ms = self._best_ttft_ms(sticky) - self._best_ttft_ms(rest)
            if gap_ms > self.max_ttft_penalty_ms:
                return candidates, "balance"
        return sticky, "prefix"

    def _best_ttft_ms(self, workers: Sequence[Candidate]) -> float:
        # NOTE: the filter's estimate reads the in-flight tokens alone, not the request's own (llm-d @ebab6879).
        return min(self.inflight_tokens(c.worker_id) for c in workers) / self.peak_prefill_throughput * 1000

    def _load(self, query: RouteQuery, c: Candidate) -> int:
        """The token-load scorer's input: in flight + this request's uncached tokens there."""
        return self.inflight_tokens(c.worker_id) + uncached_prompt(query, c)

    def _score(self, query: RouteQuery, c: Candidate, kept: Sequence[Candidate]) -> float:
        """``token-load-scorer``: highest is best."""
        load = self._load(query, c)
        return 1.0 if load <= 0 else 1.0 - min(load, self.queue_threshold_tokens) / self.queue_threshold_tokens

    # -- the inflight-load producer: this router's own requests --------------------------
    def started(self, ticket: Ticket, query: RouteQuery, chosen: Candidate) -> None:
        tokens = uncached_prompt(query, chosen)
        w = chosen.worker_id
        with self._lock:
            self._open[ticket.serial] = [w, tokens]
            self._tokens[w] = self._tokens.get(w, 0) + tokens
            self._requests[w] = self._requests.get(w, 0) + 1

    def prefilled(self, ticket: Ticket) -> None:
        with self._lock:
            self._release_tokens(self._open.get(ticket.serial))

    def finished(self, ticket: Ticket, output_tokens: int) -> None:
        with self._lock:
            entry = self._open.pop(ticket.serial, None)
            if entry is None:
                return
            self._release_tokens(entry)
            self._requests[entry[0]] -= 1

    def _release_tokens(self, entry: list | None) -> None:
        if entry is not None and entry[1]:
            self._tokens[entry[0]] -= entry[1]
            entry[1] = 0


class LlmdStickyDecodePolicy(LlmdStickyPolicy):
    """llm-d's decode-bound matched configuration: the same ``prefix-cache-affinity-filter`` (same τ, on the
    in-flight tokens) → ``active-request-scorer`` → ``max-score-picker``::

        score_w = 1 when w has no request in flight (idleThreshold 0), else (max_n - n_w) / max_n

    n_w = this router's requests to w not finished (released at the response's end); max_n over the workers the
    filter kept. Deviations: as ``llm-d-sticky``.
    """

    name = "llm-d-sticky-decode"

    def _score(self, query: RouteQuery, c: Candidate, kept: Sequence[Candidate]) -> float:
        n = self.inflight_requests(c.worker_id)
        if n <= 0:
            return 1.0
        most = max(self.inflight_requests(k.worker_id) for k in kept)
        return (most - n) / most

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        d = super().pick(query, candidates)
        return Decision(d.worker_id, d.reason, self.inflight_requests(d.worker_id))


def uncached_prompt(query: RouteQuery, c: Candidate) -> int:
    """Prompt tokens the worker computes by the index's device match (the producer's ``uncachedInputTokens``)."""
    return max(0, query.prompt_len - c.indexed_blocks * query.block_size)

