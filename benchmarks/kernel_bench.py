"""Times the Triton ragged paged attention on prefill-heavy, decode-heavy and mixed batches.

Usage: ``python benchmarks/kernel_bench.py [--dtype bf16|fp16] [--heads 32 --kv-heads 8 --head-dim 128]
[--json OUT] [--sweep]``

Per scenario it prints tokens/s, achieved TFLOP/s (causal FLOPs actually needed, 4 per visible
(query, key, head, dim)) and GB/s (a lower bound on traffic: q + out + each sequence's K/V read
once), then the same for torch SDPA on dense, already gathered K/V (an idealised baseline that
does no paging) and flash-attn's varlen kernel when it is importable. Needs a CUDA GPU; on a
machine without one it says so and exits 0.

``--sweep`` also times a grid of launch configs (tile rows, key tile, warps, pipeline stages) per
scenario, the default's neighbours first, for ``--sweep-budget-s`` each (compiles included), then
split-KV counts on decode-heavy batches, and prints the best beside the default: the input to ``ATTENTION_CONFIGS`` in
kernels/triton_attention.py (docs/kernels.md, "Tuning"). ``--json`` writes every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvmesh.kernels.triton_attention import AttentionConfig


@dataclass(frozen=True)
class Scenario:
    name: str
    lens: list[tuple[int, int]]  # (q_len, kv_len) per sequence


SCENARIOS = [
    Scenario("prefill-heavy", [(2048, 2048)] * 4 + [(1024, 3072)] * 4),
    Scenario("decode-heavy", [(1, 2048)] * 128 + [(1, 8192)] * 16),
    Scenario("mixed", [(512, 1536)] * 2 + [(1, 4096)] * 96 + [(1, 512)] * 64),
    Scenario("decode-small-batch", [(1, 16384)] * 4),  # exercises split-KV
]


def _time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def _stats(lens, num_q_heads, num_kv_heads, head_dim, elem_bytes) -> tuple[int, float, float]:
    tokens = sum(q for q, _ in lens)
    visible = sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in lens)
    flops = 4.0 * visible * num_q_heads * head_dim
    kv_bytes = sum(kv for _, kv in lens) * 2 * num_kv_heads * head_dim * elem_bytes
    io_bytes = 2 * tokens * num_q_heads * head_dim * elem_bytes
    return tokens, flops, float(kv_bytes + io_bytes)


def _build(scenario: Scenario, args, dtype) -> dict:
    block_size = args.block_size
    lens = scenario.lens
    blocks = [math.ceil(kv / block_size) for _, kv in lens]
    num_blocks = sum(blocks) + 8
    shape = (num_blocks, block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for s, n in enumerate(blocks):
        table[s, :n] = perm[used : used + n]
        used += n
    q_lens = torch.tensor([0] + [q for q, _ in lens], device="cuda")
    cu_q_lens = q_lens.cumsum(0).to(torch.int32)
    kv_lens = torch.tensor([kv for _, kv in lens], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu_q_lens[-1]), args.heads, args.head_dim, dtype=dtype, device="cuda")
    return {"q": q, "k": k_cache, "v": v_cache, "cu": cu_q_lens, "kv": kv_lens, "table": table}


def _dense_kv(batch: dict, lens, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sequence's K/V gathered out of the pages, [kv_len, Hkv, D] (outside the timed region)."""
    out = []
    for s, (_, kv) in enumerate(lens):
        ids = batch["table"][s, : math.ceil(kv / block_size)].long()
        k = batch["k"][ids].flatten(0, 1)[:kv]
        v = batch["v"][ids].flatten(0, 1)[:kv]
        out.append((k, v))
    return out


