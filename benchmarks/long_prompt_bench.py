"""Long prompts at the cost of their new text (issue 49): the router's tokenizer with and without its
cache of tokenized prefixes (router/text/prefix_tokens.py), side by side in one run, through
``PromptTokenizer`` on an asyncio loop as the router and ``kvmesh epp``'s picker call it.

Two tokenizers, each scenario run on both:
  tiny  the demo model's (``kvmesh make-model``: byte-level BPE, ~660 ids, ~2 bytes a token here);
  prod  the same pre-tokenizer (Qwen2's split regex + byte-level) with a production-sized vocabulary
        (``--vocab``, default 32,768) trained here with ``tokenizers`` on Python's standard library
        sources (~10 MB; kept under ~/.cache/kvmesh/ once trained); ~4 bytes a token.
The prompts are every other top-level module of the standard library (code and English docstrings),
never trained on.

Scenarios:
  A  ~220 KB prompts, half of them sharing 90 % of their text (one 198 KB prefix, then 22 KB of their
     own), the other half wholly their own; ``--concurrency`` (20) requests at a time, closed loop:
     p50 / p95 latency of ``encode`` and prompts per second (after one warm-up round).
  B  ~100k-token prompts sharing a ~100k-token prefix, each with ~1 KB of its own, arriving at
     ``--rate`` (10) per second, open loop: p50 / p95 of ``encode``.
For each, the loop's worst lag (a 1 ms ticker's lateness) shows whether anything held the loop.
``--picker`` runs A and B again through the router's whole decision (``ModelRouter.decide``: tokenize,
hash the chain, Lookup, pick: what ``kvmesh epp`` runs per request), in process, on the demo model with
4 registered workers; ``--tokenizers ''`` skips the tokenizer-level runs.

    python benchmarks/long_prompt_bench.py [--concurrency 20] [--rate 10] [--vocab 32768] [--picker] [--json OUT]

The machine's other load is not controlled: say what else ran when quoting the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kvmesh.make_model import train_tokenizer
from kvmesh.replay.records import percentile
from kvmesh.router.text.prefix_tokens import DEFAULT_CACHE_BYTES
from kvmesh.router.text.prompt import PromptLimits, PromptTokenizer
from kvmesh.router.text.tokenizer_pool import usable_cores

STDLIB = Path(os.__file__).parent
LIMITS = PromptLimits()
"""No bound: the tiny tokenizer makes ~1.4 bytes a token of code, 220 KB is over a 131072-token context.
(Under 4 bytes a token of the bound a text is tokenized in one pass: the bound costs nothing either way.)"""


def sources() -> tuple[str, str]:
    """(training text, prompt text): the standard library's sources but its tests and site-packages; the
    prompts are every other top-level module, never trained on."""
    top = sorted(STDLIB.glob("*.py"))
    held = set(top[1::2])
    deep = sorted(p for p in STDLIB.rglob("*.py") if p.parent != STDLIB and "site-packages" not in p.parts
                  and not any(part.startswith("test") for part in p.relative_to(STDLIB).parts))
    read = lambda files: "".join(f.read_text(encoding="utf-8", errors="replace") for f in files)  # noqa: E731
    return read([p for p in top if p not in held] + deep), read(sorted(held))


def prod_tokenizer(vocab: int, train_text: str):
    """The demo tokenizer's pipeline with ``vocab`` ids, trained on ``train_text`` (cached on disk)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from kvmesh.make_model import BOS, EOS, SPLIT_REGEX

    path = Path.home() / ".cache" / "kvmesh" / f"bench-bpe-{vocab}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(train_text.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def window(rng: random.Random, text: str, chars: int) -> str:
    """``chars`` characters of ``text`` from a random line start."""
    start = text.find("\n", rng.randrange(0, len(text) - chars - 1)) + 1
    return text[start:start + chars]


