"""Prometheus metrics of the kv_service (names under kvmesh_kv_)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

LOOKUPS = Counter("kvmesh_kv_lookups_total", "Lookup and LookupTokens calls answered")
MATCHED_BLOCKS = Histogram(
    "kvmesh_kv_lookup_matched_blocks", "Best matched prefix per lookup, in blocks",
    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)
LOOKUP_LATENCY = Histogram(
    "kvmesh_kv_lookup_latency_seconds", "Index lookup time (one store round trip)",
    buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5),
)
EVENTS_APPLIED = Counter("kvmesh_kv_events_applied_total", "Block events applied", ["kind"])
RESYNCS = Counter("kvmesh_kv_resyncs_total", "Event batches answered with RESYNC")
REJECTED = Counter("kvmesh_kv_rejected_total", "Requests refused", ["reason"])
