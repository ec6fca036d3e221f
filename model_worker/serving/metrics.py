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
        # LoRA adapters (--enable-lora; docs/adapters.md): residency in the shape vllm-project/vllm PR #54830
        # proposes, and vLLM 0.32's lora_requests_info, so a router that reads vLLM's reads a kvmesh worker
        self.lora_loaded = Gauge("kvmesh:lora_adapter_loaded", "1 while the adapter is loaded at this level "
                                 "(gpu: in a slot; cpu: in host memory); gone when it leaves it",
                                 ["model_name", "adapter_name", "level"], registry=r)
        self.lora_gpu = Gauge("kvmesh:num_gpu_loaded_lora_adapters", "Adapters in GPU slots", m, registry=r)
        self.lora_cpu = Gauge("kvmesh:num_cpu_loaded_lora_adapters", "Adapters in host memory", m, registry=r)
        self.lora_max_gpu = Gauge("kvmesh:max_gpu_lora_adapters", "GPU adapter slots (--max-loras)", m, registry=r)
        self.lora_info = Gauge("kvmesh:lora_requests_info", "As vLLM 0.32's: set to the time of each update; "
                               "both lists name every adapter with a request in flight",
                               ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
