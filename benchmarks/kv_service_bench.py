"""kv_service benchmark: Lookup latency vs a raw Redis round trip, and event ingest rate.

Setup: a private redis-server, one `kvmesh kv-service` process, W registered workers holding N
blocks in total in 64-block chains. Two lookup workloads: `unique` chains held by one worker,
and `shared` chains that start with a 16-block system prompt every worker holds (the worst case
for the lookup walk: all W workers stay candidates for 16 blocks). Then, in one run:

- redis_rtt: PING round trips from this process (redis-py + hiredis);
- store lookup: RedisIndex.lookup, the kv_service's one EVALSHA round trip (Lua walk + reply);
- grpc Lookup: client -> kv_service -> Redis -> client, vs a bare gRPC health Check;
- ingest: BlockStored events in batches over PublishEvents streams, blocks/s.

    python benchmarks/kv_service_bench.py [--blocks 1000000] [--workers 64] [--store both]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.bench.processes import start_kv_service
from kvmesh.bench.report import percentile
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import RedisServer
from kvmesh.transport.rpc import dial
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

SYSTEM_PROMPT_BLOCKS = 16




def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out




def populate(stub, workers: int, blocks: int, chain: int, batch: int, threads: int) -> tuple[float, dict]:
    """Registers workers and streams their blocks; returns (blocks/s, chains by worker)."""
    system = [os.urandom(16) for _ in range(SYSTEM_PROMPT_BLOCKS)]
    per_worker = blocks // workers
    chains: dict[str, list[list[bytes]]] = {}
    for w in range(workers):
        wid = f"w{w:03d}"
        stub.RegisterWorker(pb.RegisterWorkerRequest(
            worker_id=wid, address=f"10.0.0.{w}:50061", model_id="bench", block_size=16,
            hash_algorithm=pb.HASH_ALGORITHM_SHA256_128, num_blocks=per_worker + chain, epoch=1), timeout=10)
        n_chains = max(2, (per_worker - SYSTEM_PROMPT_BLOCKS) // chain)
        tails = chain - SYSTEM_PROMPT_BLOCKS
        chains[wid] = [system + [os.urandom(16) for _ in range(tails)] if k % 2 else
                       [os.urandom(16) for _ in range(chain)] for k in range(n_chains)]

    def batches(wid: str):
        flat = [h for c in chains[wid] for h in (c[SYSTEM_PROMPT_BLOCKS:] if c[0] == system[0] else c)]
        seq = 1
        yield pb.PublishEventsRequest(worker_id=wid, epoch=1, seq=seq, events=[
            pb.KVEvent(stored=pb.BlockStored(block_hashes=system))])
        for i in range(0, len(flat), batch):
            seq += 1
            yield pb.PublishEventsRequest(worker_id=wid, epoch=1, seq=seq, events=[
                pb.KVEvent(stored=pb.BlockStored(block_hashes=flat[i:i + batch]))])

    msgs = {wid: list(batches(wid)) for wid in chains}  # built before the clock starts
    total = sum(len(e.stored.block_hashes) for m in msgs.values() for r in m for e in r.events)
    ids = sorted(msgs)

    def run(part: list[str]) -> None:
        for wid in part:
            for ack in stub.PublishEvents(iter(msgs[wid]), timeout=600):
                assert ack.action == pb.PUBLISH_ACTION_ACK, ack

    t0 = time.perf_counter()
    ts = [threading.Thread(target=run, args=(ids[i::threads],)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total / (time.perf_counter() - t0), chains


def bench_store(name: str, kv_args: list[str], a, redis_url: str | None) -> dict:
    proc, address = start_kv_service(*kv_args)
    try:
        channel = dial(address)
        stub = pb_grpc.KVServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        rate, chains = populate(stub, a.workers, a.blocks, a.chain, a.batch, a.threads)
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=30)
        out = {"store": name, "ingest_blocks_per_s": rate, "indexed_blocks": stats.indexed_blocks,
               "block_replicas": stats.block_replicas}
        out["grpc_health"] = timed(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5), a.lookups)
        index = RedisIndex(redis_url) if redis_url else None
        for workload in ("unique", "shared"):
            queries = [c for cs in chains.values() for c in cs if (c[0] == cs[1][0]) == (workload == "shared")][:256]
            cycle = itertools.cycle(queries)
            next_chain = cycle.__next__

            def grpc_lookup(next_chain=next_chain) -> None:
                r = stub.Lookup(pb.LookupRequest(model_id="bench", block_hashes=next_chain()), timeout=5)
                assert r.workers[0].matched_blocks == a.chain and len(r.workers) == a.workers

            timed(grpc_lookup, 200)
            out[f"grpc_lookup_{workload}"] = timed(grpc_lookup, a.lookups)
            if index is not None:
                def store_lookup(now: int = int(time.time() * 1000), next_chain=next_chain) -> None:
                    m = index.lookup("bench", next_chain(), now)
                    assert len(m) == a.workers

                timed(store_lookup, 200)
                timed(index._r.ping, 200)
                # Interleaved so both see the same machine state.
                rtt, look = [], []
                for _ in range(a.lookups):
                    rtt += timed(index._r.ping, 1)
                    look += timed(store_lookup, 1)
                out[f"redis_rtt_{workload}"], out[f"store_lookup_{workload}"] = rtt, look
        if index is not None:
            index.close()
        channel.close()
        return out
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks indexed in total (default 1M)")
    ap.add_argument("--workers", type=int, default=64, help="registered workers (default 64)")
    ap.add_argument("--chain", type=int, default=64, help="blocks per lookup chain (default 64)")
    ap.add_argument("--batch", type=int, default=512, help="blocks per published batch (default 512)")
    ap.add_argument("--threads", type=int, default=4, help="concurrent publishing streams (default 4)")
    ap.add_argument("--lookups", type=int, default=3000, help="timed lookups per measure (default 3000)")
    ap.add_argument("--store", choices=["redis", "memory", "both"], default="both")
    a = ap.parse_args()

    results = []
    with RedisServer() as redis:
        if a.store in ("redis", "both"):
            results.append(bench_store("redis", ["--redis-url", redis.url], a, redis.url))
        if a.store in ("memory", "both"):
            results.append(bench_store("memory", ["--store", "memory"], a, None))

    print(f"\nkv_service benchmark: {a.workers} workers, {a.chain}-block chains, batches of {a.batch} blocks, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    for r in results:
        print(f"\n[{r['store']}] indexed blocks {r['indexed_blocks']:,} (replicas {r['block_replicas']:,})")
        print(f"  ingest: {r['ingest_blocks_per_s']:,.0f} blocks/s  (goal >= 200,000/s)")
        line = "  {:<34} p50 {:8.1f} us   p99 {:8.1f} us"
        print(line.format("grpc health Check", statistics.median(r["grpc_health"]), percentile(r["grpc_health"], 99)))
        for w in ("unique", "shared"):
            rows = [(f"grpc Lookup [{w}]", r[f"grpc_lookup_{w}"])]
            if f"redis_rtt_{w}" in r:
                rows += [(f"redis PING rtt [{w}]", r[f"redis_rtt_{w}"]),
                         (f"store lookup, 1 EVALSHA [{w}]", r[f"store_lookup_{w}"])]
            for label, xs in rows:
                print(line.format(label, statistics.median(xs), percentile(xs, 99)))
            if f"redis_rtt_{w}" in r:
                ratio = percentile(r[f"store_lookup_{w}"], 99) / percentile(r[f"redis_rtt_{w}"], 99)
                print(f"  [{w}] lookup_p99 / redis_rtt_p99 = {ratio:.2f}  (goal <= 1.5)")
            g = percentile(r[f"grpc_lookup_{w}"], 99) / percentile(r["grpc_health"], 99)
            print(f"  [{w}] grpc_lookup_p99 / grpc_health_p99 = {g:.2f}  (service cost over a bare gRPC hop)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
