"""Decode-step profile: wall time, GPU-busy time and kernel launches per decode step, per batch size
and per way of running the forward pass, side by side in one run.

For each mode (``eager``: no compile, no CUDA graphs; ``compiled``: --compile, no graphs;
``graphs``: --compile and CUDA graphs, the CUDA default) it builds one engine (warm-up included),
then for each batch size B puts B requests into decode (``--prompt-len`` tokens each, prefilled
first) and times ``--steps`` engine steps of B decodes (MS-1: one token per request per step,
scheduler, sampling and streaming included). Then a few more steps run under ``torch.profiler``:

* GPU busy: the union of the intervals in which a CUDA kernel ran, per step;
* launches: kernel launches per step (``cudaLaunchKernel`` and its kin; a graph replay,
  ``cudaGraphLaunch``, counts as one); copies (``cudaMemcpyAsync``) are counted apart.

On a CPU only the wall time means something (modes eager and compiled; GPU columns "n/a").
The 1B shape (``--model 1b``) is the Llama shape of docs/notes on the H200 (16 layers, 2048 wide,
32/8 heads, MLP 8192, vocab 128,256: 1.5B parameters untied), made once by kvmesh's make-model;
``--model qwen05`` the Qwen2-0.5B shape (24 layers, 896 wide, 14/2 heads of 64, MLP 4864, vocab
151,936, tied). ``--prompt-lens 128,2048`` runs every batch at each context length. Each row also
gives the bytes a step must read (the weights once, and the batch's KV cache at its mean context)
so that a step can be compared with the device's copy bandwidth.

Run: python benchmarks/decode_profile.py [--model 1b|qwen05|micro|default|DIR] [--batches 1,16,64]
     [--prompt-lens 128] [--modes eager,compiled,graphs] [--steps 20] [--device auto] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvmesh.contract.types import SamplingParams
from kvmesh.make_model import ModelSpec, cache_dir, ensure_default_model, make_model
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.execution.model_runner import set_cpu_threads

LLAMA_1B = ModelSpec(layers=16, hidden_size=2048, heads=32, kv_heads=8, intermediate_size=8192,
                     vocab_size=128_256, max_position_embeddings=4096, seed=0, init_std=0.02)
"""The decode-profile shape of the first GPU run (docs/notes: 1.5B parameters, 3.0 GB in bf16)."""
QWEN2_05B = ModelSpec(arch="qwen2", layers=24, hidden_size=896, heads=14, kv_heads=2, intermediate_size=4864,
                      vocab_size=151_936, max_position_embeddings=4096, seed=0, init_std=0.02)
"""Qwen2(.5)-0.5B's shape (head dim 64, seven query heads per KV head, tied embeddings)."""
MICRO = ModelSpec(layers=1, hidden_size=32, heads=2, kv_heads=1, intermediate_size=64, seed=5)
MODES = {
    "eager": {"compile": False, "enforce_eager": True},
    "compiled": {"compile": True, "enforce_eager": True},
    "graphs": {"compile": True, "enforce_eager": False},
}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
COPIES = ("cudaMemcpyAsync", "cudaMemcpy")


def model_dir(name: str) -> str:
    """``1b`` and ``micro`` are made once (under $KVMESH_CACHE_DIR); ``default`` is the demo model."""
    if name == "default":
        return str(ensure_default_model())
    spec = {"1b": LLAMA_1B, "qwen05": QWEN2_05B, "micro": MICRO}.get(name)
    if spec is None:
        return name
    target = cache_dir() / "models" / f"bench-{name}"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=target.parent))
        print(f"making the {name} model once at {target} ...", file=sys.stderr, flush=True)
        make_model(tmp / "m", spec)
        with contextlib.suppress(OSError):  # another process made it first
            (tmp / "m").rename(target)
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_counts(prof, steps: int) -> dict[str, float]:
    """Per step: GPU-busy ms, kernel launches and copies, from a torch.profiler run of ``steps`` steps."""
    launches = copies = 0
    kernels: list[tuple[float, float]] = []
    for e in prof.events():
        if e.name in LAUNCHES:
            launches += 1
        elif e.name in COPIES:
            copies += 1
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end))
    return {"gpu_busy_ms": busy_us(kernels) / 1e3 / steps, "launches": launches / steps, "copies": copies / steps}


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of the model's parameters (a decode step reads each once; tied embeddings count once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in engine.runner.model.parameters()}
    return sum(seen.values())


