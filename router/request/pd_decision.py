"""The P/D decision as the decide sequence makes it (router/core/pd.py's PDDecider), counted on its way out:
a wrapper, so the decider holds no metric."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.router.core.pd import PDDecider, PDDecision
from kvmesh.router.core.policies.base import Candidate, RouteQuery
from kvmesh.router.metrics import RouterMetrics

THRESHOLD_EVERY = 16
"""The threshold gauge is a bisection of ~20 predictions: every 16th decision keeps it fresh enough."""


class CountedDecider:
    """Args:
    inner: the decider.
    metrics: ``kvmesh_router_pd_*``.
    """

    def __init__(self, inner: PDDecider, metrics: RouterMetrics) -> None:
        self.inner = inner
        self.metrics = metrics
        self.decisions = 0

    def decide(self, q: RouteQuery, decode: Candidate, prefills: list[Candidate],
               decodes: Sequence[Candidate] = ()) -> PDDecision:
        pd = self.inner.decide(q, decode, prefills, decodes)
        m = self.metrics
        m.pd_decisions.labels(pd.reason).inc()
        m.pd_uncached_tokens.labels("yes" if pd.prefill_worker else "no").observe(pd.uncached_tokens)
        if pd.local_s or pd.remote_s:
            m.pd_predicted_s.labels("local").observe(pd.local_s)
            m.pd_predicted_s.labels("remote").observe(pd.remote_s)
        self.decisions += 1
        if prefills and self.inner.cost.learned and self.decisions % THRESHOLD_EVERY == 1:
            m.pd_threshold_tokens.set(self.inner.threshold(q, decode, prefills[0]))
        return pd
