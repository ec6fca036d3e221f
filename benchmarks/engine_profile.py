"""Where kvmesh's engine spends its time on one peer-benchmark workload (torch profiler).

Runs the workload as benchmarks/peer_engine.py does (fresh engine, warm-up, cold prefix cache,
all requests at once) under ``torch.profiler`` and prints the top operators by self CPU time,
plus the share of the wall time that no torch operator accounts for (Python: scheduler, input
packing, sampling bookkeeping). The profile summaries in docs/engine.md come from here; for a
Python-level view run it under py-spy (``pip install py-spy``):

    .venv/bin/py-spy record -o prof.svg -- .venv/bin/python benchmarks/engine_profile.py --no-torch-profiler

Run: .venv/bin/python benchmarks/engine_profile.py --workload unshared [--threads N] [--rows 15]
"""

from __future__ import annotations

import argparse
import time

import torch
from peer_engine import MAX_MODEL_LEN, make_workloads, peer_model
from torch.profiler import ProfilerActivity, profile

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.config import ModelConfig
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.execution.model_runner import set_cpu_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="unshared", help="a peer_engine.py workload name (default unshared)")
    ap.add_argument("--model", default=None, help="model dir (default: the peer benchmark's)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 = the engine's default")
    ap.add_argument("--rows", type=int, default=15, help="operators to list (default 15)")
    ap.add_argument("--no-torch-profiler", action="store_true", help="time only (for py-spy)")
    args = ap.parse_args()
    if args.threads:
        set_cpu_threads(args.threads)
    model = args.model or str(peer_model())
    workloads = {w.name: w for w in make_workloads(ModelConfig.from_dir(model).vocab_size)}
    w = workloads[args.workload]
    llm = LLM(model, max_model_len=MAX_MODEL_LEN, device="cpu")
    llm.generate(w.prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.kv_cache_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
    if args.no_torch_profiler:
        start = time.perf_counter()
        llm.generate(w.prompts, params)
        print(f"{w.label}: {time.perf_counter() - start:.2f} s, {torch.get_num_threads()} torch thread(s)")
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(w.prompts, params)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    # NOTE: top-level operators only (self time sums to the time spent inside torch).
    in_torch = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"{w.label}: {wall:.2f} s under the profiler, {torch.get_num_threads()} torch thread(s); "
          f"torch operators {in_torch:.2f} s ({100 * in_torch / wall:.0f} %), "
          f"the rest (Python, profiler) {wall - in_torch:.2f} s")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
