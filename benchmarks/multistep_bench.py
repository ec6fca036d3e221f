"""Multi-step decode benchmark: a decode-heavy burst at num_scheduler_steps N = 1, 2, 4, 8, 16.

Workload (the issue's): ``--num-requests`` requests (64) with ``--prompt-len``-token random prompts
(8), ``--output-len`` output tokens each (256), ignore_eos, all submitted at t=0. Per N it prints
output tok/s, req/s, TTFT and ITL p50/p99 (per token, from ``LLMEngine.step``'s per-inner-step
callback, so every token is timed when it reaches the host), and the TTFT of one late arrival
("probe"), added when the burst is a quarter done: the price a new request pays for windows.
Ends with the MS-N / MS-1 throughput ratios.

Model: on a CPU the default ``--model micro`` is a 1-layer, 32-wide random Llama made once under a
temp dir, where the forward pass is cheap and per-step host work (scheduling, input packing,
output processing) dominates, as it does for a small model on a GPU. ``--model default`` uses
``kvmesh.make_model.ensure_default_model()``; any other value is a model directory.

``--model 1b`` is the 1.5B-parameter Llama shape of the first GPU run (benchmarks/decode_profile.py),
made once. Every engine warms up before its run (compiles, CUDA graphs), and a short request runs
first, so MS-N is timed warm; ``--compile/--no-compile`` and ``--enforce-eager`` pass through to it.

Run: .venv/bin/python benchmarks/multistep_bench.py [--model micro|default|1b|DIR] [--steps 1,2,4,8,16]
     [--num-requests 64] [--output-len 256] [--device auto] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from decode_profile import model_dir

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.execution.model_runner import set_cpu_threads
from kvmesh.model_worker.scheduling.output import RequestOutput
from kvmesh.replay.records import percentile


def run_once(model: str, n: int, args: argparse.Namespace) -> dict[str, float]:
    max_len = args.prompt_len + args.output_len + 8
    extra = {"compile": args.compile} if args.compile is not None else {}
    engine = LLMEngine(model=model, num_scheduler_steps=n, device=args.device, dtype=args.dtype,
                       max_model_len=max_len, num_blocks=(args.num_requests + 1) * (-(-max_len // 16)) + 1,
                       max_num_seqs=args.num_requests + 1, max_num_batched_tokens=max(2048, max_len),
                       enforce_eager=args.enforce_eager, **extra)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    engine.add_request("warm", [3, 4, 5], SamplingParams(max_tokens=2 * n + 2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    prompts = [torch.randint(2, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_requests)]
    times: dict[str, list[float]] = {}
    added: dict[str, float] = {}
    total = args.num_requests * args.output_len
    state = {"emitted": 0}

    def on_output(outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for o in outputs:
            times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
            state["emitted"] += len(o.new_token_ids)
        if "probe" not in added and state["emitted"] >= total // 4:
            added["probe"] = time.perf_counter()
            engine.add_request("probe", prompts[0][::-1], SamplingParams(max_tokens=4, ignore_eos=True))

    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        added[f"r{i}"] = t0
    while engine.has_unfinished_requests():
        engine.step(on_output=on_output)
    burst_end = max(times[f"r{i}"][-1] for i in range(args.num_requests))
    elapsed = burst_end - t0
    ttft = [times[f"r{i}"][0] - t0 for i in range(args.num_requests)]
    itl = [b - a for i in range(args.num_requests) for a, b in zip(times[f"r{i}"], times[f"r{i}"][1:], strict=False)]
    return {"tok_s": total / elapsed, "req_s": args.num_requests / elapsed,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "probe_ttft": times["probe"][0] - added["probe"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="micro")
    ap.add_argument("--steps", default="1,2,4,8,16")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine's --compile / --no-compile (default: the device's)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args()
    set_cpu_threads(args.threads)
    model = model_dir(args.model)
    steps = [int(s) for s in args.steps.split(",")]
    print(f"model={args.model} requests={args.num_requests} prompt={args.prompt_len} output={args.output_len} "
          f"device={args.device} threads={args.threads}")
    print(f"{'N':>3} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'probe TTFT':>10}  (times in ms)")
    results: dict[int, dict[str, float]] = {}
    for n in steps:
        r = results[n] = run_once(model, n, args)
        print(f"{n:>3} {r['tok_s']:>10.0f} {r['req_s']:>7.2f} {1e3 * r['ttft_p50']:>9.1f} {1e3 * r['ttft_p99']:>9.1f} "
              f"{1e3 * r['itl_p50']:>8.2f} {1e3 * r['itl_p99']:>8.2f} {1e3 * r['probe_ttft']:>10.1f}", flush=True)
    if 1 in results:
        base = results[1]["tok_s"]
        print("ratio MS-N / MS-1 (output tok/s): " + ", ".join(
            f"MS-{n} {results[n]['tok_s'] / base:.2f}x" for n in steps if n != 1))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "device": args.device, "compile": args.compile,
                                               "enforce_eager": args.enforce_eager, "steps": results}, indent=1))


if __name__ == "__main__":
    main()
