"""Worker Prometheus metrics: vLLM's names under the ``kvmesh:`` prefix."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)

NUM_RUNNING = Gauge("kvmesh:num_requests_running", "Requests in the running batch", ["model_name"])
NUM_WAITING = Gauge("kvmesh:num_requests_waiting", "Requests waiting to be scheduled", ["model_name"])
KV_USAGE = Gauge("kvmesh:kv_cache_usage_perc", "KV-cache usage, 1 = full", ["model_name"])
PREFIX_QUERIES = Counter("kvmesh:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", ["model_name"])
PREFIX_HITS = Counter("kvmesh:prefix_cache_hits", "Prompt tokens found in the prefix cache", ["model_name"])
TTFT = Histogram("kvmesh:time_to_first_token_seconds", "Time to first token", ["model_name"], buckets=_LATENCY_BUCKETS)
ITL = Histogram("kvmesh:inter_token_latency_seconds", "Time between consecutive tokens", ["model_name"],
                buckets=_LATENCY_BUCKETS)
E2E = Histogram("kvmesh:e2e_request_latency_seconds", "Arrival to finish", ["model_name"], buckets=_LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("kvmesh:prompt_tokens", "Prompt tokens of finished requests", ["model_name"])
GENERATION_TOKENS = Counter("kvmesh:generation_tokens", "Generated tokens", ["model_name"])
REQUESTS = Counter("kvmesh:request_success", "Finished requests by reason", ["model_name", "finished_reason"])