def _sdpa_fn(batch: dict, lens, dense, scale: float) -> Callable[[], None]:
    """torch SDPA per group of equal (q_len, kv_len), bottom-right causal, dense K/V."""
    from torch.nn.attention.bias import causal_lower_right

    groups: dict[tuple[int, int], list[int]] = {}
    for s, shape in enumerate(lens):
        groups.setdefault(shape, []).append(s)
    cu = batch["cu"].tolist()
    calls = []
    for (q_len, kv_len), seqs in groups.items():
        q = torch.stack([batch["q"][cu[s] : cu[s] + q_len] for s in seqs]).transpose(1, 2)
        k = torch.stack([dense[s][0] for s in seqs]).transpose(1, 2)
        v = torch.stack([dense[s][1] for s in seqs]).transpose(1, 2)
        mask = None if q_len == 1 else causal_lower_right(q_len, kv_len)
        calls.append((q, k, v, mask))

    def run() -> None:
        for q, k, v, mask in calls:
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )

    return run


def _flash_varlen_fn(batch: dict, lens, dense, scale: float) -> Callable[[], None] | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    k = torch.cat([d[0] for d in dense])
    v = torch.cat([d[1] for d in dense])
    cu_k = torch.tensor([0] + [kv for _, kv in lens], device="cuda").cumsum(0).to(torch.int32)
    max_q, max_k = max(q for q, _ in lens), max(kv for _, kv in lens)

    def run() -> None:  # flash-attn >= 2.1 aligns the causal mask bottom-right, as we do
        flash_attn_varlen_func(
            batch["q"], k, v, batch["cu"], cu_k, max_q, max_k, softmax_scale=scale, causal=True
        )

    return run


def sweep_candidates(default: AttentionConfig, decode: bool) -> list[AttentionConfig]:
    """The launch grid (tile rows, key tile, warps, stages), the default's neighbours first: ordered by
    how many of the four fields differ from the default, so a time budget cuts the farthest."""
    from kvmesh.kernels.triton_attention import AttentionConfig  # noqa: F811 - at run time

    rows = (16, 32, 64) if decode else (32, 64, 128)
    grid = [AttentionConfig(m, n, w, st)
            for m, n, w, st in itertools.product(rows, (32, 64, 128), (4, 8), (1, 2, 3, 4))]
    fields = ("block_m", "block_n", "num_warps", "num_stages")

    def distance(c: AttentionConfig) -> int:
        return sum(getattr(c, f) != getattr(default, f) for f in fields)

    return sorted(grid, key=distance)  # stable: grid order within a distance


