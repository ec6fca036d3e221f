"""The bridge's Prometheus metrics, on a registry of its own (served on `kvmesh bridge --metrics-port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class BridgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.engine_up = Gauge("kvmesh_bridge_engine_up", "1 while the engine answers its health check", registry=r)
        self.batches = Counter("kvmesh_bridge_batches", "Engine event batches applied, by how they came",
                               ["how"], registry=r)
        self.events = Counter("kvmesh_bridge_engine_events", "Engine events decoded, by type", ["type"], registry=r)
        self.skipped = Counter("kvmesh_bridge_skipped_blocks", "Engine blocks not mirrored, by reason", ["reason"],
                               registry=r)
        self.bad_payloads = Counter("kvmesh_bridge_bad_payloads",
                                    "Messages or events that could not be decoded (dropped), by reason", ["reason"],
                                    registry=r)
        self.lost_batches = Counter("kvmesh_bridge_lost_batches",
                                    "Engine batches missed and not recovered by replay", registry=r)
        self.replays = Counter("kvmesh_bridge_replays", "Replay requests to the engine, by result", ["result"],
                               registry=r)
        self.restarts = Counter("kvmesh_bridge_engine_restarts", "Engine restarts seen (new epoch, mirror cleared)",
                                registry=r)
        self.degraded = Gauge("kvmesh_bridge_degraded",
                              "1 while the mirror may differ from the engine's cache (events were lost)", registry=r)
        self.mirror_blocks = Gauge("kvmesh_bridge_mirror_blocks",
                                   "kvmesh blocks the engine holds, as mirrored, by tier (device, host, disk)",
                                   ["tier"], registry=r)
        self.forwarded = Counter("kvmesh_bridge_forwarded_blocks",
                                 "kvmesh block events sent to the index, by kind and tier", ["kind", "tier"],
                                 registry=r)
        self.scrape_failures = Counter("kvmesh_bridge_scrape_failures", "Failed reads of the engine's /metrics",
                                       registry=r)
