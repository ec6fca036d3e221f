"""Host KV tier benchmark: what the tier costs when it never hits, and what a host hit costs.

H0  Cost at h = 0: requests with no shared prefix (nothing can hit, on the device or the host),
    all submitted at once, the engine with the tier on and off side by side (alternating, median
    of ``--repeats``). Two device pools: one that holds the whole workload (no eviction, so no
    copies: the tier's bookkeeping alone) and one a quarter of it (every block is evicted, so every
    hashed block is copied to the host tier and never read back: the tier's worst case). Printed as
    time on / time off, per wall second and per CPU second (goal <= 1.02).
TTFT  One request whose prefix was computed before, served three ways on the same engine settings:
    from the device pool (a device hit), from the host tier (evicted from the device by unrelated
    requests, then loaded back) and recomputed (the same history without the tier). Time to first
    token of the request alone (add to first token), median of ``--repeats``; the ratio host hit /
    device hit is the issue's measure (goal <= 2.0 on a GPU; on CPU both pools are host memory).

On a GPU (``--device cuda``: the tier's pinned memory and copy stream) ``--ttft-only --one-engine``
measures the TTFT part on one warm engine (compile and CUDA graphs as a worker runs them, built once:
a start costs tens of seconds there): per repeat and prefix, a device hit (the prefix computed just
before), a host hit (computed, then pushed off the device by unrelated prompts into the tier) and a
miss (a fresh prefix of the same length: recomputed), each a fresh random prefix. ``make gpu-check``
runs it on the 1B shape (its "host-tier" part).

Run: .venv/bin/python benchmarks/host_tier_bench.py [--model DIR|1b] [--threads N] [--quick]
     [--device cpu|cuda] [--ttft-only] [--one-engine] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import model_dir  # noqa: E402

from kvmesh.contract.types import SamplingParams
from kvmesh.make_model import ensure_default_model
from kvmesh.model_worker.config import ModelConfig
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.execution.model_runner import set_cpu_threads


def random_tokens(n: int, gen: torch.Generator, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


def timed_run(model: str, prompts: list[list[int]], params: SamplingParams, **kw) -> tuple[float, float, dict]:
    """Wall and CPU seconds of one run on a fresh engine, and its cache counters."""
    llm = LLM(model, **kw)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up, 0 shared blocks
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    s = llm.engine.stats()
    host = llm.engine.kv_cache_manager.host_pool
    return wall, cpu, {"hit": sum(o.cached_tokens for o in outs), "host_hits": s.host_cache_hits,
                       "offloaded": host.num_stored if host is not None else 0}


def bench_h0(model: str, prompts: list[list[int]], params: SamplingParams, repeats: int, host_blocks: int,
             **kw) -> dict:
    """Alternates tier on / off; the medians of wall and CPU seconds of each."""
    secs: dict[bool, list[float]] = {True: [], False: []}
    cpus: dict[bool, list[float]] = {True: [], False: []}
    info: dict = {}
    for _ in range(repeats):
        for on in (True, False):
            wall, cpu, counters = timed_run(model, prompts, params, host_kv_blocks=host_blocks if on else None, **kw)
            secs[on].append(wall)
            cpus[on].append(cpu)
            if on:
                info = counters
    med = statistics.median
    return {"on": med(secs[True]), "off": med(secs[False]), "cpu_on": med(cpus[True]), "cpu_off": med(cpus[False]),
            **info}


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds from add to the first token of ``prompt`` alone on ``llm``'s engine, its cached tokens
    and how many of them the host tier served; runs the request to its end."""
    engine = llm.engine
    host0 = engine.stats().host_cache_hits
    rid = f"probe-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    first = None
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids and first is None:
                first = time.perf_counter() - t0
                cached = out.num_cached_tokens
    assert first is not None
    return first, cached, engine.stats().host_cache_hits - host0


def bench_ttft(model: str, prefix_len: int, repeats: int, vocab: int, host_blocks: int, **kw) -> dict:
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"device": [], "host": [], "recomputed": []}
    served: dict[str, tuple[int, int]] = {}
    for _ in range(repeats):
        prefix = random_tokens(prefix_len, gen, vocab)
        q = [random_tokens(16, gen, vocab) for _ in range(2)]
        # unrelated prompts that take every device block: the prefix leaves the device
        fill = [random_tokens(prefix_len, gen, vocab) for _ in range(3)]
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        for case in ("device", "host", "recomputed"):
            llm = LLM(model, host_kv_blocks=host_blocks if case != "recomputed" else None, **kw)
            # NOTE: the same requests before the probe in every case, in the order that puts the
            # prefix on the device (last) or out of it (first)
            history = [*fill, prefix + q[0]] if case == "device" else [prefix + q[0], *fill]
            for p in history:
                llm.generate([p], params)
            t, cached, host = ttft(llm, prefix + q[1])
            times[case].append(t)
            served[case] = (cached, host)
    med = statistics.median
    return {case: med(v) for case, v in times.items()} | {"served": served}


