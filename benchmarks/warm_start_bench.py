"""Warm start: the TTFT of the first request after an engine is ready, over the TTFT of the same
request once the engine is warm, with the warm-up (what a worker does before SERVING) and without.

Per configuration, in a fresh process each time (as a worker starts: nothing compiled in it yet),
it builds an engine (timing its start), sends one request (``--prompt-len`` tokens, 1 output token)
and times its first token, then sends ``--repeats`` more of the same shape (other tokens: no prefix
hits) and takes their median as the warm TTFT. "without warm-up" builds the same engine with the
warm-up skipped: there the first request pays what the warm-up would have (compiles, Triton JITs,
graph captures, lazy library set-up). Each cell is the median over ``--starts`` processes. The goal
of issue 34: first / warm <= 1.5 with the warm-up.

Run: python benchmarks/warm_start_bench.py [--model micro|default|1b|DIR] [--device auto]
     [--configs default,compile] [--prompt-len 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from decode_profile import model_dir

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.execution.model_runner import ModelRunner, set_cpu_threads

CONFIGS = {"default": {}, "compile": {"compile": True}, "eager": {"compile": False, "enforce_eager": True}}


class NoWarmupRunner(ModelRunner):
    """The runner without its warm-up: the cold start a worker had before issue 34."""

    def warm_up(self):  # type: ignore[override]
        return None


def ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        if engine.step():
            break
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def measure(model: str, device: str, config: dict, warm: bool, args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    engine = LLMEngine(model=model, device=device, max_model_len=max(512, 2 * args.prompt_len),
                       num_blocks=64 + 4 * -(-args.prompt_len // 16), max_num_seqs=args.max_num_seqs,
                       runner_factory=None if warm else NoWarmupRunner, **config)
    start_s = time.perf_counter() - t0
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(1)

    def prompt() -> list[int]:
        return torch.randint(2, min(vocab, 32_000), (args.prompt_len,), generator=gen).tolist()

    first = ttft(engine, "first", prompt())
    warm_ttfts = [ttft(engine, f"r{i}", prompt()) for i in range(args.repeats)]
    med = statistics.median(warm_ttfts)
    return {"start_s": start_s, "first_ttft_ms": 1e3 * first, "warm_ttft_ms": 1e3 * med, "ratio": first / med}


def one_start(name: str, warm: bool, args: argparse.Namespace) -> dict:
    """One cell's measure in a fresh process."""
    cmd = [sys.executable, __file__, "--one", name, "--model", args.model, "--device", args.device,
           "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats), "--max-num-seqs",
           str(args.max_num_seqs), "--threads", str(args.threads), *([] if warm else ["--no-warm-up"])]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="micro", help="micro | default | 1b | a model directory (default micro)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--configs", default="default,compile", help=f"comma-separated, of {list(CONFIGS)}")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9, help="warm requests; their median TTFT is the warm TTFT")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the engine's (graph sizes follow it)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--starts", type=int, default=3, help="fresh processes per cell; the median is shown")
    ap.add_argument("--warm-only", action="store_true", help="only the cells with the warm-up (make gpu-check)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one cell, JSON on stdout
    ap.add_argument("--no-warm-up", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    set_cpu_threads(args.threads)
    model = model_dir(args.model)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.one:
        print(json.dumps(measure(model, device, CONFIGS[args.one], not args.no_warm_up, args)))
        return 0
    print(f"warm start: {Path(model).name} on {device}, prompt {args.prompt_len} tokens, warm TTFT = median of "
          f"{args.repeats}; each row the median of {args.starts} fresh processes")
    print(f"{'config':<10}{'warm-up':<9}{'start s':>9}{'first TTFT ms':>15}{'warm TTFT ms':>14}{'first/warm':>12}")
    result: dict = {"model": model, "device": device, "prompt_len": args.prompt_len, "configs": {}}
    for name in args.configs.split(","):
        for warm in (True,) if args.warm_only else (True, False):
            runs = [one_start(name, warm, args) for _ in range(args.starts)]
            r = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            r["runs"] = runs
            result["configs"].setdefault(name, {})["with_warmup" if warm else "without_warmup"] = r
            print(f"{name:<10}{'yes' if warm else 'no':<9}{r['start_s']:>9.1f}{r['first_ttft_ms']:>15.1f}"
                  f"{r['warm_ttft_ms']:>14.1f}{r['ratio']:>12.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
