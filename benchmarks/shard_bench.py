"""The sharded index against one node, side by side in one run: ingest and Lookup latency of one
model's index on one redis-server (1 shard, today's default) and on a 3-master Redis Cluster
(--shards 3), same data, same client load.

1. ingest: the same event messages (64 blocks each: half new blocks stored, half of the
   previous message's removed, as a worker with a full cache sends) from W workers, streamed by
   P client processes (the kv_service's store, RedisIndex, one coroutine per worker, as the
   kv_service runs one per PublishEvents stream): blocks/s, and Redis CPU-s per block (INFO cpu
   used_cpu_user + used_cpu_sys of every master, before and after). Where the machine has a core
   for every Redis node and two more, each node is pinned to its own core (taskset); with fewer
   cores the nodes share them and Redis CPU per block is the comparable figure.
2. store Lookup: RedisIndex.lookup (the kv_service's call: one round to every shard) on both,
   interleaved call by call from one client: p50 and p99.
3. gRPC Lookup: a `kvmesh kv-service` per setup (--shards 1 on the one node, --shards 3 on the
   cluster), Lookups interleaved call by call from one grpc.aio client: p50 and p99.
4. Lookup throughput per shard count and replica count: one model of --tp-workers workers whose
   Lookups are the traces' 12-15k-token prompts (859-block chains, 8 workers holding 389-396
   blocks of each), on one node (1 shard), on the cluster's masters (--shards 3) and on its
   replicas (--shards 3 --read-replicas, a cluster with --replicas per master). --tp-clients
   client processes of --tp-concurrency callers each (RedisIndex.lookup, the kv_service's call)
   for --tp-seconds: Lookups/s, and each node's Redis CPU (INFO cpu) per Lookup; from those, the
   Lookups/s one model gets at a whole core per node, the capacity the sizing rule counts
   (a node at a core = Lookups/s measured / the busiest node's share of a core).

    python benchmarks/shard_bench.py [--workers 96] [--messages 400] [--clients 2] [--lookups 3000] [--json OUT]
    python benchmarks/shard_bench.py --only throughput [--replicas 1] [--tp-workers 128] [--tp-seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis

from kvmesh.bench.processes import start_kv_service
from kvmesh.contract.index_protocol import Registration
from kvmesh.contract.types import BlockRemoved, BlockStored, Load
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import RedisCluster, RedisServer
from kvmesh.replay.records import percentile as pct
from kvmesh.transport.channels import dial_aio
from kvmesh.transport.loop import new_event_loop
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

NAMESPACE = "bench"
PER_MESSAGE = 64
TTL = 3_600_000


def redis_cpu(urls: list[str]) -> list[float]:
    """used_cpu_user + used_cpu_sys of each node."""
    out = []
    for url in urls:
        info = redis.Redis.from_url(url).info("cpu")
        out.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    return out


# -- 1. ingest: a client process ----------------------------------------------------------------
async def client_main(url: str, shards: int, first: int, count: int, messages: int) -> dict:
    idx = RedisIndex(url, NAMESPACE, shards=shards, max_connections=64)
    now = int(time.time() * 1000)
    wids = [f"ingest-{w:04d}" for w in range(first, first + count)]
    for w in wids:
        await idx.register_worker(Registration(w, "10.0.0.1:50061", "ingest", 16, "sha256_128", 1_000_000, 1), TTL, now)
    half = PER_MESSAGE // 2
    plans = {}
    for w in wids:  # built before the clock starts: the sender stays cheap
        fresh = [os.urandom(16) for _ in range(half * messages)]
        plans[w] = [[BlockStored(fresh[k * half:(k + 1) * half])] +
                    ([BlockRemoved(fresh[(k - 1) * half:k * half])] if k else []) for k in range(messages)]
    print("ready", flush=True)
    sys.stdin.readline()  # the parent's "go"
    t0 = time.perf_counter()

    async def stream(w: str) -> int:
        n = 0
        for seq, events in enumerate(plans[w], 1):
            await idx.publish(w, 1, seq, events, now, Load(num_running=seq % 5))
            n += sum(len(e.block_hashes) for e in events)
        return n

    blocks = sum(await asyncio.gather(*(stream(w) for w in wids)))
    elapsed = time.perf_counter() - t0
    await idx.close()
    return {"blocks": blocks, "elapsed_s": elapsed}


def ingest(url: str, masters: list[str], shards: int, a: argparse.Namespace) -> dict:
    per = a.workers // a.clients
    procs = [subprocess.Popen([sys.executable, __file__, "--client", url, str(shards), str(k * per), str(per),
                               str(a.messages)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for k in range(a.clients)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    cpu0 = redis_cpu(masters)
    t0 = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    wall = time.perf_counter() - t0
    cpu = [b - a for a, b in zip(cpu0, redis_cpu(masters), strict=True)]
    blocks = sum(r["blocks"] for r in results)
    return {"blocks": blocks, "wall_s": wall, "blocks_per_s": blocks / wall, "redis_cpu_s": sum(cpu),
            "redis_cpu_us_per_block": 1e6 * sum(cpu) / blocks, "cpu_by_node": cpu}


# -- 4. Lookup throughput: a client process ------------------------------------------------------
async def lookup_client_main(url: str, shards: int, read_replicas: bool, concurrency: int, seconds: float,
                             queries_file: str) -> dict:
    idx = RedisIndex(url, NAMESPACE + "-tp", shards=shards, read_replicas=read_replicas)
    queries = json.loads(Path(queries_file).read_text())
    queries = [[bytes.fromhex(h) for h in q] for q in queries]
    now = int(time.time() * 1000)
    if read_replicas:  # NOTE: until the first check, the masters answer: check before the clock starts
        await idx.lookup("tp", queries[0], now)
        await idx.redis.check_replicas()
    for q in queries[:8]:
        await idx.lookup("tp", q, now)
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    done = 0

    async def caller(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() - t0 < seconds:
            await idx.lookup("tp", queries[i % len(queries)], now)
            i += concurrency
            done += 1

    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    elapsed = time.perf_counter() - t0
    replica_reads = idx.redis.replica_lookups
    await idx.close()
    return {"lookups": done, "elapsed_s": elapsed, "replica_reads": replica_reads}


async def populate_tp(idx: RedisIndex, workers: int, chains: list[list[bytes]]) -> None:
    """``workers`` workers of model "tp"; chain q is held by 8 of them, its first 389-396 blocks."""
    now = int(time.time() * 1000)
    held: dict[int, list[bytes]] = {}
    for q, c in enumerate(chains):
        for j in range(8):
            held.setdefault((q * 8 + j * 17) % workers, []).extend(c[:396 - j])
    for w in range(workers):
        wid = f"tp{w:04d}"
        await idx.register_worker(Registration(wid, f"10.0.{w // 256}.{w % 256}:50061", "tp", 16, "sha256_128",
                                               1_000_000, 1), TTL, now)
        blocks = list(dict.fromkeys(held.get(w, [])))
        await idx.publish(wid, 1, 1, [BlockStored(blocks)] if blocks else [], now,
                          Load(num_running=w % 5, num_free_blocks=1000, num_total_blocks=27_648))


def throughput(label: str, url: str, nodes: dict[str, str], shards: int, read_replicas: bool,
               queries_file: str, a: argparse.Namespace) -> dict:
    procs = [subprocess.Popen([sys.executable, __file__, "--lookup-client", url, str(shards), str(int(read_replicas)),
                               str(a.tp_concurrency), str(a.tp_seconds), queries_file],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(a.tp_clients)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    cpu0 = dict(zip(nodes, redis_cpu(list(nodes.values())), strict=True))
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    cpu = {n: c1 - cpu0[n] for n, c1 in zip(nodes, redis_cpu(list(nodes.values())), strict=True)}
    lookups = sum(r["lookups"] for r in results)
    per_s = lookups / max(r["elapsed_s"] for r in results)
    busiest = max(cpu.values()) / max(r["elapsed_s"] for r in results)  # share of a core
    row = {"config": label, "lookups": lookups, "lookups_per_s": per_s,
           "cpu_us_per_lookup": {n: 1e6 * c / lookups for n, c in cpu.items()},
           "busiest_node_core_share": busiest, "lookups_per_s_at_a_core_per_node": per_s / busiest,
           "replica_reads": sum(r["replica_reads"] for r in results)}
    return row


def run_throughput(a: argparse.Namespace) -> list[dict]:
    import tempfile

    chains = [[os.urandom(16) for _ in range(859)] for _ in range(a.tp_chains)]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[h.hex() for h in c] for c in chains], f)
        queries_file = f.name
    rows = []
    loop = new_event_loop()
    with RedisServer() as one:
        idx = RedisIndex(one.url, NAMESPACE + "-tp")
        loop.run_until_complete(populate_tp(idx, a.tp_workers, chains))
        loop.run_until_complete(idx.close())
        rows.append(throughput("1 node", one.url, {"node": one.url}, 1, False, queries_file, a))
    with RedisCluster(masters=a.shards, replicas=a.replicas) as cluster:
        masters = cluster.master_ports()
        nodes = {(f"master {masters.index(p)}" if p in masters else f"replica :{p}"): f"redis://127.0.0.1:{p}/0"
                 for p in cluster.ports}
        idx = RedisIndex(cluster.url, NAMESPACE + "-tp", shards=a.shards)
        loop.run_until_complete(populate_tp(idx, a.tp_workers, chains))
        loop.run_until_complete(idx.close())
        rows.append(throughput(f"{a.shards} masters (--shards {a.shards})", cluster.url, nodes, a.shards, False,
                               queries_file, a))
        if a.replicas:
            time.sleep(1.0)  # NOTE: replicated long since (loopback); the clients check before they start
            rows.append(throughput(f"{a.shards} masters + {a.shards * a.replicas} replicas (--read-replicas)",
                                   cluster.url, nodes, a.shards, True, queries_file, a))
    os.unlink(queries_file)
    return rows


def print_throughput(rows: list[dict], a: argparse.Namespace) -> None:
    print(f"4. Lookup throughput: {a.tp_workers} workers, 859-block chains (8 holders of 389-396 blocks each), "
          f"{a.tp_clients} client processes x {a.tp_concurrency} callers, {a.tp_seconds:g} s each")
    for r in rows:
        cpu = ", ".join(f"{n} {v:.0f}" for n, v in r["cpu_us_per_lookup"].items())
        print(f"   {r['config']}: {r['lookups_per_s']:,.0f} Lookups/s measured; Redis CPU-us per Lookup by node: {cpu}; "
              f"busiest node at {r['busiest_node_core_share']:.0%} of a core -> "
              f"{r['lookups_per_s_at_a_core_per_node']:,.0f} Lookups/s at a core per node"
              + (f" ({r['replica_reads']:,} shard reads on replicas)" if r["replica_reads"] else ""))


# -- 2., 3. lookups -------------------------------------------------------------------------------
def chains_of(workers: int, per_worker: int) -> dict[str, list[list[bytes]]]:
    system = [os.urandom(16) for _ in range(16)]
    return {f"w{w:03d}": [system + [os.urandom(16) for _ in range(48)] if k % 2 else
                          [os.urandom(16) for _ in range(64)] for k in range(per_worker)] for w in range(workers)}


async def populate(idx: RedisIndex, chains: dict[str, list[list[bytes]]]) -> None:
    now = int(time.time() * 1000)
    for k, (w, cs) in enumerate(chains.items()):
        await idx.register_worker(Registration(w, f"10.0.0.{k}:50061", "bench", 16, "sha256_128", 1_000_000, 1), TTL, now)
        flat = list(dict.fromkeys(h for c in cs for h in c))
        for seq, i in enumerate(range(0, len(flat), 512), 1):
            await idx.publish(w, 1, seq, [BlockStored(flat[i:i + 512])], now)


async def store_lookups(one: RedisIndex, many: RedisIndex, queries: list[list[bytes]], n: int,
                        workers: int) -> tuple[list[float], list[float]]:
    cycle = itertools.cycle(queries)
    a, b = [], []
    for k in range(n + 200):  # the first 200 warm up
        q, now = next(cycle), int(time.time() * 1000)
        pair = ((one, a), (many, b)) if k % 2 else ((many, b), (one, a))  # NOTE: alternate who goes first
        for idx, out in pair:
            t0 = time.perf_counter()
            got = await idx.lookup("bench", q, now)
            dt = (time.perf_counter() - t0) * 1e6
            assert len(got) == workers
            if k >= 200:
                out.append(dt)
    return a, b


async def grpc_lookups(addr_one: str, addr_many: str, queries: list[list[bytes]], n: int,
                       workers: int) -> tuple[list[float], list[float]]:
    ch1, ch3 = dial_aio(addr_one), dial_aio(addr_many)
    s1, s3 = pb_grpc.KVServiceStub(ch1), pb_grpc.KVServiceStub(ch3)
    cycle = itertools.cycle(queries)
    a, b = [], []
    for k in range(n + 200):
        req = pb.LookupRequest(model_id="bench", block_hashes=next(cycle))
        pair = ((s1, a), (s3, b)) if k % 2 else ((s3, b), (s1, a))
        for stub, out in pair:
            t0 = time.perf_counter()
            r = await stub.Lookup(req, timeout=5)
            dt = (time.perf_counter() - t0) * 1e6
            assert len(r.workers) == workers
            if k >= 200:
                out.append(dt)
    await ch1.close()
    await ch3.close()
    return a, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=3, help="cluster masters = shards (default 3)")
    ap.add_argument("--workers", type=int, default=96, help="publishing workers in 1. (default 96)")
    ap.add_argument("--messages", type=int, default=400, help="event messages per worker in 1. (default 400)")
    ap.add_argument("--clients", type=int, default=2, help="client processes in 1. (default 2)")
    ap.add_argument("--lookup-workers", type=int, default=64, help="workers of the model in 2., 3. (default 64)")
    ap.add_argument("--chains", type=int, default=40, help="64-block chains per worker in 2., 3. (default 40)")
    ap.add_argument("--lookups", type=int, default=3000, help="timed lookups per setup and measure (default 3000)")
    ap.add_argument("--pin", choices=["auto", "no"], default="auto",
                    help="auto: pin each Redis node to its own core when there are shards + 2 cores or more")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--only", choices=["all", "sharding", "throughput"], default="all",
                    help="sharding: 1.-3.; throughput: 4. (default all)")
    ap.add_argument("--replicas", type=int, default=1, help="replicas per master in 4. (default 1)")
    ap.add_argument("--tp-workers", type=int, default=128, help="workers of the model in 4. (default 128)")
    ap.add_argument("--tp-chains", type=int, default=16, help="distinct 859-block chains asked in 4. (default 16)")
    ap.add_argument("--tp-clients", type=int, default=2, help="client processes in 4. (default 2)")
    ap.add_argument("--tp-concurrency", type=int, default=16, help="callers per client process in 4. (default 16)")
    ap.add_argument("--tp-seconds", type=float, default=10.0, help="seconds per configuration in 4. (default 10)")
    ap.add_argument("--client", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--lookup-client", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.client:
        url, shards, first, count, messages = a.client
        print(json.dumps(asyncio.run(client_main(url, int(shards), int(first), int(count), int(messages)))))
        return 0
    if a.lookup_client:
        url, shards, rr, conc, secs, qfile = a.lookup_client
        print(json.dumps(asyncio.run(lookup_client_main(url, int(shards), rr == "1", int(conc), float(secs), qfile))))
        return 0
    if a.only == "throughput":
        rows = run_throughput(a)
        print(f"\nshard benchmark {time.strftime('%Y-%m-%d %H:%M')}: {len(os.sched_getaffinity(0))} CPUs, "
              f"Python {sys.version.split()[0]}, Redis not pinned")
        print_throughput(rows, a)
        if a.json:
            Path(a.json).write_text(json.dumps({"throughput": rows}, indent=1))
        return 0

    cpus = sorted(os.sched_getaffinity(0))
    pin = a.pin == "auto" and len(cpus) >= a.shards + 2
    # NOTE: pinned: the one node on the first free core, cluster masters one core each (the last
    # ones); the clients and kv_service processes keep the rest
    single_cpu = [cpus[-1]] if pin else []
    cluster_cpus = cpus[-a.shards:] if pin else []
    with RedisServer(extra_args=()) as one, RedisCluster(masters=a.shards, cpus=cluster_cpus) as cluster:
        if pin:
            subprocess.run(["taskset", "-pc", str(single_cpu[0]), str(one.proc.pid)], check=True, capture_output=True)
        masters = [f"redis://127.0.0.1:{p}/0" for p in cluster.master_ports()]
        # 1. ingest: a short warm-up of each (scripts loaded, Redis' memory grown), then 1, N, 1, N
        # shards (the host drifts: each setup's figure is the mean of its two runs)
        warm = argparse.Namespace(**{**vars(a), "messages": 20})
        ingest(one.url, [one.url], 1, warm)
        ingest(cluster.url, masters, a.shards, warm)
        runs1, runsn = [], []
        for _ in range(2):
            runs1.append(ingest(one.url, [one.url], 1, a))
            runsn.append(ingest(cluster.url, masters, a.shards, a))
        ing1, ingn = ({k: statistics.mean(r[k] for r in rs) for k in ("blocks_per_s", "redis_cpu_us_per_block")}
                      for rs in (runs1, runsn))
        ingn["cpu_by_node"] = [sum(c) for c in zip(*(r["cpu_by_node"] for r in runsn), strict=True)]

        # 2., 3. lookups
        chains = chains_of(a.lookup_workers, a.chains)
        queries = [c for cs in chains.values() for c in cs][::7][:512]
        loop = new_event_loop()
        idx1 = RedisIndex(one.url, NAMESPACE + "-lk", shards=1)
        idxn = RedisIndex(cluster.url, NAMESPACE + "-lk", shards=a.shards)
        loop.run_until_complete(populate(idx1, chains))
        loop.run_until_complete(populate(idxn, chains))
        s1, sn = loop.run_until_complete(store_lookups(idx1, idxn, queries, a.lookups, a.lookup_workers))
        loop.run_until_complete(idx1.close())
        loop.run_until_complete(idxn.close())
        kv1, addr1 = start_kv_service("--redis-url", one.url, "--namespace", NAMESPACE + "-lk")
        kvn, addrn = start_kv_service("--redis-url", cluster.url, "--namespace", NAMESPACE + "-lk", "--shards",
                                      str(a.shards))
        try:
            g1, gn = loop.run_until_complete(grpc_lookups(addr1, addrn, queries, a.lookups, a.lookup_workers))
        finally:
            for p in (kv1, kvn):
                p.terminate()
                p.wait(10)

    fig = {
        "ingest_blocks_per_s_1": ing1["blocks_per_s"], "ingest_blocks_per_s_n": ingn["blocks_per_s"],
        "ingest_ratio": ingn["blocks_per_s"] / ing1["blocks_per_s"],
        "redis_cpu_us_per_block_1": ing1["redis_cpu_us_per_block"],
        "redis_cpu_us_per_block_n": ingn["redis_cpu_us_per_block"],
        "redis_cpu_per_block_ratio": ingn["redis_cpu_us_per_block"] / ing1["redis_cpu_us_per_block"],
        "cpu_by_node_n": ingn["cpu_by_node"],
        "store_p50_ratio": statistics.median(sn) / statistics.median(s1), "store_p99_ratio": pct(sn, 99) / pct(s1, 99),
        "grpc_p50_ratio": statistics.median(gn) / statistics.median(g1), "grpc_p99_ratio": pct(gn, 99) / pct(g1, 99),
        "pinned": pin,
    }
    n = a.shards
    print(f"\nshard benchmark {time.strftime('%Y-%m-%d %H:%M')}: 1 redis-server vs a {n}-master Redis Cluster "
          f"(--shards {n}), {len(cpus)} CPUs, Python {sys.version.split()[0]}, "
          + ("each Redis pinned to its own core" if pin else f"Redis not pinned ({len(cpus)} cores < {n} + 2)"))
    print(f"1. ingest: {a.workers} workers x {a.messages} messages of {PER_MESSAGE} blocks (32 stored, 32 removed), "
          f"{a.clients} client processes")
    def runs(rs: list[dict]) -> str:
        return (" and ".join(f"{r['blocks_per_s']:,.0f}" for r in rs) + " blocks/s, Redis "
                + " and ".join(f"{r['redis_cpu_us_per_block']:.2f}" for r in rs) + " CPU-us per block")

    split = ", ".join(f"{c / sum(ingn['cpu_by_node']):.0%}" for c in ingn["cpu_by_node"])
    print(f"   1 shard (runs 1 and 3): {runs(runs1)}")
    print(f"   {n} shards (runs 2 and 4): {runs(runsn)}; Redis CPU by node {split}")
    print(f"   blocks/s {n} ÷ 1: {fig['ingest_ratio']:.2f} (goal >= 2.5 with a core per node); Redis CPU per block "
          f"{n} ÷ 1: {fig['redis_cpu_per_block_ratio']:.2f} (goal: unchanged, ~1.0)")
    line = "  {:<36} p50 {:8.1f} us   p99 {:8.1f} us"
    print(f"2. store Lookup (RedisIndex.lookup), {a.lookup_workers} workers, 64-block chains, interleaved")
    print(line.format("1 shard", statistics.median(s1), pct(s1, 99)))
    print(line.format(f"{n} shards (one parallel round)", statistics.median(sn), pct(sn, 99)))
    print(f"   {n} ÷ 1: p50 {fig['store_p50_ratio']:.2f} (goal <= 1.3), p99 {fig['store_p99_ratio']:.2f} (goal <= 1.5)")
    print("3. gRPC Lookup through `kvmesh kv-service`, interleaved from one grpc.aio client")
    print(line.format("--shards 1, one redis-server", statistics.median(g1), pct(g1, 99)))
    print(line.format(f"--shards {n}, {n}-master cluster", statistics.median(gn), pct(gn, 99)))
    print(f"   {n} ÷ 1: p50 {fig['grpc_p50_ratio']:.2f} (goal <= 1.3), p99 {fig['grpc_p99_ratio']:.2f} (goal <= 1.5)")
    if a.only == "all":
        fig["throughput"] = run_throughput(a)
        print_throughput(fig["throughput"], a)
    if a.json:
        Path(a.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
