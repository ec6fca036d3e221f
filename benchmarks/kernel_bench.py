"""Times the Triton ragged paged attention on prefill-heavy, decode-heavy and mixed batches.

Usage: ``python benchmarks/kernel_bench.py [--dtype bf16|fp16] [--heads 32 --kv-heads 8 --head-dim 128 |
--shapes all|32/8x128,14/2x64] [--json OUT] [--sweep [--write-table PATH]]``

Per scenario it prints tokens/s, achieved TFLOP/s (causal FLOPs actually needed, 4 per visible
(query, key, head, dim)) and GB/s (a lower bound on traffic: q + out + each sequence's K/V read
once), then the same for torch SDPA on dense, already gathered K/V (an idealised baseline that
does no paging) and flash-attn's varlen kernel when it is importable. It also measures the
device's copy bandwidth (a 1 GiB device-to-device copy: read + write bytes / time), the roofline
a decode batch's GB/s is compared with. ``--shapes all`` runs every head shape kvmesh serves
(kernels/attention_configs.py, SERVED_HEAD_SHAPES). Needs a CUDA GPU for timings; on a machine
without one it says so and exits 0 (after writing the table of defaults when ``--write-table`` asks).

``--sweep`` also times a grid of launch configs (tile rows, key tile, warps, pipeline stages) per
scenario, the default's neighbours first, for ``--sweep-budget-s`` each (compiles included), then
split-KV counts and the split policy's programs-per-SM on decode-heavy batches, and prints the best
beside the default. ``--write-table PATH`` writes the winners per (head dim, group, phase, dtype)
into the committed table (kernels/attention_configs.json; docs/kernels.md, "Launch configs").
``--json`` writes every figure.
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
from pathlib import Path

import torch

from kvmesh.kernels.attention_configs import (
    DTYPE_NAMES,
    SERVED_HEAD_SHAPES,
    AttentionConfig,
    ConfigTable,
    SplitKVPolicy,
    attention_config,
    defaults_table,
    load_table,
    phase_name,
)


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


@dataclass(frozen=True)
class HeadShape:
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def name(self) -> str:
        return f"{self.heads}/{self.kv_heads}x{self.head_dim}"

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @classmethod
    def parse(cls, text: str) -> HeadShape:
        """``32/8x128`` -> HeadShape(32, 8, 128)."""
        heads, rest = text.split("/")
        kv_heads, head_dim = rest.split("x")
        return cls(int(heads), int(kv_heads), int(head_dim))


def parse_shapes(text: str | None, default: HeadShape) -> list[HeadShape]:
    if not text:
        return [default]
    if text == "all":
        return [HeadShape(*s) for s in SERVED_HEAD_SHAPES]
    return [HeadShape.parse(t) for t in text.split(",")]


def is_decode(scenario: Scenario) -> bool:
    """The wrapper's own test: mean query length <= 2."""
    return sum(q for q, _ in scenario.lens) <= 2 * len(scenario.lens)