def _sweep(batch: dict, scenario: Scenario, scale: float, default_ms: float, budget_s: float) -> dict:
    """Times candidate launch configs on one scenario within ``budget_s`` (compiles included), then,
    for a decode-heavy batch, split-KV counts with the best config; returns the best of each."""
    from kvmesh.kernels.triton_attention import attention_config, ragged_paged_attention_triton

    decode = sum(q for q, _ in scenario.lens) <= 2 * len(scenario.lens)
    head_dim_pad = max(16, 1 << (batch["q"].shape[-1] - 1).bit_length())
    default = attention_config(decode, batch["q"].dtype, head_dim_pad)
    deadline = time.monotonic() + budget_s

    def timed(**kw) -> float | None:
        try:
            return _time_ms(lambda: ragged_paged_attention_triton(
                batch["q"], batch["k"], batch["v"], batch["cu"], batch["kv"], batch["table"], scale, **kw))
        except Exception:  # out of shared memory / registers for this shape
            return None

    best: tuple[float, AttentionConfig] | None = None
    candidates = sweep_candidates(default, decode)
    tried = 0
    for config in candidates:
        if tried and time.monotonic() > deadline:
            break  # the first candidate, the default itself, is always timed
        tried += 1
        ms = timed(config=config)
        if ms is not None and (best is None or ms < best[0]):
            best = (ms, config)
    if best is None:
        return {}
    ms, config = best
    print(f"{scenario.name:<20}{'best config':<14}{ms:>9.3f}   {config}  ({default_ms / ms:.2f}x the default; "
          f"{tried} of {len(candidates)} configs in {budget_s:.0f} s)")
    out = {"ms": ms, "config": dataclasses.asdict(config), "speedup": default_ms / ms, "tried": tried,
           "candidates": len(candidates)}
    if decode:
        splits = {n: timed(config=config, num_kv_splits=n) for n in (1, 2, 4, 8, 16)}
        splits = {n: t for n, t in splits.items() if t is not None}
        if splits:
            n_best = min(splits, key=splits.__getitem__)
            print(f"{scenario.name:<20}{'best splits':<14}{splits[n_best]:>9.3f}   num_kv_splits={n_best} "
                  f"(the heuristic's choice with this config: {ms:.3f} ms)")
            out["splits_ms"] = splits
            out["best_splits"] = n_best
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-baselines", action="store_true", help="time only the Triton kernel")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configs per scenario")
    parser.add_argument("--sweep-budget-s", type=float, default=60.0,
                        help="seconds of the sweep per scenario, compiles included (default 60)")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench: a CUDA GPU is needed for timings (none found); nothing measured.")
        return 0

    from kvmesh.kernels.triton_attention import ragged_paged_attention_triton

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    scale = args.head_dim**-0.5
    print(
        f"{torch.cuda.get_device_name()}  {args.dtype}  Hq={args.heads} Hkv={args.kv_heads} "
        f"D={args.head_dim} block_size={args.block_size}"
    )
    print(f"{'scenario':<20}{'impl':<14}{'ms':>9}{'tok/s':>13}{'TFLOP/s':>10}{'GB/s':>9}{'vs triton':>11}")
    figures: dict = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "heads": args.heads,
                     "kv_heads": args.kv_heads, "head_dim": args.head_dim, "block_size": args.block_size,
                     "scenarios": {}}
    for scenario in SCENARIOS:
        row = figures["scenarios"][scenario.name] = {}
        batch = _build(scenario, args, dtype)
        tokens, flops, nbytes = _stats(
            scenario.lens, args.heads, args.kv_heads, args.head_dim, torch.finfo(dtype).bits // 8
        )
        impls: dict[str, Callable[[], object]] = {
            "triton": lambda b=batch: ragged_paged_attention_triton(
                b["q"], b["k"], b["v"], b["cu"], b["kv"], b["table"], scale
            )
        }
        if not args.no_baselines:
            dense = _dense_kv(batch, scenario.lens, args.block_size)
            impls["torch-sdpa"] = _sdpa_fn(batch, scenario.lens, dense, scale)
            flash = _flash_varlen_fn(batch, scenario.lens, dense, scale)
            if flash is not None:
                impls["flash-varlen"] = flash
        base_ms = None
        for name, fn in impls.items():
            try:
                ms = _time_ms(fn)
            except Exception as exc:  # a baseline that does not support this shape / build
                print(f"{scenario.name:<20}{name:<14}  n/a: {type(exc).__name__}: {exc}"[:160])
                continue
            base_ms = base_ms or ms
            row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "gbps": nbytes / ms / 1e6}
            print(
                f"{scenario.name:<20}{name:<14}{ms:>9.3f}{tokens / ms * 1e3:>13,.0f}"
                f"{flops / ms / 1e9:>10.1f}{nbytes / ms / 1e6:>9.0f}{ms / base_ms:>10.2f}x"
            )
        if "triton" in row and "torch-sdpa" in row:
            row["triton_over_sdpa"] = row["torch-sdpa"]["ms"] / row["triton"]["ms"]  # speed ratio, goal >= 0.9
        if args.sweep and "triton" in row:
            row["sweep"] = _sweep(batch, scenario, scale, row["triton"]["ms"], args.sweep_budget_s)
        del batch
        torch.cuda.empty_cache()
    print("'vs triton' = other time / triton time (>1: triton faster). SDPA/flash read dense, unpaged K/V.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
