"""What a router's Reserve costs (issue 27): the round trip the simulator's --reserve-latency models.

Setup: a private redis-server, one `kvmesh kv-service` (defaults), W registered workers. One grpc.aio
client interleaves, call by call: a bare grpc.health Check, a Lookup of a 16-block chain and a
Reserve (unconditional, then one conditioned on the version the Lookup returned, as a router's
reservation is). Prints each one's p50/p99 in microseconds and Reserve ÷ Lookup. The pending picks are
retired by their TTL; nothing else runs in the kv_service meanwhile.

    python benchmarks/reserve_latency.py [--calls 3000] [--workers 8]
"""

from __future__ import annotations

import argparse
import os
import time

from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.bench.processes import start_kv_service
from kvmesh.loopback import RedisServer
from kvmesh.replay.records import percentile as pct
from kvmesh.transport.channels import dial, dial_aio
from kvmesh.transport.loop import new_event_loop
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc


async def measure(address: str, workers: list[str], n: int) -> dict[str, list[float]]:
    channel = dial_aio(address)
    health = health_pb2_grpc.HealthStub(channel)
    stub = pb_grpc.KVServiceStub(channel)
    chain = [os.urandom(16) for _ in range(16)]
    out: dict[str, list[float]] = {"health": [], "lookup": [], "reserve": [], "reserve_conditional": []}
    req = health_pb2.HealthCheckRequest()
    for k in range(n + 200):  # the first 200 warm up
        wid = workers[k % len(workers)]
        t0 = time.perf_counter()
        await health.Check(req, timeout=5)
        t1 = time.perf_counter()
        r = await stub.Lookup(pb.LookupRequest(model_id="bench", block_hashes=chain), timeout=5)
        t2 = time.perf_counter()
        await stub.Reserve(pb.ReserveRequest(model_id="bench", worker_id=wid, router_id="bench-a",
                                             request_id=f"a-{k}", prefill_tokens=1024, blocks=64), timeout=5)
        t3 = time.perf_counter()
        seen = next(m.pending.version for m in r.workers if m.worker_id == wid)
        ans = await stub.Reserve(pb.ReserveRequest(model_id="bench", worker_id=wid, router_id="bench-b",
                                                   request_id=f"b-{k}", prefill_tokens=1024, blocks=64,
                                                   seen_version=seen), timeout=5)
        t4 = time.perf_counter()
        assert not ans.reserved, "the version seen before the unconditional Reserve must be refused"
        if k >= 200:
            for key, dt in (("health", t1 - t0), ("lookup", t2 - t1), ("reserve", t3 - t2),
                            ("reserve_conditional", t4 - t3)):
                out[key].append(dt * 1e6)
    await channel.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000, help="timed calls of each kind (default 3000)")
    ap.add_argument("--workers", type=int, default=8, help="registered workers (default 8)")
    a = ap.parse_args()
    loop = new_event_loop()
    with RedisServer() as redis:
        kv_proc, address = start_kv_service("--redis-url", redis.url)
        try:
            stub = pb_grpc.KVServiceStub(dial(address))
            workers = [f"w{i:02d}" for i in range(a.workers)]
            for i, wid in enumerate(workers):
                stub.RegisterWorker(pb.RegisterWorkerRequest(
                    worker_id=wid, address=f"10.0.0.{i}:50061", model_id="bench", block_size=16,
                    hash_algorithm=pb.HASH_ALGORITHM_SHA256_128, num_blocks=4096, epoch=1), timeout=10)
            res = loop.run_until_complete(measure(address, workers, a.calls))
        finally:
            kv_proc.terminate()
            kv_proc.wait(10)
    print(f"{a.calls} calls each, {a.workers} workers, one grpc.aio client on loopback (load {os.getloadavg()[0]:.1f})")
    print(f"{'call':<22}{'p50 us':>9}{'p99 us':>9}")
    for key, xs in res.items():
        print(f"{key:<22}{pct(xs, 50):9.0f}{pct(xs, 99):9.0f}")
    for key in ("reserve", "reserve_conditional"):
        print(f"{key} / lookup: p50 {pct(res[key], 50) / pct(res['lookup'], 50):.2f}, "
              f"p99 {pct(res[key], 99) / pct(res['lookup'], 99):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
