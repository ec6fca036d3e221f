"""`kvmesh bench routing`: one simulated stack per policy, the same trace replayed through each.

For every policy: start Redis + kv_service + N simulated workers + a router with ``--policy P``
(kvmesh.stack.LocalStack), replay the trace's requests at ``timestamp / speedup``, and measure
from the client side (TTFT, output tok/s, hit rate from usage.cached_tokens, load per worker from
served_by) plus each worker's simulated busy time (its ``kvmesh_sim_busy_seconds`` gauge, polled every
second) for utilisation over the arrival window. Times are reported in modelled seconds: wall / ``time_scale``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.bench import serve
from kvmesh.bench.datasets import BenchRequest, TokenRange
from kvmesh.bench.oracle import oracle_hit_rate
from kvmesh.bench.report import summarize
from kvmesh.bench.scrape import gauge, histogram_quantile, label_counts, scrape
from kvmesh.bench.trace import TraceSynthesizer
from kvmesh.loopback import free_port_run
from kvmesh.replay.trace import load_trace

DEFAULT_POLICIES = ("kv-aware", "round-robin", "least-loaded", "prefix-hash", "approx-tree")


@dataclass(slots=True)
class RoutingBenchConfig:
    trace: str
    model: str
    """Model dir for tokenizer / vocabulary / EOS (no weights are loaded)."""
    workers: int = 8
    policies: Sequence[str] = DEFAULT_POLICIES
    max_requests: int | None = None
    speedup: float = 4.0
    """Trace time compression: request i is sent at timestamp_i / speedup wall seconds."""
    time_scale: float = 0.25
    """Wall seconds per modelled second in the workers; the modelled load is speedup x time_scale
    times the trace's real rate. NOTE: 4 x 0.25 = the conversation trace's own rate. Its first
    1,500 requests need ~1,800 modelled GPU-s of prefill alone over 8 x 510 s, and a worker with
    any request decoding is busy every step, so 8 round-robin workers run near saturation; at 2x
    every policy drowns in its queues and the comparison measures only backlog."""
    num_blocks: int | None = None
    """Per worker; None = the simulator's H100 default (27,648 blocks of 16 tokens)."""
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    num_scheduler_steps: int = 8
    """Workers' multi-step decode window: the host schedules once per window, not per token."""
    stream_interval: int = 8
    """Workers' ``--stream-interval``: tokens per stream message after the first (TTFT unchanged)."""
    worker_nice: int = 10
    """The simulated workers run this much nicer than Redis, kv_service and router (see
    StackConfig.worker_nice): on a 2-core host the control plane's Lookups otherwise miss their
    50 ms deadline whenever eight busy workers hold the CPUs."""
    store: str = "redis"
    seed: int = 0
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    """Extra `kvmesh router` flags for every policy's router (e.g. --lookup-timeout-ms 200)."""
    progress: bool = True
    log_dir: str | None = None


def redis_script_stats(url: str | None, duration_s: float) -> dict:
    """How busy the index's Redis was: its CPU seconds per wall second over the replay and the
    script calls (EVALSHA) per second and mean microseconds per call; {} without a Redis."""
    if not url:
        return {}
    import redis

    info = redis.Redis.from_url(url).info("all")
    ev = info.get("cmdstat_evalsha", {})
    cpu = float(info.get("used_cpu_sys", 0.0)) + float(info.get("used_cpu_user", 0.0))
    return {"cpu_s_per_s": cpu / duration_s if duration_s else 0.0,
            "evalsha_per_s": ev.get("calls", 0) / duration_s if duration_s else 0.0,
            "evalsha_usec_per_call": float(ev.get("usec_per_call", 0.0))}


class BusySampler:
    """Polls every worker's ``kvmesh_sim_busy_seconds`` once a second during a replay."""

    def __init__(self, ports: Sequence[int], period_s: float = 1.0) -> None:
        self.ports = list(ports)
        self.period_s = period_s
        self.samples: list[tuple[float, list[float]]] = []
        self.missed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-sampler", daemon=True)
        self._t0 = 0.0

    def start(self) -> BusySampler:
        self._t0 = time.perf_counter()
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        t = time.perf_counter() - self._t0
        self.samples.append((t, [gauge(scrape(p, timeout=2.0), "kvmesh_sim_busy_seconds") for p in self.ports]))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._sample()
            except OSError:  # NOTE: a worker too busy to answer /metrics in time: skip this sample
                self.missed += 1

    def utilisation(self, until_s: float, time_scale: float, mean: bool = False) -> list[float] | float:
        """Per worker, modelled busy seconds / modelled seconds over [start, ``until_s`` wall s]."""
        t0, b0 = self.samples[0]
        end = next((smp for smp in self.samples if smp[0] >= until_s), self.samples[-1])
        modelled = (end[0] - t0) / time_scale if time_scale else 0.0
        util = [(b1 - b) / modelled if modelled else 0.0 for b, b1 in zip(b0, end[1], strict=True)]
        return sum(util) / len(util) if mean else util


