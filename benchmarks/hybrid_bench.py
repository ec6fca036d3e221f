"""Hybrid KV allocator benchmark: KV memory per request and concurrency for windowed models.

No model runs: the real ``Scheduler`` and ``KVCacheManager`` drive the allocation of real-size
configs, and a stub "model" samples token 7 for every row. So the figures are the allocator's,
exact and machine-independent (no timing is measured).

Memory accounting: a block id names one page (``block_size`` tokens x KV heads x head dim, K and
V) in each of ``layers_per_group`` tensors (model_worker/scheduling/kv_cache_spec.py), so a block costs
``layers_per_group`` pages. The pool gets ``--kv-gib`` of memory in both runs; the all-full run
has one group of every layer (the model treated as full attention), the hybrid run its groups.

Part 1, per config and context length: a single request of ``context - 128`` prompt tokens and
128 output tokens; KV blocks (all groups) and bytes it holds at its peak and at the end, and the
saving, and how many such requests the pool fits at once at the full context (``fit`` = usable
blocks // blocks at the end). Then ``--num-requests`` such requests at once (all at t=0, prompt
tokens random): the most requests running at once (``sim run``; with a 2048-token step budget
admission of 8k prompts, not memory, often bounds it) and preemptions (memory ran out).

Part 2: prefix hit rate on a shared-prefix workload (``--prefixes`` system prompts of
``--prefix-len`` tokens, each request one of them + a random suffix), hybrid vs all-full, in pools
of the same bytes (``--hit-kv-gib``: a small one under pressure, a large one without); the hit
rate is prefix-cache hit tokens / looked-up prompt tokens (re-admissions after preemption count).

Run: .venv/bin/python benchmarks/hybrid_bench.py [--kv-gib 40] [--contexts 8192,16384]
     [--num-requests 256] [--budget 2048] [--hit-requests 120] [--hit-kv-gib 4,16]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.kv_cache_spec import KVCacheConfig
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.scheduling.scheduler import Scheduler

BS = 16
OUTPUT = 128


@dataclass(frozen=True)
class ModelShape:
    name: str
    windows: list[int | None]
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def page_bytes(self) -> int:
        return 2 * BS * self.kv_heads * self.head_dim * self.dtype_bytes


CONFIGS = [
    # Mistral-7B-v0.1: 32 layers, all windowed (4096), 8 KV heads of 128, bf16.
    ModelShape("mistral-7b-like (32 x SWA 4096)", [4096] * 32, 8, 128),
    # Gemma-2-9B: 42 layers alternating window 4096 / full, 8 KV heads of 256.
    ModelShape("gemma2-9b-like (21 SWA 4096 + 21 full)", [4096, None] * 21, 8, 256),
    # Qwen2-7B with use_sliding_window, max_window_layers 14: layers 14..27 windowed (4096).
    ModelShape("qwen2-7b-like (14 full + 14 SWA 4096)", [None] * 14 + [4096] * 14, 4, 128),
]


def kv_config(shape: ModelShape, hybrid: bool) -> KVCacheConfig:
    if hybrid:
        return KVCacheConfig.from_sliding_windows(shape.windows, BS)
    return KVCacheConfig.full_attention(BS, len(shape.windows))


def pool_blocks(shape: ModelShape, cfg: KVCacheConfig, kv_gib: float) -> int:
    return int(kv_gib * 2**30) // (shape.page_bytes() * cfg.layers_per_group)


def run(sched: Scheduler, track: str | None = None) -> tuple[int, int, int]:
    """Drives the scheduler to the end.

    Returns:
        The most requests running at once, and the peak and last block count (all groups, null
        entries excluded) of request ``track`` after a schedule().
    """
    max_running = peak = last = 0
    kv = sched.kv_cache_manager
    while sched.has_unfinished_requests():
        out = sched.schedule()
        max_running = max(max_running, sched.num_running)
        if track is not None:
            last = sum(1 for i in kv.get_block_ids(track) if i != 0)
            peak = max(peak, last)
        sched.update_from_output(out, {s.request.request_id: [7] for s in out.scheduled if s.sample})
    return max_running, peak, last


def make_request(rid: str, tokens: list[int], hasher: BlockHasher) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=OUTPUT, ignore_eos=True), block_hasher=hasher)


def memory_table(args: argparse.Namespace) -> None:
    hasher = BlockHasher("bench", block_size=BS)
    print(f"Part 1: KV memory per request ({args.kv_gib:g} GiB KV pool, block {BS}, step budget "
          f"{args.budget} tokens, {OUTPUT} output tokens, bf16)")
    head = (f"{'config':<40} {'ctx':>6} {'mode':<9} {'blk/req peak':>12} {'end':>5} "
            f"{'MiB/req end':>11} {'saved':>6} {'pool blk':>8} {'fit':>5} {'sim run':>7} {'preempt':>7}")
    print(head)
    rng = random.Random(0)
    for shape in CONFIGS:
        for ctx in args.contexts:
            end_bytes = {}
            for hybrid in (False, True):
                cfg = kv_config(shape, hybrid)
                block_bytes = shape.page_bytes() * cfg.layers_per_group
                num_blocks = pool_blocks(shape, cfg, args.kv_gib)
                sconf = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=args.budget, max_model_len=ctx + 1)
                # One request alone: its peak and its last block count (at the full context).
                kv = KVCacheManager(num_blocks, BS, kv_cache_config=cfg, enable_events=False)
                sched = Scheduler(sconf, kv)
                sched.add_request(make_request("one", [rng.randrange(30000) for _ in range(ctx - OUTPUT)], hasher))
                _, peak, end = run(sched, track="one")
                # Many at once.
                kv = KVCacheManager(num_blocks, BS, kv_cache_config=cfg, enable_events=False)
                sched = Scheduler(sconf, kv)
                for i in range(args.num_requests):
                    sched.add_request(make_request(str(i), [rng.randrange(30000) for _ in range(ctx - OUTPUT)], hasher))
                max_running, _, _ = run(sched)
                end_bytes[hybrid] = end * block_bytes
                saved = "" if not hybrid else f"{1 - end_bytes[True] / end_bytes[False]:6.1%}"
                print(f"{shape.name:<40} {ctx:>6} {'hybrid' if hybrid else 'all-full':<9} {peak:>12} {end:>5} "
                      f"{end * block_bytes / 2**20:>11.1f} {saved:>6} {num_blocks:>8} {(num_blocks - 1) // end:>5} "
                      f"{max_running:>7} "
                      f"{sched.num_preemptions:>7}")


def hit_rate_table(args: argparse.Namespace) -> None:
    hasher = BlockHasher("bench", block_size=BS)
    print(f"\nPart 2: prefix hit rate, {args.prefixes} shared prefixes of {args.prefix_len} tokens, "
          f"{args.hit_requests} requests (prefix + 256..1024 random tokens, {OUTPUT} output), "
          f"budget {args.budget}, 16 requests at a time")
    print(f"{'config':<40} {'KV GiB':>6} {'mode':<9} {'pool blk':>8} {'hit rate':>8} {'preempt':>7}")
    for shape, gib, hybrid in ((s, g, h) for s in CONFIGS for g in args.hit_kv_gib for h in (False, True)):
        rng = random.Random(1)
        prefixes = [[rng.randrange(30000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
        cfg = kv_config(shape, hybrid)
        num_blocks = pool_blocks(shape, cfg, gib)
        kv = KVCacheManager(num_blocks, BS, kv_cache_config=cfg, enable_events=False)
        sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=args.budget,
                                          max_model_len=args.prefix_len + 1024 + OUTPUT + 1), kv)
        for i in range(args.hit_requests):
            suffix = [rng.randrange(30000) for _ in range(rng.randrange(256, 1025))]
            sched.add_request(make_request(str(i), rng.choice(prefixes) + suffix, hasher))
        run(sched)
        print(f"{shape.name:<40} {gib:>6g} {'hybrid' if hybrid else 'all-full':<9} {num_blocks:>8} "
              f"{kv.prefix_cache_hit_rate:>8.1%} {sched.num_preemptions:>7}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-gib", type=float, default=40.0, help="KV pool size of part 1")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 16384])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=6144)
    p.add_argument("--hit-requests", type=int, default=120)
    p.add_argument("--hit-kv-gib", type=lambda s: [float(x) for x in s.split(",")], default=[4.0, 16.0],
                   help="KV pool sizes of part 2 (small: pressure)")
    args = p.parse_args()
    memory_table(args)
    hit_rate_table(args)


if __name__ == "__main__":
    main()
