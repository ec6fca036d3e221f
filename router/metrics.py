"""Prometheus metrics of the router (names under kvmesh_router_), on a registry of their own.

The server makes one ``RouterMetrics`` at start and serves its registry on ``/metrics``; the
request path gets it passed in and it is router/core/routing.py's DecisionObserver. Nothing registers at
import, so several routers (tests, a simulator's many cores) live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
_AUDIT_BUCKETS = (-256, -64, -16, -4, -1, 0, 1, 4, 16, 64, 256)
"""Predicted minus cached blocks: le=-1 counts the unseen hits, the count above le=0 the silent misses."""


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.decisions = Counter("kvmesh_router_decisions_total", "Routing decisions", ["policy", "reason"],
                                 registry=r)
        self.lookup_latency_s = Histogram(
            "kvmesh_router_lookup_latency_seconds", "kv_service Lookup round trip seen by the router",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.decision_latency_s = Histogram(
            "kvmesh_router_decision_latency_seconds", "Tokenize + hash + lookup + pick", buckets=_LATENCY_BUCKETS,
            registry=r)
        self.fallbacks = Counter("kvmesh_router_fallbacks_total", "Requests routed without the index", ["cause"],
                                 registry=r)
        self.retries = Counter("kvmesh_router_retries_total", "Retries on another worker before the first token",
                               ["failure"], registry=r)
        self.migrations = Counter("kvmesh_router_migrations_total", "Streams continued on another worker after theirs "
                                  "failed mid-stream (--migration-limit)", registry=r)
        self.reservations = Counter("kvmesh_router_reservations_total",
                              "Picks reserved in the kv_service (the shared router view), by outcome: folded (the "
                              "Lookup's own reservation was the pick: no Reserve), reserved, conflict (another router reserved the worker first: picked again), failed (the "
                              "kv_service did not answer: forwarded unreserved)", ["outcome"], registry=r)
        # prefill/decode disaggregation (docs/router.md): the decision, its inputs, and the legs
        self.pd_decisions = Counter("kvmesh_router_pd_decisions_total", "Prefill/decode decisions of requests to a "
                                    "P/D fleet, by reason (disaggregated, short, prefill_busy, cached, no_prefill_worker, "
                                    "mode, cold_short)", ["reason"], registry=r)
        self.pd_uncached_tokens = Histogram("kvmesh_router_pd_uncached_tokens", "Prompt tokens the chosen decode "
                                            "worker lacked, per P/D decision", ["split"],
                                            buckets=(16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536), registry=r)
        self.pd_threshold_tokens = Gauge("kvmesh_router_pd_threshold_tokens", "The prompt length at which the last "
                                         "decision would split, at an idle prefill worker (learned from step costs)",
                                         registry=r)
        self.pd_predicted_s = Histogram("kvmesh_router_pd_predicted_seconds", "The decision's predictions: local "
                                        "(the decode worker prefills) and remote (a prefill worker, then the transfer)",
                                        ["path"], buckets=_LATENCY_BUCKETS, registry=r)
        self.pd_transfers = Counter("kvmesh_router_pd_transfers_total", "Decode legs of split requests by how the KV "
                                    "came (nixl, grpc, local = the transfer failed or nothing was needed)",
                                    ["transport"], registry=r)
        self.pd_prefill_failures = Counter("kvmesh_router_pd_prefill_failures_total", "Prefill legs that failed (the "
                                           "decode worker then prefilled the prompt)", ["failure"], registry=r)
        self.requests = Counter("kvmesh_router_requests_total", "Generate requests by outcome", ["outcome"],
                                registry=r)
        self.inflight = Gauge("kvmesh_router_inflight_requests", "Generate streams open", registry=r)
        self.refused = Counter("kvmesh_router_refused_total", "Generate streams refused at --max-streams",
                               registry=r)
        self.slo_refusals = Counter(
            "kvmesh_router_slo_refusals_total", "Requests refused because no worker is predicted to meet their "
            "latency objective (--slo-refuse), by the objective (ttft, tpot)", ["objective"], registry=r)
        self.prompts_refused = Counter(
            "kvmesh_router_prompts_refused_total", "Prompts refused over a bound (bytes: before tokenizing)",
            ["limit"], registry=r)
        self.tokenized_chars = Counter(
            "kvmesh_router_tokenized_chars_total", "Characters of text prompts handed to the tokenizer", registry=r)
        self.tokenizing = Gauge("kvmesh_router_tokenizing_texts", "Long texts being tokenized off the event loop",
                                registry=r)

        self.audit_requests = Counter(
            "kvmesh_router_audit_requests_total", "Requests audited per worker: routed with a Lookup answer, and "
            "the engine reported the prompt's cached tokens (docs/router.md, \"Miss audit\")", ["worker"], registry=r)
        self.audit_predicted = Counter(
            "kvmesh_router_audit_predicted_blocks_total", "Blocks the index said the worker holds of audited "
            "prompts (capped at the prompt less its last token)", ["worker"], registry=r)
        self.audit_cached = Counter(
            "kvmesh_router_audit_cached_blocks_total", "Blocks the engine reported cached of audited prompts",
            ["worker"], registry=r)
        self.audit_silent = Counter(
            "kvmesh_router_audit_silent_misses_total", "Audited requests predicted at least one block more than "
            "the engine used", ["worker"], registry=r)
        self.audit_unseen = Counter(
            "kvmesh_router_audit_unseen_hits_total", "Audited requests predicted at least one block less than "
            "the engine used", ["worker"], registry=r)
        self.audit_error = Histogram(
            "kvmesh_router_audit_error_blocks", "Predicted minus cached blocks per audited request (> 0: silent "
            "miss; < 0: unseen hit)", ["worker"], buckets=_AUDIT_BUCKETS, registry=r)

    def audited(self, worker: str, predicted: int, cached: int) -> None:
        """One audited request (router/core/audit.py)."""
        self.audit_requests.labels(worker).inc()
        self.audit_predicted.labels(worker).inc(predicted)
        self.audit_cached.labels(worker).inc(cached)
        if predicted >= cached + 1:
            self.audit_silent.labels(worker).inc()
        elif cached >= predicted + 1:
            self.audit_unseen.labels(worker).inc()
        self.audit_error.labels(worker).observe(predicted - cached)

    # -- router/core/routing.py's DecisionObserver ----------------------------------------------------
    def decision(self, policy: str, reason: str) -> None:
        self.decisions.labels(policy, reason).inc()

    def fallback(self, cause: str) -> None:
        self.fallbacks.labels(cause).inc()

    def lookup_latency(self, seconds: float) -> None:
        self.lookup_latency_s.observe(seconds)