def run_policy(cfg: RoutingBenchConfig, policy: str, requests: Sequence[BenchRequest]) -> dict:
    """One policy's stack, replay and figures."""
    from kvmesh.stack import LocalStack, StackConfig

    # NOTE: one run for both sets, so the gRPC ports and the metrics ports never overlap.
    base = free_port_run(2 * cfg.workers + 6)
    metrics_base = base + cfg.workers + 4
    num_blocks = ["--num-blocks", str(cfg.num_blocks)] if cfg.num_blocks else []
    stack = LocalStack(StackConfig(
        model=cfg.model, workers=cfg.workers, router_port=base, kv_service_port=base + 1, worker_port=base + 4,
        metrics_port=metrics_base, store=cfg.store, simulate=True, router_tokenizer=False,
        worker_nice=cfg.worker_nice,
        worker_args=["--sim-time-scale", str(cfg.time_scale), "--block-size", str(cfg.block_size),
                     "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
                     "--max-num-seqs", str(cfg.max_num_seqs),
                     "--num-scheduler-steps", str(cfg.num_scheduler_steps),
                     "--stream-interval", str(cfg.stream_interval), "--log-level", "warning", *num_blocks,
                     *cfg.worker_args],
        # NOTE: every request of the replay may be in flight at once when a policy falls behind;
        # the router must queue them, not refuse them, or the comparison would count refusals.
        router_args=["--policy", policy, "--log-level", "warning", "--first-token-timeout", "0",
                     "--max-streams", str(max(256, len(requests) + 16)), *cfg.router_args],
        log_dir=f"{cfg.log_dir}/{policy}" if cfg.log_dir else None))
    worker_ids = [f"worker-{i}" for i in range(cfg.workers)]
    stack.start()
    try:
        time.sleep(1.5)  # NOTE: let every worker register and the router discover all of them
        sampler = BusySampler([metrics_base + 2 + i for i in range(cfg.workers)]).start()
        records, duration = serve.run(stack.endpoints["router"], requests, progress=cfg.progress)
        sampler.stop()
        router_page, kv_page = scrape(metrics_base + 1), scrape(metrics_base)
        redis_stats = redis_script_stats(stack.endpoints.get("redis"), duration)
    finally:
        stack.stop()
    # NOTE: why the router picked what it picked (prefix, load, balance, fallback, ...), and the
    # same Lookups timed at both ends: the gap is the router's own queueing.
    decisions = label_counts(router_page, "kvmesh_router_decisions_total", "reason")
    fallbacks = label_counts(router_page, "kvmesh_router_fallbacks_total", "cause")
    lookup_p99 = {"router": histogram_quantile([router_page], "kvmesh_router_lookup_latency_seconds", 0.99),
                  "kv_service": histogram_quantile([kv_page], "kvmesh_kv_lookup_latency_seconds", 0.99)}
    s = summarize(records, duration, cfg.time_scale, worker_ids)
    # NOTE: utilisation over the arrival window: after the last arrival the cluster only drains,
    # and counting that tail would make a saturated cluster look idle.
    window = (requests[-1].arrival_s or 0.0) if requests else 0.0
    util = sampler.utilisation(window, cfg.time_scale)
    return {
        "ttft_mean_ms": s["ttft_ms"]["mean"], "ttft_p90_ms": s["ttft_ms"]["p90"],
        "ttft_p99_ms": s["ttft_ms"]["p99"], "output_tok_s": s["output_throughput"],
        "hit_rate": s["prefix_hit_rate"], "max_mean_load": s["max_mean_load"],
        "utilisation_mean": sum(util) / len(util) if util else 0.0, "utilisation_max": max(util, default=0.0),
        "utilisation_whole_run": sampler.utilisation(duration, cfg.time_scale, mean=True),
        "completed": s["completed"], "failed": s["failed"], "duration_s": s["duration_s"],
        "wall_s": duration, "errors": s["errors"], "decisions": decisions,
        "index_fallbacks": fallbacks, "redis": redis_stats, "lookup_p99_ms_le": {k: v * 1000 for k, v in lookup_p99.items()},
    }