def bench_ttft_one_engine(llm: LLM, prefix_len: int, repeats: int, vocab: int, fill_len: int) -> dict:
    """Device hit, host hit and miss TTFTs of ``prefix_len``-token prefixes on one warm engine (its
    device pool holds about two prompts of ``fill_len``; three unrelated prompts of that length push
    a prefix off the device into the host tier)."""
    gen = torch.Generator().manual_seed(prefix_len)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times: dict[str, list[float]] = {"device": [], "host": [], "recomputed": []}
    served: dict[str, list[tuple[int, int]]] = {k: [] for k in times}
    for _ in range(repeats):
        for case in ("device", "host", "recomputed"):
            prefix = random_tokens(prefix_len, gen, vocab)
            if case != "recomputed":
                llm.generate([prefix + random_tokens(16, gen, vocab)], params)
            if case == "host":
                llm.generate([random_tokens(fill_len, gen, vocab) for _ in range(3)], params)
            t, cached, host = ttft(llm, prefix + random_tokens(16, gen, vocab))
            times[case].append(t)
            served[case].append((cached, host))
    med = statistics.median
    return {case: med(v) for case, v in times.items()} | {"served": served}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir (default: the kvmesh default model)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: shared machines)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--prefix-lens", default="512,2048", help="TTFT: prefix lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="alternate runs; the median is shown")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="16 requests of 512 tokens, prefix 512, 1 repeat")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the tier's CUDA path: pinned memory, a copy stream)")
    ap.add_argument("--ttft-only", action="store_true", help="skip the cost at h = 0")
    ap.add_argument("--one-engine", action="store_true",
                    help="TTFT on one warm engine (what a GPU needs: its start compiles and captures)")
    ap.add_argument("--json", default=None, help="write the TTFT figures here")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.prompt_len, args.prefix_lens, args.repeats = 16, 512, "512", 1
    set_cpu_threads(args.threads)
    model = model_dir(args.model) if args.model else str(ensure_default_model())
    cfg = ModelConfig.from_dir(model)
    bs = 16
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "fp32 CPU"
    print(f"model: {Path(model).name} ({cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_kv_heads} KV heads x {cfg.head_dim}), {where}, {args.threads} torch thread(s)")
    if args.one_engine:
        lens = [int(x) for x in args.prefix_lens.split(",")]
        fill = max(lens) + 16
        blocks = 2 * -(-(fill + 16) // bs) + 2
        llm = LLM(model, device=args.device, num_blocks=blocks, host_kv_blocks=8 * blocks, max_num_seqs=4,
                  max_model_len=max(fill + 64, 1024), max_num_batched_tokens=max(2048, fill + 16))
        print(f"\nTTFT on one warm engine: device pool {blocks} blocks, host tier {8 * blocks}; median of "
              f"{args.repeats}")
        print(f"{'prefix':>7}{'device hit ms':>15}{'host hit ms':>13}{'recomputed ms':>15}{'host/device':>13}"
              f"{'recomputed/device':>19}")
        figures: dict = {"model": model, "device": where, "prefixes": {}}
        for n in lens:
            r = bench_ttft_one_engine(llm, n, args.repeats, vocab=min(cfg.vocab_size, 32_000), fill_len=fill)
            d, h, c = r["device"], r["host"], r["recomputed"]
            host_served = all(host > 0 for _, host in r["served"]["host"])
            figures["prefixes"][str(n)] = {"device_ms": d * 1e3, "host_ms": h * 1e3, "recomputed_ms": c * 1e3,
                                           "host_over_device": h / d, "host_hits_served": host_served,
                                           "served": r["served"]}
            print(f"{n:>7}{d * 1e3:>15.1f}{h * 1e3:>13.1f}{c * 1e3:>15.1f}{h / d:>13.2f}{c / d:>19.2f}"
                  + ("" if host_served else "  (a host probe was not served from the tier)"))
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
        return

    gen = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size
    prompts = [random_tokens(args.prompt_len, gen, vocab) for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    seq_blocks = -(-(args.prompt_len + args.output_len) // bs)
    whole = args.num_requests * seq_blocks + 1
    base = {"max_model_len": max(args.prompt_len + args.output_len, 1024), "device": args.device,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.num_requests}
    if not args.ttft_only:
        print(f"\nH0  {args.num_requests} requests x {args.prompt_len} random tokens (no shared prefix: h = 0), "
              f"{args.output_len} output tokens, tier of {whole} blocks, median of {args.repeats}")
        print(f"{'device pool':<34}{'on s':>8}{'off s':>8}{'on/off':>8}{'CPU on/off':>12}{'offloaded':>11}{'hits':>6}")
        for name, blocks in (("whole workload (no eviction)", whole),
                             ("1/4 of it (every block evicted)", max(whole // 4, seq_blocks * 2 + 1))):
            r = bench_h0(model, prompts, params, args.repeats, host_blocks=whole, num_blocks=blocks,
                         max_num_seqs=min(args.num_requests, (blocks - 1) // seq_blocks),
                         **{k: v for k, v in base.items() if k != "max_num_seqs"})
            print(f"{name:<34}{r['on']:>8.2f}{r['off']:>8.2f}{r['on'] / r['off']:>8.3f}"
                  f"{r['cpu_on'] / r['cpu_off']:>12.3f}{r['offloaded']:>11}{r['hit']:>6}")
        print("cost at h = 0, tier on / off (goal <= 1.02): the ratios above")

    print(f"\nTTFT  one request of prefix + 16 tokens, 4 output tokens; device pool of two prefixes, median of "
          f"{args.repeats}")
    print(f"{'prefix':>7}{'device hit ms':>15}{'host hit ms':>13}{'recomputed ms':>15}{'host/device':>13}"
          f"{'recomputed/device':>19}  served (cached, from host)")
    for n in (int(x) for x in args.prefix_lens.split(",")):
        blocks = 2 * (-(-(n + 32) // bs)) + 2
        r = bench_ttft(model, n, args.repeats, vocab, host_blocks=4 * blocks, num_blocks=blocks,
                       **{**base, "max_model_len": max(n + 64, 1024), "max_num_seqs": 4})
        d, h, c = r["device"], r["host"], r["recomputed"]
        print(f"{n:>7}{d * 1e3:>15.1f}{h * 1e3:>13.1f}{c * 1e3:>15.1f}{h / d:>13.2f}{c / d:>19.2f}  {r['served']}")


if __name__ == "__main__":
    main()
