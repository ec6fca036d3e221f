"""The whole mesh on one machine: 2 workers, kv-aware vs round-robin routing, under cache pressure
and without it, both warm.

Per workload one stack (kv_service over Redis, or in memory without redis-server; 2 real workers;
a kv-aware router), plus a second router with ``--policy round-robin`` over the same workers. Each
policy runs its own prompts (prefixes of its own seed, so neither finds the other's blocks),
after 32 warm-up requests of the same shape. On a GPU both workers share it: ``--memory-fraction
0.4`` each (issue 34's "two workers at 0.4 on one GPU").

Workloads (the first GPU run's, docs/notes/gpu_h200.md):

* pressure: prefix-repetition, 16 prefixes x 2,048 tokens + 128 own, 256 requests, 64 in flight,
  64 output tokens, 1,600 KV blocks per worker (the prefixes do not fit one worker's cache);
* no-pressure: 8 prefixes x 1,024 + 128, same counts, the KV cache the memory share gives;
* hot: one prefix x 1,024 + 128 (every request shares it), same counts (issue 42; not in the default
  set: ``--workloads pressure,no-pressure,hot``).

``--quick`` divides every length and count by 8 (a CPU check of the script, not a measurement).
Prints one row per (workload, policy): req/s, output tok/s, TTFT mean/p99, hit rate, max/mean load;
``--json`` writes them.

Run: python benchmarks/mesh_bench.py [--model 1b|micro|default|DIR] [--device auto] [--quick] [--rounds N]
     [--json OUT]   (--rounds: N measured runs per policy, the order alternating; the median ratio)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from decode_profile import model_dir

from kvmesh.bench import serve
from kvmesh.bench.datasets import BenchRequest, TokenRange, prefix_repetition_dataset
from kvmesh.bench.report import summarize
from kvmesh.loopback import die_with_parent, free_port_run
from kvmesh.model_worker.config import ModelConfig
from kvmesh.stack import LocalStack, StackConfig, kvmesh_cmd, wait_serving

POLICIES = ("kv-aware", "round-robin")


@dataclass(frozen=True)
class Workload:
    name: str
    num_prefixes: int
    prefix_len: int
    suffix_len: int
    num_prompts: int = 256
    concurrency: int = 64
    output_len: int = 64
    num_blocks: int | None = None
    """KV blocks per worker; None = what the memory share gives."""

    def quick(self) -> Workload:
        return replace(self, prefix_len=self.prefix_len // 8, suffix_len=self.suffix_len // 8,
                       num_prompts=self.num_prompts // 8, concurrency=self.concurrency // 8,
                       output_len=self.output_len // 8,
                       num_blocks=self.num_blocks // 8 if self.num_blocks else 4096)


WORKLOADS = {
    "pressure": Workload("pressure", 16, 2048, 128, num_blocks=1600),
    "no-pressure": Workload("no-pressure", 8, 1024, 128),
    # issue 42: one system prompt for every request (the simulator's hot-prompt on the live stack)
    "hot": Workload("hot", 1, 1024, 128),
}


def prompts(w: Workload, tokens: TokenRange, seed: int, n: int, suffix_seed: int) -> list[BenchRequest]:
    """vLLM's prefix-repetition, with the prefixes of ``seed`` and the suffixes of ``suffix_seed``
    (the warm-up and the measured run share prefixes, never a whole prompt)."""
    prefixes = [r.prompt_token_ids[: w.prefix_len]
                for r in prefix_repetition_dataset(w.num_prefixes, w.prefix_len, 0, w.num_prefixes, 0, seed, tokens)]
    rng = np.random.default_rng(suffix_seed)
    reqs = [BenchRequest(list(prefixes[i % w.num_prefixes]) + rng.integers(tokens.low, tokens.high, w.suffix_len)
                         .tolist(), w.output_len) for i in range(n)]
    return [reqs[i] for i in rng.permutation(n)]


def run_policy(router: str, w: Workload, tokens: TokenRange, seed: int, progress: bool) -> dict:
    serve.run(router, prompts(w, tokens, seed, 32, seed + 1), max_concurrency=w.concurrency, progress=False)
    reqs = prompts(w, tokens, seed, w.num_prompts, seed + 2)
    records, duration = serve.run(router, reqs, max_concurrency=w.concurrency, progress=progress)
    s = summarize(records, duration, workers=["worker-0", "worker-1"])
    return {"req_s": s["request_throughput"], "output_tok_s": s["output_throughput"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "hit_rate": s["prefix_hit_rate"], "max_mean_load": s["max_mean_load"], "failed": s["failed"],
            "completed": s["completed"]}


def run_workload(model: str, device: str, w: Workload, args: argparse.Namespace) -> dict:
    cuda = device.startswith("cuda")
    worker_args = ["--device", device, "--max-model-len", str(max(1024, 2 * (w.prefix_len + w.suffix_len))),
                   "--log-level", "warning"]
    if cuda:
        worker_args += ["--memory-fraction", "0.4"]
    if w.num_blocks:
        worker_args += ["--num-blocks", str(w.num_blocks)]
    base = free_port_run(8)
    store = "redis" if shutil.which("redis-server") else "memory"
    log_dir = tempfile.mkdtemp(prefix=f"kvmesh-mesh-{w.name}-")
    stack = LocalStack(StackConfig(
        model=model, workers=2, router_port=base, kv_service_port=base + 1, worker_port=base + 2, metrics_port=0,
        store=store, router_tokenizer=False, worker_args=worker_args, log_dir=log_dir,
        router_args=["--policy", POLICIES[0], "--log-level", "warning", "--first-token-timeout", "0"],
        worker_start_timeout=args.start_timeout))
    rr: subprocess.Popen | None = None
    try:
        stack.start()
        rr_addr = f"127.0.0.1:{base + 5}"
        with open(Path(log_dir) / "router-rr.log", "w") as log:
            rr = subprocess.Popen([*die_with_parent(), *kvmesh_cmd(
                "router", "--host", "127.0.0.1", "--port", str(base + 5), "--kv-service", stack.endpoints["kv_service"],
                "--policy", POLICIES[1], "--metrics-port", "0", "--log-level", "warning", "--first-token-timeout", "0")],
                stdout=log, stderr=subprocess.STDOUT)
        wait_serving(rr_addr, rr, 60)
        tokens = TokenRange.for_vocab(min(ModelConfig.from_dir(model).vocab_size, 32_000))
        out = {"store": store, "num_blocks": w.num_blocks, "policies": {}, "rounds": []}
        routers = dict(zip(POLICIES, (stack.endpoints["router"], rr_addr), strict=True))
        for k in range(args.rounds):
            # NOTE: rounds alternate the order (A B, B A, ...): on a shared host the one that runs
            # second meets other load than the first; each round has fresh prefixes (their own seeds).
            order = POLICIES if k % 2 == 0 else POLICIES[::-1]
            row = {}
            for policy in order:
                seed = 100 * (POLICIES.index(policy) + 1) + 1000 * k
                row[policy] = r = run_policy(routers[policy], w, tokens, seed=seed, progress=args.progress)
                print(f"{w.name:<12}{policy:<13}{r['req_s']:>8.1f}{r['output_tok_s']:>10.0f}{r['ttft_mean_ms']:>10.0f}"
                      f"{r['ttft_p99_ms']:>10.0f}{r['hit_rate']:>7.3f}{r['max_mean_load']:>7.3f}{r['failed']:>7}",
                      flush=True)
            out["rounds"].append(row)
        for policy in POLICIES:  # the round with the median req/s stands for the policy
            runs = sorted((r[policy] for r in out["rounds"]), key=lambda r: r["req_s"])
            out["policies"][policy] = runs[len(runs) // 2]
        ratios = sorted(r["kv-aware"]["req_s"] / r["round-robin"]["req_s"] for r in out["rounds"]
                        if r["round-robin"]["req_s"])
        out["kv_aware_over_round_robin"] = ratios[len(ratios) // 2] if ratios else None
        out["kv_aware_over_round_robin_per_round"] = ratios
        if args.rounds > 1:
            print(f"{w.name:<12}kv-aware / round-robin req/s, median of {args.rounds} rounds: "
                  f"{out['kv_aware_over_round_robin']:.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})",
                  flush=True)
        return out
    finally:
        if rr is not None:
            rr.terminate()
            rr.wait(10)
        stack.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", help="1b | micro | default | a model directory (default 1b)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workloads", default="pressure,no-pressure")
    ap.add_argument("--quick", action="store_true", help="every length and count / 8 (a check of the script)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds for each worker to serve")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measured runs per policy, alternating which policy goes first; the median ratio is reported")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = model_dir(args.model)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"mesh: 2 workers of {Path(model).name} on {device}; kv-aware vs round-robin, both warmed with 32 requests")
    print(f"{'workload':<12}{'policy':<13}{'req/s':>8}{'out tok/s':>10}{'TTFT ms':>10}{'p99 ms':>10}{'hit':>7}"
          f"{'load':>7}{'failed':>7}")
    result: dict = {"model": model, "device": device, "quick": args.quick, "workloads": {}}
    for name in args.workloads.split(","):
        w = WORKLOADS[name].quick() if args.quick else WORKLOADS[name]
        result["workloads"][name] = run_workload(model, device, w, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(p["failed"] == 0 for w in result["workloads"].values() for r in w["rounds"]
                    for p in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