def run_routing_bench(cfg: RoutingBenchConfig) -> dict:
    """Every policy on the same requests, plus the oracle hit rate; the `--json` document."""
    from kvmesh.model_worker.config import ModelConfig
    from kvmesh.model_worker.simulated.sim_runner import DEFAULT_SIM_NUM_BLOCKS

    records = load_trace(cfg.trace, cfg.max_requests)
    vocab = ModelConfig.from_dir(cfg.model).vocab_size
    synth = TraceSynthesizer(cfg.seed, TokenRange.for_vocab(vocab))
    requests = synth.requests(records, cfg.speedup)
    blocks = cfg.num_blocks or DEFAULT_SIM_NUM_BLOCKS
    # NOTE: block 0 of every worker is the null block: capacity is (blocks - 1) per worker.
    out: dict = {"oracle_hit_rate": oracle_hit_rate(records, cfg.workers * (blocks - 1), cfg.block_size)}
    for policy in cfg.policies:
        out[policy] = run_policy(cfg, policy, requests)
    out["settings"] = {
        "trace": cfg.trace, "requests": len(records), "workers": cfg.workers, "speedup": cfg.speedup,
        "time_scale": cfg.time_scale, "modelled_load_factor": cfg.speedup * cfg.time_scale,
        "num_blocks": blocks, "block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs, "num_scheduler_steps": cfg.num_scheduler_steps,
        "stream_interval": cfg.stream_interval, "worker_nice": cfg.worker_nice, "store": cfg.store, "seed": cfg.seed,
        "router_args": list(cfg.router_args),
        "date": time.strftime("%Y-%m-%d %H:%M"), "host": socket.gethostname(),
    }
    return out


def format_table(result: dict, baseline: str = "round-robin") -> str:
    """The comparison table with ratios against ``baseline`` (when it was run)."""
    policies = [k for k in result if k not in ("oracle_hit_rate", "settings")]
    base = result.get(baseline)
    oracle = result["oracle_hit_rate"]
    head = (f"{'policy':<13}{'TTFT mean':>10}{'p90':>9}{'p99':>9}{'out tok/s':>10}{'hit':>7}{'hit/orc':>8}"
            f"{'max/mean':>9}{'util':>6}{'ok':>6}{'TTFT÷':>8}{'tok/s×':>8}")
    lines = [head, "-" * len(head)]
    for p in policies:
        r = result[p]
        ttft_x = base["ttft_mean_ms"] / r["ttft_mean_ms"] if base and r["ttft_mean_ms"] else float("nan")
        tok_x = r["output_tok_s"] / base["output_tok_s"] if base and base["output_tok_s"] else float("nan")
        lines.append(f"{p:<13}{r['ttft_mean_ms']:>10.0f}{r['ttft_p90_ms']:>9.0f}{r['ttft_p99_ms']:>9.0f}"
                     f"{r['output_tok_s']:>10.0f}{r['hit_rate']:>7.3f}"
                     f"{r['hit_rate'] / oracle if oracle else 0:>8.2f}{r['max_mean_load']:>9.2f}"
                     f"{r['utilisation_mean']:>6.2f}{r['completed']:>6d}{ttft_x:>8.1f}{tok_x:>8.2f}")
    for p in policies:
        if result[p].get("decisions"):
            r = result[p]
            line = f"{p} decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items()))
            if r.get("index_fallbacks"):
                # NOTE: fallbacks count requests, decisions count picks (retries pick again): the
                # share is over the requests, which the report's "ok" column counts.
                share = sum(r["index_fallbacks"].values()) / max(1, r["completed"] + r.get("failed", 0))
                line += f"; routed without the index: {share:.1%} (" + ", ".join(
                    f"{k} {v}" for k, v in sorted(r["index_fallbacks"].items())) + ")"
            if rs := r.get("redis"):
                line += (f"; Redis {rs['cpu_s_per_s']:.2f} CPU s/s, {rs['evalsha_per_s']:.0f} scripts/s "
                         f"of {rs['evalsha_usec_per_call']:.0f} us")
            if p99 := r.get("lookup_p99_ms_le"):
                line += f"; Lookup p99 <= {p99['router']:g} ms at the router, {p99['kv_service']:g} ms in kv_service"
            lines.append(line)
    lines.append(f"oracle hit rate (one LRU cache of the workers' total capacity): {oracle:.3f}")
    lines.append(f"TTFT÷ = {baseline} mean TTFT / policy's; tok/s× = policy's output tok/s / {baseline}'s; "
                 "util = mean simulated busy time / modelled time until the last arrival; times in modelled ms")
    return "\n".join(lines)