def copy_bandwidth_gbps(nbytes: int = 2**30) -> float:
    """The device's copy bandwidth: bytes read + written by a device-to-device copy, per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def _build(scenario: Scenario, shape: HeadShape, block_size: int, dtype) -> dict:
    lens = scenario.lens
    num_q_heads = shape.heads
    blocks = [math.ceil(kv / block_size) for _, kv in lens]
    num_blocks = sum(blocks) + 8
    shape = (num_blocks, block_size, shape.kv_heads, shape.head_dim)
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
    q = torch.randn(int(cu_q_lens[-1]), num_q_heads, shape[-1], dtype=dtype, device="cuda")
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


def sweep_candidates(default: AttentionConfig, decode: bool, head_dim: int = 128) -> list[AttentionConfig]:
    """The launch grid (tile rows, key tile, warps, stages), the default's neighbours first: ordered by
    how many of the four fields differ from the default, so a time budget cuts the farthest. Head
    dims <= 64 also try 256-key tiles (a small head's tile moves few bytes per iteration)."""
    rows = (16, 32, 64) if decode else (32, 64, 128)
    keys = (32, 64, 128, 256) if head_dim <= 64 else (32, 64, 128)
    grid = [AttentionConfig(m, n, w, st) for m, n, w, st in itertools.product(rows, keys, (4, 8), (1, 2, 3, 4))]
    fields = ("block_m", "block_n", "num_warps", "num_stages")

    def distance(c: AttentionConfig) -> int:
        return sum(getattr(c, f) != getattr(default, f) for f in fields)

    return sorted(grid, key=distance)  # stable: grid order within a distance


POLICIES = (1, 2, 4, 8)
"""Split policies the sweep tries: programs per SM below which a decode batch splits."""


def _sweep(batch: dict, scenario: Scenario, scale: float, default_ms: float, budget_s: float) -> dict:
    """Times candidate launch configs on one scenario within ``budget_s`` (compiles included), then,
    for a decode-heavy batch, split-KV counts and split policies with the best config; returns the
    best of each and every timing (the table writer compares configs across a phase's scenarios)."""
    from kvmesh.kernels.triton_attention import ragged_paged_attention_triton

    decode = is_decode(scenario)
    q = batch["q"]
    group = q.shape[1] // batch["k"].shape[2]
    default = attention_config(decode, q.dtype, q.shape[-1], group)
    deadline = time.monotonic() + budget_s

    def timed(**kw) -> float | None:
        try:
            return _time_ms(lambda: ragged_paged_attention_triton(
                batch["q"], batch["k"], batch["v"], batch["cu"], batch["kv"], batch["table"], scale, **kw))
        except Exception:  # out of shared memory / registers for this shape
            return None

    best: tuple[float, AttentionConfig] | None = None
    candidates = sweep_candidates(default, decode, q.shape[-1])
    tried = 0
    timings: list[tuple[dict, float]] = []
    for config in candidates:
        if tried and time.monotonic() > deadline:
            break  # the first candidate, the default itself, is always timed
        tried += 1
        ms = timed(config=config)
        if ms is None:
            continue
        timings.append((dataclasses.asdict(config), ms))
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        return {}
    ms, config = best
    print(f"{scenario.name:<20}{'best config':<14}{ms:>9.3f}   {config}  ({default_ms / ms:.2f}x the default; "
          f"{tried} of {len(candidates)} configs in {budget_s:.0f} s)")
    out = {"ms": ms, "config": dataclasses.asdict(config), "speedup": default_ms / ms, "tried": tried,
           "candidates": len(candidates), "timings": timings}
    if decode:
        splits = {n: timed(config=config, num_kv_splits=n) for n in (1, 2, 4, 8, 16)}
        splits = {n: t for n, t in splits.items() if t is not None}
        if splits:
            n_best = min(splits, key=splits.__getitem__)
            print(f"{scenario.name:<20}{'best splits':<14}{splits[n_best]:>9.3f}   num_kv_splits={n_best} "
                  f"(the heuristic's choice with this config: {ms:.3f} ms)")
            out["splits_ms"] = splits
            out["best_splits"] = n_best
        policies = {p: timed(config=config, split_policy=SplitKVPolicy(programs_per_sm=p)) for p in POLICIES}
        out["policy_ms"] = {p: t for p, t in policies.items() if t is not None}
    return out


def tuned_table(base: ConfigTable, figures: dict, dtype_name: str, device: str, day: str) -> ConfigTable:
    """``base`` with the sweep's winners: per shape and phase, the config with the best geometric mean
    of (time / the default's time) over the phase's scenarios, among configs timed in all of them;
    the split policy whose decode-heavy batches took the least time in all (when timed)."""
    configs, tuned = dict(base.configs), dict(base.tuned_on)
    policy_total: dict[int, float] = {}
    for shape_name, shape_figures in figures["shapes"].items():
        shape = HeadShape.parse(shape_name)
        for decode in (True, False):
            runs = [row["sweep"] for name, row in shape_figures["scenarios"].items()
                    if row.get("sweep") and is_decode(_SCENARIOS_BY_NAME[name]) == decode]
            if not runs:
                continue
            per_run = [{json.dumps(c, sort_keys=True): ms for c, ms in r["timings"]} for r in runs]
            common = set.intersection(*(set(t) for t in per_run))
            base_ms = [r["timings"][0][1] for r in runs]  # the default is timed first
            if not common:
                continue
            best = min(common, key=lambda c: math.prod(t[c] / b for t, b in zip(per_run, base_ms, strict=True)))
            key = (shape.head_dim, shape.group, phase_name(decode), dtype_name)
            configs[key] = AttentionConfig(**json.loads(best))
            tuned[key] = f"{device} {day}"
            if decode:
                for r in runs:
                    for p, ms in r.get("policy_ms", {}).items():
                        policy_total[int(p)] = policy_total.get(int(p), 0.0) + ms
    split_kv = base.split_kv
    if policy_total and len(policy_total) == len(POLICIES):
        split_kv = dataclasses.replace(split_kv, programs_per_sm=min(policy_total, key=policy_total.__getitem__))
    return ConfigTable(configs, split_kv, tuned, note=f"swept by benchmarks/kernel_bench.py --sweep on {device}, {day}; "
                       "entries without tuned_on are defaults")


_SCENARIOS_BY_NAME = {s.name: s for s in SCENARIOS}


def write_table(path: Path, table: ConfigTable) -> None:
    """The table as JSON, one config a line (a sweep's diff then reads row by row)."""
    data = table.to_json()
    rows = ",\n".join("  " + json.dumps(row) for row in data.pop("configs"))
    head = json.dumps(data, indent=1)[:-2]
    path.write_text(f'{head},\n "configs": [\n{rows}\n ]\n}}\n')
    print(f"wrote {path}: {len(table.configs)} configs, {len(table.tuned_on)} tuned on a GPU")


def bench_shape(shape: HeadShape, args, dtype) -> dict:
    """Every scenario of one head shape: Triton, SDPA (and flash-attn), the sweep when asked."""
    from kvmesh.kernels.triton_attention import ragged_paged_attention_triton

    scale = shape.head_dim**-0.5
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  Hq={shape.heads} Hkv={shape.kv_heads} "
          f"D={shape.head_dim} block_size={args.block_size}")
    print(f"{'scenario':<20}{'impl':<14}{'ms':>9}{'tok/s':>13}{'TFLOP/s':>10}{'GB/s':>9}{'vs triton':>11}")
    figures: dict = {"heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "scenarios": {}}
    for scenario in SCENARIOS:
        row = figures["scenarios"][scenario.name] = {}
        batch = _build(scenario, shape, args.block_size, dtype)
        tokens, flops, nbytes = _stats(
            scenario.lens, shape.heads, shape.kv_heads, shape.head_dim, torch.finfo(dtype).bits // 8
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
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--shapes", default=None,
                        help="head shapes as HQ/HKVxD, comma-separated, or 'all' (every served shape); "
                             "overrides --heads/--kv-heads/--head-dim")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-baselines", action="store_true", help="time only the Triton kernel")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configs per scenario")
    parser.add_argument("--sweep-budget-s", type=float, default=60.0,
                        help="seconds of the sweep per scenario, compiles included (default 60)")
    parser.add_argument("--write-table", type=Path, default=None,
                        help="write the launch-config table here (with --sweep on a GPU: the winners; without "
                             "CUDA: the defaults, marked untuned)")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--scenarios", default=None, help="comma-separated scenario names (default: all)")
    parser.add_argument("--launch-once", action="store_true",
                        help="run the Triton kernel once per shape and scenario, untimed (under a profiler: ncu)")
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes, HeadShape(args.heads, args.kv_heads, args.head_dim))
    if args.scenarios:
        wanted = args.scenarios.split(",")
        unknown = set(wanted) - set(_SCENARIOS_BY_NAME)
        if unknown:
            parser.error(f"unknown scenarios {sorted(unknown)}; choose from {list(_SCENARIOS_BY_NAME)}")
        SCENARIOS[:] = [_SCENARIOS_BY_NAME[n] for n in wanted]
    if not torch.cuda.is_available():
        if args.write_table:
            write_table(args.write_table, defaults_table())
        print("kernel_bench: a CUDA GPU is needed for timings (none found); nothing measured.")
        return 0
    if args.write_table and not args.sweep:
        parser.error("--write-table on a GPU writes what --sweep measured: add --sweep")

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.launch_once:
        from kvmesh.kernels.triton_attention import ragged_paged_attention_triton

        for shape in shapes:
            for scenario in SCENARIOS:
                b = _build(scenario, shape, args.block_size, dtype)
                ragged_paged_attention_triton(b["q"], b["k"], b["v"], b["cu"], b["kv"], b["table"], shape.head_dim**-0.5)
                torch.cuda.synchronize()
                print(f"launched {shape.name} {scenario.name}", flush=True)
        return 0
    device = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth_gbps()
    torch.cuda.empty_cache()
    print(f"{device}: device-to-device copy {copy_gbps:,.0f} GB/s (read + write)")
    figures: dict = {"device": device, "dtype": args.dtype, "block_size": args.block_size, "copy_gbps": copy_gbps,
                     "shapes": {}}
    for shape in shapes:
        figures["shapes"][shape.name] = bench_shape(shape, args, dtype)
        if args.json:  # NOTE: after every shape, so a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(figures, indent=1))
    print("'vs triton' = other time / triton time (>1: triton faster). SDPA/flash read dense, unpaged K/V.")
    if args.write_table:
        table = tuned_table(load_table(), figures, DTYPE_NAMES[dtype], device, time.strftime("%Y-%m-%d"))
        write_table(args.write_table, table)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
