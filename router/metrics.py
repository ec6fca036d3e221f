"""Prometheus metrics of the router (names under kvmesh_router_)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter("kvmesh_router_decisions_total", "Routing decisions", ["policy", "reason"])
LOOKUP_LATENCY = Histogram(
    "kvmesh_router_lookup_latency_seconds", "kv_service Lookup round trip seen by the router",
    buckets=(1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5),
)
DECISION_LATENCY = Histogram(
    "kvmesh_router_decision_latency_seconds", "Tokenize + hash + lookup + pick",
    buckets=(1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5),
)
FALLBACKS = Counter("kvmesh_router_fallbacks_total", "Requests routed without the index", ["cause"])
RETRIES = Counter("kvmesh_router_retries_total", "Retries on another worker before the first token", ["failure"])
REQUESTS = Counter("kvmesh_router_requests_total", "Generate requests by outcome", ["outcome"])
INFLIGHT = Gauge("kvmesh_router_inflight_requests", "Generate streams open")


class PrometheusObserver:
    """router/core.py's DecisionObserver on these metrics."""

    def decision(self, policy: str, reason: str) -> None:
        DECISIONS.labels(policy, reason).inc()

    def fallback(self, cause: str) -> None:
        FALLBACKS.labels(cause).inc()

    def lookup_latency(self, seconds: float) -> None:
        LOOKUP_LATENCY.observe(seconds)
