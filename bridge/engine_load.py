"""An engine's load, read from its Prometheus ``/metrics``, as kvmesh's :class:`Load`.

vLLM (vllm/v1/metrics/loggers.py) and SGLang (sglang/srt/metrics/collector.py) name the same things
differently; one table per engine maps them. Series with several label sets (one per engine core of
a data-parallel server, one per model name) are summed.

What kvmesh routing reads and how each is made:

- ``num_running`` / ``num_waiting``: the engine's own gauges;
- ``num_total_blocks``: the engine's KV capacity in kvmesh blocks (vLLM's ``num_gpu_blocks`` of
  ``vllm:cache_config_info`` x its block size, or SGLang's ``max_total_num_tokens``, / kvmesh's
  block size); ``num_free_blocks`` from the usage gauge;
- ``queued_prefill_tokens``: not published by either engine; **estimated** as waiting requests x the
  mean computed (uncached) prompt tokens per request so far;
- the step counters the router's step-cost learner reads: ``steps`` (vLLM's iteration count),
  ``prefill_tokens`` (prompt tokens minus prefix-cache hits) and ``decode_tokens`` (generated
  tokens). ``busy_s`` stays 0 (neither engine publishes its busy time), so the learner never fits
  these workers from their reports and keeps its defaults for them.

This module imports neither zmq nor grpc.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.contract.types import Load

NAMES = {
    "vllm": {
        "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
        "usage": "vllm:kv_cache_usage_perc", "prompt": "vllm:prompt_tokens_total",
        "hits": "vllm:prefix_cache_hits_total", "queries": "vllm:prefix_cache_queries_total",
        "generated": "vllm:generation_tokens_total", "steps": "vllm:iteration_tokens_total_count",
        "requests": "vllm:e2e_request_latency_seconds_count",
    },
    "sglang": {
        "running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
        "usage": "sglang:token_usage", "prompt": "sglang:prompt_tokens_total",
        "hits": "sglang:cached_tokens_total", "queries": "sglang:prompt_tokens_total",
        "generated": "sglang:generation_tokens_total", "steps": "sglang:num_forward_passes_total",
        "requests": "sglang:e2e_request_latency_seconds_count",
    },
}
ENGINES = tuple(NAMES)
_WANTED = {e: frozenset(n.values()) | {"vllm:cache_config_info", "sglang:max_total_num_tokens"}
           for e, n in NAMES.items()}


@dataclass(slots=True, frozen=True)
class EngineStatus:
    """What one scrape said."""

    load: Load
    capacity_tokens: int
    """KV capacity in tokens (0 = the metrics do not say)."""
    block_size: int
    """The engine's block (page) size (0 = the metrics do not say)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the engine's prefix cache so far."""
    prefix_cache_hits: int
    """Of those, tokens found cached."""


def wanted_lines(text: str, names: frozenset[str]) -> str:
    """The lines of the series in ``names`` (and their # TYPE lines): vLLM's page is ~60 KB of
    histograms, ~6 ms for the parser whole, ~0.1 ms for these."""
    keep = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            family = line.split(" ", 3)[2]
            if any(n.startswith(family) for n in names):
                keep.append(line)
            continue
        if line and line[0] != "#":
            end = line.find("{")
            name = line[: end if end >= 0 else line.find(" ")]
            if name in names:
                keep.append(line)
    return "\n".join(keep) + "\n"


def _samples(text: str) -> tuple[dict[str, float], dict[str, dict[str, str]]]:
    """Per sample name, the sum over label sets; and the labels of each ``*_info`` sample."""
    values: dict[str, float] = {}
    infos: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + float(s.value)
            if s.name.endswith("_info"):
                infos[s.name] = dict(s.labels)
    return values, infos


def _int_label(labels: dict[str, str], name: str) -> int:
    try:
        return int(labels.get(name, "0"))
    except ValueError:  # "None"
        return 0


def parse_status(text: str, engine: str, block_size: int) -> EngineStatus:
    """The engine's load in kvmesh terms (``block_size``: kvmesh's). Raises ValueError on text
    that is not Prometheus exposition format."""
    n = NAMES[engine]
    v, infos = _samples(wanted_lines(text, _WANTED[engine]))
    cache = infos.get("vllm:cache_config_info", {})
    engine_bs = _int_label(cache, "block_size")
    capacity = _int_label(cache, "num_gpu_blocks") * engine_bs
    if not capacity:
        capacity = int(v.get("sglang:max_total_num_tokens", 0))
    total = capacity // block_size
    usage = min(1.0, max(0.0, v.get(n["usage"], 0.0)))
    running, waiting = int(v.get(n["running"], 0)), int(v.get(n["waiting"], 0))
    prompt, hits = int(v.get(n["prompt"], 0)), int(v.get(n["hits"], 0))
    requests = int(v.get(n["requests"], 0))
    computed = max(0, prompt - hits)
    queued = waiting * (computed // requests) if requests else 0
    load = Load(num_running=running, num_waiting=waiting, num_free_blocks=round(total * (1.0 - usage)),
                num_total_blocks=total, queued_prefill_tokens=queued, steps=int(v.get(n["steps"], 0)),
                prefill_tokens=computed, decode_tokens=int(v.get(n["generated"], 0)),
                cache_block_tokens=engine_bs if engine_bs > block_size else 0)
    return EngineStatus(load, capacity, engine_bs, int(v.get(n["queries"], 0)), hits)
