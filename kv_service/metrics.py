"""Prometheus metrics of the kv_service (names under kvmesh_kv_), on a registry of their own.

The server makes one ``KVMetrics`` at start and serves its registry on ``/metrics``; the core
(service.py) gets it passed in. Nothing registers at import, so several services (a simulator's
many cores, tests) live in one process without colliding.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class KVMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.lookups = Counter("kvmesh_kv_lookups_total", "Lookup and LookupTokens calls answered", registry=r)
        self.matched_blocks = Histogram(
            "kvmesh_kv_lookup_matched_blocks", "Best matched prefix per lookup, in blocks",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=r,
        )
        self.lookup_latency = Histogram(
            "kvmesh_kv_lookup_latency_seconds", "Index lookup time (one store round trip)",
            buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5), registry=r,
        )
        self.events_applied = Counter("kvmesh_kv_events_applied_total", "Block events applied", ["kind"],
                                      registry=r)
        self.events_ignored = Counter("kvmesh_kv_events_ignored_total",
                                      "Block hashes of events the index does not apply yet: host and disk "
                                      "tiers (it keeps the device tier only)", ["kind", "tier"], registry=r)
        self.resyncs = Counter("kvmesh_kv_resyncs_total", "Event batches answered with RESYNC", registry=r)
        self.leaves = Counter("kvmesh_kv_worker_leaves_total",
                              "Workers that left the live set before their lease ended (LeaveWorker), by reason: "
                              "draining (the worker at SIGTERM), unreachable (a front's report, or its event "
                              "stream cut off)", ["reason"], registry=r)
        self.rejected = Counter("kvmesh_kv_rejected_total", "Requests refused", ["reason"], registry=r)
        self.reservations = Counter("kvmesh_kv_reservations_total",
                                    "Routers' picks reserved (the shared router view), by outcome: reserved, "
                                    "conflict (another router reserved the worker since the router's Lookup), "
                                    "fold_skipped (a Lookup's folded pick the answer contradicts: not reserved)",
                                    ["outcome"], registry=r)