class LoopLag:
    """The lateness of a 1 ms ticker on the running loop (worst and p99), and the process' CPU seconds
    (every thread's: the tokenizer's own threads too) while it ran."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.cpu = 0.0
        self._task: asyncio.Task | None = None

    @property
    def worst(self) -> float:
        return max(self.lags, default=0.0)

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - t - 0.001)

    def __enter__(self) -> LoopLag:
        self.cpu = time.process_time()
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.cpu = time.process_time() - self.cpu


async def closed_loop(prompts: PromptTokenizer, texts: list[str], concurrency: int) -> dict[str, float]:
    """Scenario A: ``concurrency`` requests at a time over ``texts``; the first round warms up."""
    queue = list(texts)
    lat: list[float] = []
    warm = concurrency

    async def client() -> None:
        nonlocal warm
        while queue:
            text = queue.pop(0)
            t = time.perf_counter()
            await prompts.encode(text, LIMITS)
            if warm > 0:
                warm -= 1
            else:
                lat.append(time.perf_counter() - t)

    # NOTE: the warm-up round runs alone first, so its misses do not count in the figures.
    first, queue[:] = queue[:concurrency], queue[concurrency:]
    await asyncio.gather(*(prompts.encode(t, LIMITS) for t in first))
    warm = 0
    with LoopLag() as lag:
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"p50_s": percentile(lat, 50), "p95_s": percentile(lat, 95), "per_s": len(lat) / wall,
            "n": len(lat), "cpu_s": lag.cpu / len(lat), "lag_ms": lag.worst * 1e3,
            "lag_p99_ms": percentile(lag.lags, 99) * 1e3}


async def open_loop(prompts: PromptTokenizer, texts: list[str], rate: float) -> dict[str, float]:
    """Scenario B: ``texts`` arriving every 1/``rate`` s; the first is tokenized (and cached) before."""
    await prompts.encode(texts[0], LIMITS)
    lat: list[float] = []

    async def one(text: str) -> None:
        t = time.perf_counter()
        await prompts.encode(text, LIMITS)
        lat.append(time.perf_counter() - t)

    with LoopLag() as lag:
        tasks = []
        t0 = time.perf_counter()
        for i, text in enumerate(texts[1:]):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(text)))
        await asyncio.gather(*tasks)
    return {"p50_ms": percentile(lat, 50) * 1e3, "p95_ms": percentile(lat, 95) * 1e3, "n": len(lat),
            "cpu_ms": lag.cpu / len(lat) * 1e3, "lag_ms": lag.worst * 1e3, "lag_p99_ms": percentile(lag.lags, 99) * 1e3}


def shape_a(rng: random.Random, text: str, n: int) -> list[str]:
    shared = window(rng, text, 198_000)
    return [shared + window(rng, text, 22_000) if i % 2 == 0 else window(rng, text, 220_000) for i in range(n)]


def shape_b(rng: random.Random, text: str, tok, n: int) -> tuple[list[str], int]:
    chars = 200_000
    while len(tok.encode(prefix := window(rng, text, chars), add_special_tokens=False).ids) < 100_000:
        chars = int(chars * 1.2)
    return [prefix + window(rng, text, 1_000) for _ in range(n)], len(prefix)


def run(args: argparse.Namespace) -> dict:
    train, held = sources()
    t = time.perf_counter()
    names = args.tokenizers.split(",")
    toks = {n: train_tokenizer() if n == "tiny" else prod_tokenizer(args.vocab, train) for n in names}
    print(f"tokenizers ready in {time.perf_counter() - t:.1f} s; {usable_cores()} usable cores; "
          f"prompt text {len(held) / 1e6:.1f} MB of the standard library's sources", flush=True)
    out: dict = {}
    for name, tok in toks.items():
        sample = window(random.Random(0), held, 100_000)
        bpt = len(sample.encode()) / len(tok.encode(sample, add_special_tokens=False).ids)
        rng = random.Random(1)
        a_texts = shape_a(rng, held, args.concurrency + args.prompts)
        b_texts, b_chars = shape_b(rng, held, tok, 1 + int(args.rate * args.seconds))
        row: dict = {"vocab": tok.get_vocab_size(), "bytes_per_token": bpt, "b_prefix_chars": b_chars}
        for mode, cache in (("whole", 0), ("cached", DEFAULT_CACHE_BYTES)):
            prompts = PromptTokenizer(tok, cache_bytes=cache)
            row[f"A_{mode}"] = asyncio.run(closed_loop(prompts, a_texts, args.concurrency))
            row[f"A_{mode}"]["hits"] = prompts.cache.stats.hits
            prompts.close()
            if args.only_a:
                print(f"  {name} {mode}: A {row[f'A_{mode}']}", flush=True)
                continue
            prompts = PromptTokenizer(tok, cache_bytes=cache)
            row[f"B_{mode}"] = asyncio.run(open_loop(prompts, b_texts if cache else b_texts[:1 + args.whole_b],
                                                     args.rate))
            row[f"stats_{mode}"] = asdict(prompts.cache.stats) | {"enabled": prompts.cache.enabled}
            prompts.close()
            print(f"  {name} {mode}: A {row[f'A_{mode}']}  B {row[f'B_{mode}']}", flush=True)
        out[name] = row
    return out


def report(out: dict, args: argparse.Namespace) -> None:
    print(f"\nLong prompts, {usable_cores()} usable cores (shared: other load not controlled)")
    print(f"{'':34}{'tiny':>24}{'prod':>24}")
    print(f"{'vocabulary / bytes a token':34}" + "".join(
        f"{r['vocab']:>15,} / {r['bytes_per_token']:.2f}" for r in out.values()))
    for mode in ("whole", "cached"):
        a = [r[f"A_{mode}"] for r in out.values()]
        print(f"{'A 220 KB, ' + str(args.concurrency) + ' at a time, ' + mode:34}" + "".join(
            f"{x['p50_s']:>8.3f} s p50 {x['per_s']:>6.1f}/s" for x in a))
    for mode in ("whole", "cached"):
        print(f"{'   CPU s a prompt (all threads)':34}" + "".join(
            f"{r[f'A_{mode}']['cpu_s']:>18.3f} {mode[:5]}" for r in out.values()))
    print(f"{'   goal (tiny)':34}{'≤ 0.5 s p50, ≥ 15/s':>24}")
    for mode in ("whole", "cached"):
        b = [r[f"B_{mode}"] for r in out.values()]
        print(f"{'B 100k tokens at ' + str(args.rate) + '/s, ' + mode:34}" + "".join(
            f"{x['p50_ms']:>9.1f} / {x['p95_ms']:>6.1f} ms" for x in b))
    for mode in ("whole", "cached"):
        print(f"{'   CPU ms a prompt (all threads)':34}" + "".join(
            f"{r[f'B_{mode}']['cpu_ms']:>17.1f} {mode[:5]}" for r in out.values()))
    print(f"{'   goal p50 / p95':34}{'≤ 5 / ≤ 10 ms':>24}")
    for mode in ("whole", "cached"):
        print(f"{'loop lag p99 / worst, A+B ' + mode:34}" + "".join(
            f"{max(r[f'A_{mode}']['lag_p99_ms'], r[f'B_{mode}']['lag_p99_ms']):>11.1f} / "
            f"{max(r[f'A_{mode}']['lag_ms'], r[f'B_{mode}']['lag_ms']):>6.0f} ms" for r in out.values()))
    print(f"{'cache hits / misses / refused':34}" + "".join(
        f"{r['stats_cached']['hits']:>12} / {r['stats_cached']['misses']} / {r['stats_cached']['refused']}"
        for r in out.values()))


def picker(args: argparse.Namespace) -> dict:
    """Scenarios A and B through the router's whole decision (``ModelRouter.decide``: tokenize, hash the
    chain, Lookup, pick: what ``kvmesh epp``'s picker runs per request), in process, on the demo model
    (``--max-position-embeddings 131072``) with 4 registered workers on a kv-service (memory store).
    "whole": the same router with its tokenizer's cache switched off."""
    import tempfile

    from kvmesh.bench.processes import start_kv_service
    from kvmesh.contract.modelinfo import model_id_for
    from kvmesh.contract.types import SamplingParams
    from kvmesh.make_model import ModelSpec, make_model
    from kvmesh.router.config import RouterConfig, RoutingConfig
    from kvmesh.router.core.policies.base import PolicyConfig
    from kvmesh.router.generate_types import GenerateInput
    from kvmesh.router.server import RouterServer
    from kvmesh.router.text.prefix_tokens import PrefixTokenCache
    from kvmesh.transport.channels import dial
    from kvmesh.v1 import kv_service_pb2 as kv_pb
    from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc

    model_dir = make_model(Path(tempfile.mkdtemp(prefix="kvmesh-long-")) / "long-model",
                           ModelSpec(max_position_embeddings=131072))
    model = model_id_for(str(model_dir))
    kv_proc, kv_address = start_kv_service("--store", "memory")
    stub = kv_grpc.KVServiceStub(dial(kv_address))
    for i in range(4):
        stub.RegisterWorker(kv_pb.RegisterWorkerRequest(
            worker_id=f"w{i}", address=f"127.0.0.1:{40000 + i}", model_id=model, block_size=16,
            hash_algorithm=kv_pb.HASH_ALGORITHM_SHA256_128, num_blocks=1_000_000, epoch=1), timeout=5)
    cfg = RouterConfig(host="127.0.0.1", port=0, kv_service=kv_address, model_dirs=[str(model_dir)],
                       max_prompt_tokens=0, routing=RoutingConfig(discovery_interval_s=0.2, speculative_ttl_s=0.0,
                                                                  shared_view=False, policy_config=PolicyConfig(seed=0)))
    server = RouterServer(cfg).start()
    _, held = sources()
    out: dict = {}
    try:
        deadline = time.monotonic() + 20
        while len(server.router.pool.endpoints()) < 4:
            if time.monotonic() > deadline:
                raise TimeoutError("the router never saw the 4 workers")
            time.sleep(0.1)
        tok = server.router.prompts.tokenizer
        rng = random.Random(1)
        a_texts = shape_a(rng, held, args.concurrency + args.prompts)
        b_texts, _ = shape_b(rng, held, tok, 1 + int(args.rate * args.seconds))

        class Decider:  # NOTE: closed_loop / open_loop call encode(text, limits); here: the whole decision
            async def encode(self, text: str, _limits: PromptLimits) -> None:
                await server.router.decide(GenerateInput(text, None, SamplingParams(max_tokens=16)))

        for mode in ("whole", "cached"):
            server.router.prompts.cache = PrefixTokenCache(tok, 0 if mode == "whole" else DEFAULT_CACHE_BYTES)
            out[f"A_{mode}"] = server.run(closed_loop(Decider(), a_texts, args.concurrency))
            server.router.prompts.cache = PrefixTokenCache(tok, 0 if mode == "whole" else DEFAULT_CACHE_BYTES)
            out[f"B_{mode}"] = server.run(open_loop(Decider(), b_texts if mode == "cached" else
                                                    b_texts[:1 + args.whole_b], args.rate))
            print(f"  picker {mode}: A {out[f'A_{mode}']}  B {out[f'B_{mode}']}", flush=True)
    finally:
        server.stop(0.5)
        kv_proc.terminate()
        kv_proc.wait(10)
    for mode in ("whole", "cached"):
        a, b = out[f"A_{mode}"], out[f"B_{mode}"]
        print(f"picker (ModelRouter.decide, tiny), {mode}: A p50 {a['p50_s']:.3f} s, {a['per_s']:.1f}/s; "
              f"B p50 / p95 {b['p50_ms']:.1f} / {b['p95_ms']:.1f} ms")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=20, help="scenario A's requests at a time (20)")
    ap.add_argument("--prompts", type=int, default=60, help="scenario A's timed prompts after the warm-up (60)")
    ap.add_argument("--rate", type=float, default=10.0, help="scenario B's arrivals per second (10)")
    ap.add_argument("--seconds", type=float, default=6.0, help="scenario B's duration with the cache (6)")
    ap.add_argument("--whole-b", type=int, default=20, help="scenario B's requests without the cache (20: it queues)")
    ap.add_argument("--vocab", type=int, default=32768, help="the production-sized tokenizer's vocabulary (32768)")
    ap.add_argument("--tokenizers", default="tiny,prod", help="which tokenizers (tiny,prod)")
    ap.add_argument("--only-a", action="store_true", help="scenario A only")
    ap.add_argument("--picker", action="store_true",
                    help="also through the router's whole decision (ModelRouter.decide, as kvmesh epp picks)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    out = run(args) if args.tokenizers else {}
    if out and not args.only_a:
        report(out, args)
    if args.picker:
        out["picker"] = picker(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
