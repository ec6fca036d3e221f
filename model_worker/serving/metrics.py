"""Worker Prometheus metrics: vLLM's names under the ``kvmesh:`` prefix, on a registry of their own.

The server makes one ``WorkerMetrics`` at start and serves its registry on ``/metrics``; nothing
registers at import, so several workers live in one process (tests, a simulator) without colliding.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.num_running = Gauge("kvmesh:num_requests_running", "Requests in the running batch", m, registry=r)
        self.num_waiting = Gauge("kvmesh:num_requests_waiting", "Requests waiting to be scheduled", m, registry=r)
        self.kv_usage = Gauge("kvmesh:kv_cache_usage_perc", "KV-cache usage, 1 = full", m, registry=r)
        self.prefix_queries = Counter("kvmesh:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      m, registry=r)
        self.prefix_hits = Counter("kvmesh:prefix_cache_hits", "Prompt tokens found in the prefix cache", m,
                                   registry=r)
        self.host_kv_usage = Gauge("kvmesh:host_kv_cache_usage_perc",
                                   "Host KV tier: share of its blocks holding a block evicted from the device", m,
                                   registry=r)
        self.host_hits = Counter("kvmesh:host_kv_cache_hits",
                                 "Prompt tokens found in the host KV tier and loaded back (of prefix_cache_hits)", m,
                                 registry=r)
        self.ttft = Histogram("kvmesh:time_to_first_token_seconds", "Time to first token", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvmesh:inter_token_latency_seconds", "Time between consecutive tokens", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvmesh:e2e_request_latency_seconds", "Arrival to finish", m, buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.prompt_tokens = Counter("kvmesh:prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("kvmesh:generation_tokens", "Generated tokens", m, registry=r)
        # prefill/decode disaggregation (docs/architecture.md): transfers by side, transport and outcome
        self.kv_transfers = Counter("kvmesh:kv_transfers", "KV transfers: side (prefill: sent, decode: received), "
                                    "transport (nixl, grpc, local = the decode worker prefilled it itself) and outcome",
                                    ["model_name", "side", "transport", "outcome"], registry=r)
        self.kv_transfer_blocks = Counter("kvmesh:kv_transfer_blocks", "KV blocks sent or received", ["model_name", "side"],
                                          registry=r)
        self.kv_transfer_bytes = Counter("kvmesh:kv_transfer_bytes", "KV bytes sent or received", ["model_name", "side"],
                                         registry=r)
        self.kv_transfer_seconds = Histogram("kvmesh:kv_transfer_seconds", "A decode leg's pull, start to blocks in hand",
                                             ["model_name", "transport"], buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_held_requests = Gauge("kvmesh:kv_held_requests", "Prefill legs whose blocks are held for a decode worker",
                                      ["model_name"], registry=r)
        self.requests = Counter("kvmesh:request_success", "Finished requests by reason", ["model_name", "finished_reason"],
                                registry=r)
