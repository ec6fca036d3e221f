"""Router overhead: tokenize + hash + Lookup + pick, for 1k- and 8k-token prompts; and what the
router adds to a request's time to first token.

Setup: a private redis-server, a `kvmesh kv-service` process on it, W workers registered through
RegisterWorker (no worker process: the decision path never calls one), each prompt's block chain
published for two workers (one holds all of it, one half). The router is built exactly as
`kvmesh router` builds it (RouterServer) and ``ModelRouter.decide`` — the code every Generate runs
before forwarding — is timed on the router's own event loop, end to end and by stage, for text
prompts and for prompts sent as token ids (no tokenization: the router's own share).

Then what a client sees (issue 45): a `kvmesh up --simulate` stack (a fresh Redis, the kv_service,
4 simulated workers at time scale 0.05, the router, each a process; kvmesh/bench/hop.py). First
Redis's own time per Lookup, INFO commandstats read around 300 Lookups of a 250-block chain one
worker holds; then pairs of 4,096-id prompts, one through the router, one straight to the worker
that served it, and a bare grpc.aio hop (a health Check of that worker) in the same client loop:
the difference of the two TTFT medians is the router's share, over the hop's median its length in
hops. (Until issue 45 this part timed one worker on an idle index at time scale 0.1, alternating
with direct requests: the Lookups then met no event ingest, and it read about half the hops a
client of a stack sees; docs/router.md "The hop in bare hops".)

    python benchmarks/router_overhead.py [--workers 16] [--iters 400] [--algorithm sha256_128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvmesh.bench.processes import start_kv_service
from kvmesh.contract.types import SamplingParams
from kvmesh.loopback import RedisServer, free_port
from kvmesh.make_model import CORPUS, train_tokenizer
from kvmesh.replay.records import percentile as pct
from kvmesh.router.config import RouterConfig
from kvmesh.router.generate_types import GenerateInput
from kvmesh.router.server import RouterServer
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

GOAL_P99_MS = 2.0
GOAL_TTFT_GAP_MS = 2.0
GOAL_HOPS = 4.0
"""Issues 35 and 45: the router's share of TTFT in bare grpc.aio hops, as a client of a `kvmesh up` stack sees it."""
GOAL_REDIS_US = 100.0
"""Issue 45: Redis's own time per Lookup (INFO commandstats, the transaction's EXEC)."""
ALGOS = {"sha256_128": pb.HASH_ALGORITHM_SHA256_128, "xxh3_128": pb.HASH_ALGORITHM_XXH3_128}


def prompts_of(tok, n_tokens: int, count: int) -> list[str]:
    """``count`` distinct texts of about ``n_tokens`` tokens (the corpus, rotated and repeated)."""
    words = CORPUS.read_text(encoding="utf-8").split()
    out = []
    for i in range(count):
        rot = words[(i * 37) % len(words):] + words[: (i * 37) % len(words)]
        text, reps = f"request {i}:", 0
        while len(tok.encode(text).ids) < n_tokens:
            text += " " + " ".join(rot)
            reps += 1
        ids = tok.encode(text).ids[:n_tokens]
        out.append(tok.decode(ids[1:], skip_special_tokens=True))
    return out


async def timed_decisions(router, router_server, spec, inputs: list[GenerateInput], iters: int) -> tuple[list, dict]:
    """On the router's loop: ``iters`` decisions end to end, then each stage alone (in ms)."""
    for inp in inputs * 2:  # warm up channels, tokenizer caches and the Lua script
        plan, _ = await router.decide(inp)
        if plan.ticket is not None:  # NOTE: never forwarded: its in-flight share (a reserved pick) goes
            router.core.finish(plan.ticket)
    total, stages = [], {"tokenize": [], "hash": [], "lookup": [], "pick": []}
    for k in range(iters):
        inp = inputs[k % len(inputs)]
        t0 = time.perf_counter()
        plan, decision = await router.decide(inp)
        total.append((time.perf_counter() - t0) * 1e3)
        if plan.ticket is not None:
            router.core.finish(plan.ticket)
        # The same stages again, one at a time, for the breakdown.
        t0 = time.perf_counter()
        ids = await router.tokenize(inp)
        t1 = time.perf_counter()
        chain = router.core.hasher(spec).hash_prompt(ids)
        t2 = time.perf_counter()
        await router_server.kv.lookup(spec.model_id, chain)
        t3 = time.perf_counter()
        router.policy.pick(plan.query, plan.candidates)
        t4 = time.perf_counter()
        for name, a, b in (("tokenize", t0, t1), ("hash", t1, t2), ("lookup", t2, t3), ("pick", t3, t4)):
            stages[name].append((b - a) * 1e3)
    return total, stages


