"""vLLM's side of benchmarks/peer_engine.py; runs in the peer virtualenv (`make peer-venv`).

Reads the workloads (token-id prompts, output lengths) from ``--input``, runs them one after the
other on one ``vllm.LLM`` (its defaults, fp32, prefix caching on, greedy, ignore_eos) and writes
seconds and output token ids per workload to ``--output``. The prefix cache is reset before each
workload, so every workload starts cold, as kvmesh's fresh engine does.

Run by peer_engine.py; by hand:
    .venv-peer/bin/python benchmarks/peer_vllm.py --model DIR --input in.json --output out.json

Nothing here imports kvmesh: the peer virtualenv does not have it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def tree_cpu_seconds(root: int | None = None) -> float:
    """User + system CPU seconds of this process and every descendant (vLLM's engine core and
    worker are child processes): less sensitive than wall time to what else runs on the machine."""
    root = os.getpid() if root is None else root
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # NOTE: the command name may hold spaces; the fields after its closing parenthesis do not.
        fields = raw[raw.rindex(")") + 2 :].split()
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(children.get(pid, []))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True, help="JSON: [{name, prompts: [[ids]], max_tokens}]")
    ap.add_argument("--output", required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                    help="extra vllm.LLM keyword argument, e.g. block_size=32 (repeatable)")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from vllm_cpu import patch_vllm_version

    patch_vllm_version()
    from vllm import LLM, SamplingParams

    extra = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    workloads = json.loads(Path(args.input).read_text())
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        seed=0,
        enable_prefix_caching=True,
        max_model_len=args.max_model_len,
        # NOTE: the one change from vLLM's defaults: on CPU it reserves 92 % of the machine's
        # memory up front (and refuses to start on a shared machine); 1 GiB holds ~500k tokens
        # of this model's KV, far more than any workload needs.
        kv_cache_memory_bytes=1 << 30,
        **extra,
    )
    startup = time.perf_counter() - t0
    # NOTE: one warm-up per workload shape (compiled graphs, allocator), then a cold prefix cache.
    for w in workloads:
        warm = [{"prompt_token_ids": p} for p in w["prompts"][:2]]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    results = []
    for w in workloads:
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=w["max_tokens"], ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
        start, cpu = time.perf_counter(), tree_cpu_seconds()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - start
        results.append({
            "name": w["name"],
            "seconds": secs,
            "cpu_seconds": tree_cpu_seconds() - cpu,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        })
        print(f"vllm {w['name']}: {secs:.2f} s", file=sys.stderr, flush=True)
    cfg = llm.llm_engine.vllm_config
    import torch

    info = {
        "vllm_version": __import__("vllm").__version__,
        "startup_seconds": startup,
        "block_size": cfg.cache_config.block_size,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "torch_threads_frontend": torch.get_num_threads(),
    }
    Path(args.output).write_text(json.dumps({"info": info, "results": results}))


if __name__ == "__main__":
    main()
