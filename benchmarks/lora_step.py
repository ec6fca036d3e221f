"""LoRA decode-step cost: a decode step of ``--batch`` (32) sequences spread over ``--adapters`` (4)
LoRA adapters of rank ``--rank`` (16, every projection adapted), divided by the same step of the base
model without ``--enable-lora``; the issue's goal on a CPU is <= 1.3.

Both engines load the same random model (made once under a temp dir: ``--hidden`` 1024 wide,
``--layers`` 8, intermediate 2816, 16 heads, 8 KV heads), take the same prompts, prefill, and then
decode side by side in one process: step i of the base engine, then step i of the LoRA engine, so
both see the same load. Prints the median step time of each and the ratio, with ``uptime``'s load.

Run: .venv/bin/python benchmarks/lora_step.py [--batch 32] [--adapters 4] [--rank 16] [--steps 40]
     [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvmesh.contract.types import SamplingParams
from kvmesh.make_model import ModelSpec, make_model
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.execution.model_runner import set_cpu_threads

_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def model_dir(args: argparse.Namespace) -> Path:
    d = Path(tempfile.gettempdir()) / f"kvmesh-lora-bench-{args.hidden}x{args.layers}"
    if not (d / "config.json").is_file():
        make_model(d, ModelSpec(layers=args.layers, hidden_size=args.hidden, heads=16, kv_heads=8,
                                intermediate_size=args.intermediate, max_position_embeddings=2048, seed=0))
    return d


def write_adapter(out: Path, cfg: dict, rank: int, seed: int) -> Path:
    """A PEFT-format adapter (what save_pretrained writes) with random A and B on every projection."""
    out.mkdir(parents=True, exist_ok=True)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m, parent in _MODULES.items():
            d_in, d_out = dims[m]
            key = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(_MODULES),
        "bias": "none", "use_rslora": False, "use_dora": False}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    set_cpu_threads(args.threads)
    model = model_dir(args)
    cfg = json.loads((model / "config.json").read_text())
    root = Path(tempfile.mkdtemp(prefix="kvmesh-lora-adapters-"))
    modules = [f"a{k}={write_adapter(root / f'a{k}', cfg, args.rank, k)}" for k in range(args.adapters)]
    max_len = args.prompt_len + args.steps + 16
    common = dict(model=str(model), device="cpu", dtype="float32", max_model_len=max_len,
                  max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len,
                  num_blocks=args.batch * (-(-max_len // 16)) + 2)
    base = LLMEngine(**common)
    lora = LLMEngine(**common, enable_lora=True, lora_modules=modules, max_loras=args.adapters,
                     max_lora_rank=args.rank)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 4, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(3, cfg["vocab_size"], (args.prompt_len,), generator=gen).tolist()
        base.add_request(f"r{i}", prompt, params)
        lora.add_request(f"r{i}", prompt, params, lora_name=f"a{i % args.adapters}")
    for engine in (base, lora):  # the prefill, then two warm decode steps
        for _ in range(3):
            engine.step()
        assert engine.scheduler.num_running == args.batch
    times: dict[str, list[float]] = {"base": [], "lora": []}
    for _ in range(args.steps):
        for name, engine in (("base", base), ("lora", lora)):
            t0 = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["lora"] / med["base"]
    load = os.getloadavg()
    print(f"model {args.layers} layers x {args.hidden} (intermediate {args.intermediate}), fp32 CPU, "
          f"{args.threads} thread(s); batch {args.batch}, {args.adapters} adapters of rank {args.rank}")
    print(f"decode step median: base {med['base'] * 1e3:.1f} ms, LoRA {med['lora'] * 1e3:.1f} ms "
          f"over {args.steps} steps each, interleaved")
    print(f"LoRA step / base step = {ratio:.3f} (goal <= 1.3); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"base_s": med["base"], "lora_s": med["lora"], "ratio": ratio,
                                               "load": load, **vars(args)}, indent=1))


if __name__ == "__main__":
    main()
