"""The host KV tier across a live CPU mesh: prefix hit rate with the tier on ÷ off, and whether the
index agrees with the workers' pools (both tiers) after the run (issue 36, phase 2).

One stack per setting, in this process: kv_service (on a private redis-server, or in memory without
one), 2 real CPU workers of the demo model with a small device pool (``--num-blocks``), with a host
tier of ``--host-kv-blocks`` or none, and a kv-aware router. The load is vLLM's prefix-repetition
(``kvmesh bench serve --dataset prefix-repetition``): ``--num-prefixes`` prefixes whose blocks exceed
both workers' device pools together, each request one of them plus a suffix of its own. Without the
tier a prefix the device evicted is recomputed; with it, its holder loads it back (the router sends
it there: kv-aware prices the load against the prefill).

After each run, once the workers are idle and their last events are in, the index's blocks per
worker and tier are compared with the workers' own pools: agreement = |index ∩ pool| / |index ∪ pool|
over every (worker, tier, block) (goal 1.000).

Run: .venv/bin/python benchmarks/host_tier_mesh.py [--requests 256] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from kvmesh.bench import serve
from kvmesh.bench.datasets import TokenRange, prefix_repetition_dataset
from kvmesh.bench.report import summarize
from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import RedisServer, free_port
from kvmesh.make_model import ensure_default_model
from kvmesh.model_worker.config import ModelConfig
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.serving.server import WorkerServer
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.server import RouterServer
from kvmesh.stack import wait_serving
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc


def agreement(kv_addr: str, workers: list[WorkerServer]) -> dict:
    """The index's (worker, tier, block) entries against the workers' pools."""
    stub = kpb_grpc.KVServiceStub(dial(kv_addr))
    pools = {(w.worker_id, tier): hashes for w in workers
             for tier, hashes in (("device", w.engine.cached_block_hashes()), ("host", w.engine.host_block_hashes()))}
    blocks = set().union(*pools.values())
    index: dict[tuple[str, str], set[bytes]] = {key: set() for key in pools}
    for h in blocks:
        r = stub.GetBlock(kpb.GetBlockRequest(block_hash=h), timeout=5)
        for wid in r.holders:
            index.setdefault((wid, "device"), set()).add(h)
        for wid in r.host_holders:
            index.setdefault((wid, "host"), set()).add(h)
    info = {i.worker_id: i for i in stub.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers}
    both = sum(len(pools[k] & index[k]) for k in pools)
    either = sum(len(pools[k] | index[k]) for k in pools)
    # NOTE: the index may hold blocks no pool holds (a removal lost): its own counts show those
    extra = sum(info[w.worker_id].blocks_indexed + info[w.worker_id].host_blocks_indexed for w in workers) - both
    return {"agreement": both / either if either else 1.0, "entries": either, "index_only": extra,
            "pool_blocks": {f"{w}/{t}": len(v) for (w, t), v in pools.items()}}


def run(args: argparse.Namespace, host_blocks: int, redis_url: str | None) -> dict:
    model = str(ensure_default_model())
    vocab = ModelConfig.from_dir(model).vocab_size
    index = RedisIndex(redis_url, f"tiermesh{host_blocks}") if redis_url else MemoryIndex()
    kv = KVServiceServer(index, "127.0.0.1", free_port(), ServiceConfig(lease_ttl_ms=3000)).start()
    kv_addr = f"127.0.0.1:{kv.port}"
    workers: list[WorkerServer] = []
    router: RouterServer | None = None
    try:
        for i in range(2):
            engine = LLMEngine(model=model, num_blocks=args.num_blocks, max_num_batched_tokens=512,
                               max_model_len=args.prefix_len + args.suffix_len + args.output_len + 16,
                               host_kv_blocks=host_blocks or None)
            workers.append(WorkerServer(engine, f"worker-{i}", "127.0.0.1", free_port(), kv_addr)
                           .start(wait_registered=10))
        router = RouterServer(RouterConfig(host="127.0.0.1", port=free_port(), kv_service=kv_addr,
                                           model_dirs=[model], routing=RoutingConfig(policy="kv-aware"))).start()
        target = f"127.0.0.1:{router.port}"
        wait_serving(target, timeout=30)
        tokens = TokenRange.for_vocab(vocab)
        reqs = prefix_repetition_dataset(args.requests, args.prefix_len, args.suffix_len, args.num_prefixes,
                                         args.output_len, seed=args.seed, tokens=tokens)
        records, duration = serve.run(target, reqs, max_concurrency=args.concurrency, ignore_eos=True,
                                      progress=args.progress)
        s = summarize(records, duration, workers=[w.worker_id for w in workers])
        deadline = time.monotonic() + 30
        while any(w.engine.has_unfinished_requests() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # NOTE: the last event messages (20 ms slots) and their acks
        agree = agreement(kv_addr, workers)
        # NOTE: blocks actually loaded back (the engines' host_cache_hits count a hit again at every
        # admission attempt of a request that waited for room)
        host_hits = sum(w.engine.stats().host_loaded_blocks for w in workers) * 16
        prompt = sum(r.prompt_len for r in records if r.success)
        return {"host_kv_blocks": host_blocks, "hit_rate": s["prefix_hit_rate"],
                "loaded_rate": host_hits / prompt if prompt else 0.0, "completed": s["completed"],
                "failed": s["failed"], "ttft_mean_ms": s["ttft_ms"]["mean"], "req_s": s["request_throughput"],
                "index": agree}
    finally:
        if router is not None:
            router.stop(0.5)
        for w in workers:
            w.stop(0.5)
        kv.stop(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=384, help="tokens per prefix (24 blocks of 16)")
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=64, help="device blocks per worker")
    ap.add_argument("--host-kv-blocks", type=int, default=512, help="host-tier blocks per worker (the 'on' run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    need = args.num_prefixes * (args.prefix_len // 16)
    print(f"prefix-repetition: {args.num_prefixes} prefixes x {args.prefix_len} tokens ({need} blocks) + "
          f"{args.suffix_len}, {args.requests} requests, {args.concurrency} in flight; 2 CPU workers of "
          f"{args.num_blocks} device blocks ({2 * (args.num_blocks - 1)} usable together)")
    redis: RedisServer | None = RedisServer() if shutil.which("redis-server") else None
    try:
        out = {"settings": vars(args), "store": "redis" if redis else "memory"}
        for name, blocks in (("off", 0), ("on", args.host_kv_blocks)):
            out[name] = r = run(args, blocks, redis.url if redis else None)
            print(f"host tier {name:<3} ({blocks:>4} blocks): hit rate {r['hit_rate']:.4f} (loaded from host {r['loaded_rate']:.4f}), "
                  f"TTFT mean {r['ttft_mean_ms']:.0f} ms, {r['req_s']:.1f} req/s, failed {r['failed']}; "
                  f"index agreement {r['index']['agreement']:.4f} over {r['index']['entries']} entries", flush=True)
        out["hit_rate_on_over_off"] = out["on"]["hit_rate"] / out["off"]["hit_rate"] if out["off"]["hit_rate"] else None
        print(f"hit rate on / off: {out['hit_rate_on_over_off']:.3f} (goal >= 1.5)")
    finally:
        if redis is not None:
            redis.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(out[k]["failed"] == 0 for k in ("on", "off")) else 1


if __name__ == "__main__":
    sys.exit(main())
