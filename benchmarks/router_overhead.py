"""Router overhead: tokenize + hash + Lookup + pick, for 1k- and 8k-token prompts.

Setup: a private redis-server, a `kvmesh kv-service` process on it, W workers registered through
RegisterWorker (no worker process: the decision path never calls one), each prompt's block chain
published for two workers (one holds all of it, one half). The router is built exactly as
`kvmesh router` builds it (RouterServer) and ``Router.decide`` — the code every Generate runs
before forwarding — is timed, end to end and by stage, for text prompts and for prompts sent
as token ids (no tokenization: the router's own share).

    python benchmarks/router_overhead.py [--workers 16] [--iters 400] [--algorithm sha256_128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvmesh.bench.processes import start_kv_service
from kvmesh.bench.report import percentile
from kvmesh.contract.types import SamplingParams
from kvmesh.loopback import RedisServer
from kvmesh.make_model import CORPUS, train_tokenizer
from kvmesh.router.config import RouterConfig
from kvmesh.router.router import GenerateInput
from kvmesh.router.server import RouterServer
from kvmesh.transport.rpc import dial
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

GOAL_P99_MS = 2.0
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


def bench(router, router_server, spec, label: str, n_tokens: int, inputs: list[GenerateInput], iters: int) -> float:
    """Times ``iters`` decisions; prints p50/p99 and the stage breakdown; returns p99 in ms."""
    for inp in inputs * 2:  # warm up channels, tokenizer caches and the Lua script
        router.decide(inp)
    total, stages = [], {"tokenize": [], "hash": [], "lookup": [], "pick": []}
    for k in range(iters):
        inp = inputs[k % len(inputs)]
        t0 = time.perf_counter()
        plan, decision = router.decide(inp)
        total.append((time.perf_counter() - t0) * 1e3)
        # The same stages again, one at a time, for the breakdown.
        t0 = time.perf_counter()
        ids = router.tokenize(inp)
        t1 = time.perf_counter()
        chain = router.hasher(spec).hash_prompt(ids)
        t2 = time.perf_counter()
        router_server.kv.lookup(spec.model_id, chain)
        t3 = time.perf_counter()
        router.policy.pick(plan.query, plan.candidates)
        t4 = time.perf_counter()
        for name, a, b in (("tokenize", t0, t1), ("hash", t1, t2), ("lookup", t2, t3), ("pick", t3, t4)):
            stages[name].append((b - a) * 1e3)
    p99 = percentile(total, 99)
    print(f"{label:>6} {n_tokens:>6} {len(plan.query.block_hashes):>6} {statistics.median(total):>8.3f} {p99:>8.3f} | "
          f"{'':>13} " + " ".join(f"{statistics.median(stages[s]):>{w}.3f}"
                                    for s, w in (("tokenize", 8), ("hash", 6), ("lookup", 6), ("pick", 6))))
    return p99


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--iters", type=int, default=400, help="timed decisions per prompt size")
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts per size")
    ap.add_argument("--algorithm", default="sha256_128", choices=list(ALGOS))
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
                                                  model_dir=str(tmp), hash_algorithm=args.algorithm))
        router_server.pool.refresh()
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
                chain = router.hasher(spec).hash_prompt(router.tokenize(GenerateInput(text, None, SamplingParams())))
                for w, part in ((i % args.workers, chain), ((i + 1) % args.workers, chain[: len(chain) // 2])):
                    seqs[w] += 1
                    list(stub.PublishEvents(iter([pb.PublishEventsRequest(
                        worker_id=f"w{w}", epoch=1, seq=seqs[w],
                        events=[pb.KVEvent(stored=pb.BlockStored(block_hashes=part))])]), timeout=10))
            as_text = [GenerateInput(t, None, SamplingParams()) for t in texts]
            as_ids = [GenerateInput(None, router.tokenize(i), SamplingParams()) for i in as_text]
            for label, inputs in (("text", as_text), ("ids", as_ids)):
                worst_p99[label] = max(worst_p99[label], bench(router, router_server, spec, label, n_tokens, inputs, args.iters))
        for label, p99 in worst_p99.items():
            verdict = "met" if p99 <= GOAL_P99_MS else "NOT met"
            print(f"goal p99 <= {GOAL_P99_MS} ms, {label} prompts: {verdict} (worst p99 {p99:.3f} ms)")
        router_server.stop(0.1)
        kv_proc.terminate()
        kv_proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