def bench(router, router_server, spec, label: str, n_tokens: int, inputs: list[GenerateInput], iters: int) -> float:
    """Times ``iters`` decisions; prints p50/p99 and the stage breakdown; returns p99 in ms."""
    total, stages = router_server.run(timed_decisions(router, router_server, spec, inputs, iters))
    plan_blocks = n_tokens // spec.block_size
    p99 = pct(total, 99)
    print(f"{label:>6} {n_tokens:>6} {plan_blocks:>6} {statistics.median(total):>8.3f} {p99:>8.3f} | "
          f"{'':>13} " + " ".join(f"{statistics.median(stages[s]):>{w}.3f}"
                                    for s, w in (("tokenize", 8), ("hash", 6), ("lookup", 6), ("pick", 6))))
    return p99


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--iters", type=int, default=400, help="timed decisions per prompt size")
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts per size")
    ap.add_argument("--algorithm", default="sha256_128", choices=list(ALGOS))
    ap.add_argument("--ttft-pairs", type=int, default=200, help="routed/direct request pairs for TTFT")
    ap.add_argument("--ttft-tokens", type=int, default=4096, help="prompt length of the TTFT requests")
    ap.add_argument("--stack-workers", type=int, default=4, help="simulated workers of the TTFT stack (default 4)")
    ap.add_argument("--sim-time-scale", type=float, default=0.05,
                    help="the simulated workers' wall seconds per modelled second (default 0.05)")
    ap.add_argument("--redis-lookups", type=int, default=300, help="Lookups INFO commandstats is read around")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-")) / "bench-model"
    tmp.mkdir()
    tok = train_tokenizer()
    tok.save(str(tmp / "tokenizer.json"))

    with RedisServer() as redis:
        kv_proc, kv_address = start_kv_service("--redis-url", redis.url, "--namespace", "bench")
        stub = pb_grpc.KVServiceStub(dial(kv_address))
        for w in range(args.workers):
            stub.RegisterWorker(pb.RegisterWorkerRequest(
                worker_id=f"w{w}", address=f"127.0.0.1:{50061 + w}", model_id="bench-model", block_size=16,
                hash_algorithm=ALGOS[args.algorithm], num_blocks=1_000_000, epoch=1), timeout=5)
        router_server = RouterServer(RouterConfig(host="127.0.0.1", port=0, kv_service=kv_address,
                                                  model_dirs=[str(tmp)], hash_algorithm=args.algorithm))
        router_server.start()
        router = router_server.router
        spec = router.pool.model_spec()
        seqs = dict.fromkeys(range(args.workers), 0)
        print(f"router overhead: {args.workers} workers, {args.algorithm}, kv_service on Redis, "
              f"{args.iters} decisions per size")
        print(f"{'input':>6} {'prompt':>6} {'blocks':>6} {'p50 ms':>8} {'p99 ms':>8} | stage p50 ms: "
              f"{'tokenize':>8} {'hash':>6} {'lookup':>6} {'pick':>6}")
        worst_p99 = {"text": 0.0, "ids": 0.0}
        for n_tokens in (1024, 8192):
            texts = prompts_of(tok, n_tokens, args.prompts)
            for i, text in enumerate(texts):  # two holders per prompt: all of it, and half
                ids = router_server.run(router.tokenize(GenerateInput(text, None, SamplingParams())))
                chain = router.core.hasher(spec).hash_prompt(ids)
                for w, part in ((i % args.workers, chain), ((i + 1) % args.workers, chain[: len(chain) // 2])):
                    seqs[w] += 1
                    list(stub.PublishEvents(iter([pb.PublishEventsRequest(
                        worker_id=f"w{w}", epoch=1, seq=seqs[w],
                        events=[pb.KVEvent(stored=pb.BlockStored(block_hashes=part))])]), timeout=10))
            as_text = [GenerateInput(t, None, SamplingParams()) for t in texts]
            as_ids = [GenerateInput(None, router_server.run(router.tokenize(i)), SamplingParams()) for i in as_text]
            for label, inputs in (("text", as_text), ("ids", as_ids)):
                worst_p99[label] = max(worst_p99[label], bench(router, router_server, spec, label, n_tokens, inputs, args.iters))
        for label, p99 in worst_p99.items():
            verdict = "met" if p99 <= GOAL_P99_MS else "NOT met"
            print(f"goal p99 <= {GOAL_P99_MS} ms, {label} prompts: {verdict} (worst p99 {p99:.3f} ms)")
        router_server.stop(0.1)
        kv_proc.terminate()
        kv_proc.wait(10)
    stack_hop(args)
    return 0


def stack_hop(args: argparse.Namespace) -> tuple[float, float]:
    """The router's hop as a client sees it, and Redis's time per Lookup: (hops, µs). A `kvmesh up
    --simulate` stack on a fresh Redis (kvmesh/bench/hop.py)."""
    from kvmesh.bench.hop import lookup_redis_time, run_arms, spawn_router
    from kvmesh.contract.block_hash import BlockHasher
    from kvmesh.make_model import ensure_default_model
    from kvmesh.stack import LocalStack, StackConfig

    model = str(ensure_default_model())
    cfg = StackConfig(model=model, workers=args.stack_workers, router_port=free_port(), kv_service_port=free_port(),
                      worker_port=free_port(), metrics_port=0, simulate=True,
                      worker_args=["--sim-time-scale", str(args.sim_time_scale), "--max-model-len", "16384"],
                      router_args=["--max-prompt-tokens", "16000", "--log-level", "warning"],
                      log_dir=tempfile.mkdtemp(prefix="kvmesh-hop-"))
    stack = LocalStack(cfg).start()
    try:
        model_id = model_id_of(model)
        # Redis first, on the fresh index: a 250-block chain that one worker of the stack holds.
        rng = random.Random(3)
        ids = [rng.randrange(3, 500) for _ in range(250 * 16)]
        stub = router_pb2_grpc.RouterStub(dial(stack.endpoints["router"]))
        list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                      sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=60))
        time.sleep(1.0)  # its blocks reach the index
        chain = BlockHasher(model_id, 16, args.algorithm).hash_prompt(ids)
        per = lookup_redis_time(stack.endpoints["redis"], stack.endpoints["kv_service"], model_id, chain,
                                args.redis_lookups)
        workers = {f"worker-{i}": stack.endpoints[f"worker-{i}"] for i in range(args.stack_workers)}
        folded, folded_addr = spawn_router(stack.endpoints["kv_service"], model, "--fold-reserve")
        try:
            arms = run_arms({"router": (stack.endpoints["router"], workers), "--fold-reserve": (folded_addr, workers)},
                            args.ttft_pairs, tokens=args.ttft_tokens)
        finally:
            folded.terminate()
            folded.wait(10)
        arm = arms["router"]
    finally:
        stack.stop()
    print(f"Redis per Lookup (INFO commandstats, {args.redis_lookups} Lookups of a 250-block chain one worker of "
          f"{args.stack_workers} holds, fresh index): " + ", ".join(f"{k} {v:.1f} µs" for k, v in sorted(per.items())))
    exec_us = per.get("exec", per.get("evalsha", 0.0))
    verdict = "met" if exec_us <= GOAL_REDIS_US else "NOT met"
    print(f"goal Redis time per Lookup (EXEC total) <= {GOAL_REDIS_US:g} µs: {verdict} ({exec_us:.1f} µs)")
    print(f"TTFT, {args.ttft_tokens}-id prompts, {args.stack_workers} simulated workers (time scale "
          f"{args.sim_time_scale:g}), {args.ttft_pairs} pairs (through the router, then straight to the worker "
          "that served):")
    for a in arms.values():
        print("  " + a.line())
    verdict = "met" if arm.in_hops <= GOAL_HOPS else "NOT met"
    print(f"goal (TTFT via router - direct) / bare hop p50 <= {GOAL_HOPS:g}: {verdict} ({arm.in_hops:.2f} hops; "
          f"with the Reserve folded into the Lookup {arms['--fold-reserve'].in_hops:.2f})")
    return arm.in_hops, exec_us


def model_id_of(model: str) -> str:
    from kvmesh.contract.modelinfo import model_id_for

    return model_id_for(model, None)


if __name__ == "__main__":
    sys.exit(main())