def kv_bytes_per_token(engine: LLMEngine) -> int:
    """K and V bytes of one token over every layer."""
    mc = engine.model_config
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * engine.config.torch_dtype.itemsize


def decode_steps(engine: LLMEngine, batch: int, prompt_len: int, steps: int, profile_steps: int,
                 cuda: bool) -> dict[str, float]:
    """Puts ``batch`` requests into decode, times ``steps`` steps, profiles ``profile_steps`` more."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + profile_steps + 64, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(2, min(vocab, 32_000), (prompt_len,), generator=gen).tolist(), params)
    for _ in range(1000):  # prefill until every request decodes
        outs = engine.step()
        if engine.scheduler.num_running == batch and len(outs) == batch and all(
                len(engine.scheduler.requests[r].output_token_ids) >= 2 for r in ids):
            break
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == batch, f"a step of {len(outs)} rows, not {batch}"
    row = {"wall_ms": 1e3 * statistics.median(times), "wall_ms_mean": 1e3 * statistics.fmean(times),
           "weight_bytes": weight_bytes(engine),
           "kv_bytes": batch * (prompt_len + 2 + steps // 2) * kv_bytes_per_token(engine)}
    if cuda and profile_steps:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(profile_steps):
                engine.step()
            torch.cuda.synchronize()
        row.update(profile_counts(prof, profile_steps))
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return row


def run(args: argparse.Namespace) -> dict:
    model = model_dir(args.model)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {list(MODES)}")
    if not cuda:
        modes = [m for m in modes if m != "graphs"]  # no CUDA graphs on a CPU
    prompt_lens = [int(p) for p in args.prompt_lens.split(",")]
    max_len = max(prompt_lens) + args.steps + args.profile_steps + 128
    result: dict = {"model": model, "device": torch.cuda.get_device_name() if cuda else "cpu", "batches": batches,
                    "prompt_len": prompt_lens[0], "prompt_lens": prompt_lens, "steps": args.steps, "modes": {}}
    print(f"decode profile: {Path(model).name} on {result['device']}, batches {batches}, "
          f"{args.steps} timed steps each (MS-1)", flush=True)
    print(f"{'mode':<10}{'prompt':>7}{'batch':>6}{'wall ms':>9}{'GPU busy ms':>13}{'launches':>10}{'copies':>8}"
          f"{'start s':>9}")
    for mode in modes:
        t0 = time.perf_counter()
        engine = LLMEngine(model=model, device=device, dtype=args.dtype, max_num_seqs=max(batches),
                           max_model_len=max_len, max_num_batched_tokens=max(2048, max_len),
                           num_blocks=max(batches) * -(-max_len // 16) + 16,
                           **({} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling}),
                           **MODES[mode])
        start_s = time.perf_counter() - t0
        rows = result["modes"][mode] = {"start_s": start_s, "prompts": {}}
        for p in prompt_lens:
            by_batch = rows["prompts"][str(p)] = {}
            for b in batches:
                r = by_batch[str(b)] = decode_steps(engine, b, p, args.steps, args.profile_steps, cuda)
                gpu = f"{r['gpu_busy_ms']:>13.3f}{r['launches']:>10.0f}{r['copies']:>8.0f}" if "launches" in r else \
                    f"{'n/a':>13}{'n/a':>10}{'n/a':>8}"
                print(f"{mode:<10}{p:>7}{b:>6}{r['wall_ms']:>9.2f}{gpu}{start_s:>9.1f}", flush=True)
        rows["batches"] = rows["prompts"][str(prompt_lens[0])]  # the first context length (issue 34's reading)
        del engine
        if cuda:
            torch.cuda.empty_cache()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", help="1b | micro | default | a model directory (default 1b)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--modes", default="eager,compiled,graphs")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per batch (default 20)")
    ap.add_argument("--profile-steps", type=int, default=5, help="profiled steps per batch on CUDA (default 5)")
    ap.add_argument("--prompt-lens", "--prompt-len", default="128", help="context lengths, comma-separated")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine's async scheduling (default: the device's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = the engine's default")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args()
    if args.threads:
        set_cpu_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
