"""Scale run: 64 simulated workers, 2 routers and 2 kv_service replicas on one Redis.

    .venv/bin/python benchmarks/scale_run.py [--workers 64] [--per-process 8] [--max-requests 400]
        [--speedup 4] [--sim-time-scale 0.5] [--trace ../shared/traces/conversation_trace.jsonl]

Runs the trace twice on fresh clusters: through 2 routers (requests alternate between them, each
router talks to its own kv_service replica, both replicas share one Redis index) and through 1.
Reports the routers' Lookup p99 (from kvmesh_router_lookup_latency_seconds buckets), block events
applied per second (kvmesh_kv_events_applied_total over both replicas), Redis commands per
second (INFO total_commands_processed) and routing quality (hit rate, TTFT) of 2 routers vs 1: a
shared index means the two routers see the same holders, so quality should not drift.

Simulated workers are hosted `--per-process` to a process (one engine thread and gRPC server
each), so 64 of them fit on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvmesh.bench import serve
from kvmesh.bench.datasets import TokenRange
from kvmesh.bench.report import summarize
from kvmesh.bench.routing import RoutingBenchConfig
from kvmesh.bench.scrape import histogram_quantile, label_counts, scrape
from kvmesh.bench.trace import TraceSynthesizer
from kvmesh.loopback import RedisServer, free_port_run
from kvmesh.make_model import ensure_default_model
from kvmesh.replay.trace import load_trace
from kvmesh.stack import kvmesh_cmd, wait_serving

ROOT = Path(__file__).resolve().parents[1]

BENCH = RoutingBenchConfig(trace="", model="")
"""The engine settings of `kvmesh bench routing`, which the hosted workers share."""


def host_workers(args: argparse.Namespace) -> int:
    """Child mode: ``--count`` simulated workers in this process until SIGTERM."""
    import threading

    from kvmesh.model_worker.engine.llm_engine import LLMEngine
    from kvmesh.model_worker.serving.server import WorkerServer
    from kvmesh.model_worker.simulated.sim_runner import DEFAULT_SIM_MAX_MODEL_LEN, SimRunner

    servers = []
    kvs = args.kv.split(",")
    for k in range(args.count):
        i = args.first + k

        def factory(cfg, mc):
            return SimRunner(cfg, mc, None, args.sim_time_scale)

        engine = LLMEngine(model=args.model, max_model_len=DEFAULT_SIM_MAX_MODEL_LEN,
                           max_num_batched_tokens=BENCH.max_num_batched_tokens, max_num_seqs=BENCH.max_num_seqs,
                           num_scheduler_steps=BENCH.num_scheduler_steps, device="cpu", runner_factory=factory)
        port = args.port + k
        servers.append(WorkerServer(engine, f"worker-{i:02d}", "127.0.0.1", port, kvs[i % len(kvs)],
                                    f"127.0.0.1:{port}", stream_interval=BENCH.stream_interval).start())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    for s in servers:
        s.stop(0)
    return 0


def events_applied(kv_ports: list[int]) -> int:
    """Block events applied so far over the kv_service replicas."""
    return sum(sum(label_counts(scrape(p), "kvmesh_kv_events_applied_total", "kind").values()) for p in kv_ports)


def redis_commands(redis_port: int) -> int:
    import redis

    return int(redis.Redis(port=redis_port).info("stats")["total_commands_processed"])


def run_cluster(args: argparse.Namespace, n_routers: int, requests: list, log_dir: Path) -> dict:
    model = str(ensure_default_model())
    redis_srv = RedisServer()
    procs: list[subprocess.Popen] = []
    logs = []

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115
        logs.append(log)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    base = free_port_run(8)
    kv_addrs, kv_metrics, router_addrs, router_metrics = [], [], [], []
    try:
        for r in range(2):
            addr = f"127.0.0.1:{base + r}"
            kv_metrics.append(base + 2 + r)
            p = spawn(f"kv{r}", kvmesh_cmd("kv-service", "--host", "127.0.0.1", "--port", str(base + r),
                                           "--redis-url", redis_srv.url, "--metrics-port", str(base + 2 + r),
                                           "--lease-ttl-ms", str(args.lease_ttl_ms)))
            wait_serving(addr, p, 30)
            kv_addrs.append(addr)
        wbase = free_port_run(args.workers)
        for first in range(0, args.workers, args.per_process):
            count = min(args.per_process, args.workers - first)
            # NOTE: nice, as in `kvmesh bench routing`: the control plane keeps its CPU.
            host = spawn(f"workers{first}", ["nice", "-n", str(BENCH.worker_nice), sys.executable, __file__, "--host-workers",
                                             "--first", str(first), "--count", str(count), "--port", str(wbase + first),
                                             "--kv", ",".join(kv_addrs), "--model", model,
                                             "--sim-time-scale", str(args.sim_time_scale)])
            # NOTE: one host at a time: eight processes importing torch at once starve the
            # heartbeats of the workers already registered on a 2-core machine.
            for i in range(first, first + count):
                wait_serving(f"127.0.0.1:{wbase + i}", host, 300)
        for r in range(n_routers):
            addr = f"127.0.0.1:{base + 4 + r}"
            router_metrics.append(base + 6 + r)
            p = spawn(f"router{r}", kvmesh_cmd("router", "--host", "127.0.0.1", "--port", str(base + 4 + r),
                                               "--kv-service", kv_addrs[r], "--log-level",
                                               "warning", "--first-token-timeout", "0",
                                               "--max-streams", str(len(requests) + 16),
                                               "--metrics-port", str(base + 6 + r)))
            wait_serving(addr, p, 60)
            router_addrs.append(addr)
        time.sleep(3.0)  # every worker registered and discovered
        ev0 = events_applied(kv_metrics)
        cmd0 = redis_commands(redis_srv.port)

        async def both() -> tuple[list, float]:
            t0 = time.perf_counter()
            parts = await asyncio.gather(*(serve.run_requests(router_addrs[r], requests[r::n_routers],
                                                              progress=False) for r in range(n_routers)))
            return [rec for recs, _ in parts for rec in recs], time.perf_counter() - t0

        records, duration = asyncio.run(both())
        ev1 = events_applied(kv_metrics)
        cmd1 = redis_commands(redis_srv.port)
        router_scrapes = [scrape(m) for m in router_metrics]
        # NOTE: requests routed without the index, by cause (lookup_failed, breaker_open, ...).
        fallbacks: dict[str, int] = {}
        for page in router_scrapes:
            for cause, n in label_counts(page, "kvmesh_router_fallbacks_total", "cause").items():
                fallbacks[cause] = fallbacks.get(cause, 0) + n
        lookup_p99 = histogram_quantile(router_scrapes, "kvmesh_router_lookup_latency_seconds", 0.99)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()
        redis_srv.stop()
    s = summarize(records, duration, args.sim_time_scale, [f"worker-{i:02d}" for i in range(args.workers)])
    return {"routers": n_routers, "completed": s["completed"], "failed": s["failed"], "wall_s": duration,
            "lookup_p99_ms_le": lookup_p99 * 1000, "events_per_s": (ev1 - ev0) / duration,
            "redis_ops_per_s": (cmd1 - cmd0) / duration, "hit_rate": s["prefix_hit_rate"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "output_tok_s": s["output_throughput"], "max_mean_load": s["max_mean_load"],
            "fallbacks": fallbacks,
            "errors": s["errors"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--per-process", type=int, default=8)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"))
    ap.add_argument("--max-requests", type=int, default=400)
    ap.add_argument("--speedup", type=float, default=4.0)
    ap.add_argument("--sim-time-scale", type=float, default=0.5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--lease-ttl-ms", type=int, default=30_000,
                    help="kv_service worker lease (default 30000: 64 nice'd workers on 2 cores heartbeat late)")
    ap.add_argument("--host-workers", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--kv", default="", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.host_workers:
        return host_workers(args)
    from kvmesh.model_worker.config import ModelConfig

    model = str(ensure_default_model())
    synth = TraceSynthesizer(0, TokenRange.for_vocab(ModelConfig.from_dir(model).vocab_size))
    requests = synth.requests(load_trace(args.trace, args.max_requests), args.speedup)
    log_dir = Path(tempfile.mkdtemp(prefix="kvmesh-scale-"))
    out = {}
    for n in (2, 1):
        (log_dir / str(n)).mkdir()
        out[f"{n}_routers"] = r = run_cluster(args, n, requests, log_dir / str(n))
        print(json.dumps(r), flush=True)
    out["settings"] = {"workers": args.workers, "kv_service_replicas": 2, "requests": len(requests),
                       "speedup": args.speedup, "sim_time_scale": args.sim_time_scale, "host": os.uname().nodename,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "logs": str(log_dir)}
    print(json.dumps(out["settings"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
