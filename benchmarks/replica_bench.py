"""What reading Lookups from replicas costs (--read-replicas): the replication lag, how often a
replica's Lookup answers otherwise than its master's at the same moment, and a failover's timeline.
A 3-master Redis Cluster with a replica each, on loopback.

1. lag: a probe worker stores a fresh block through the kv_service's store (the master applied it
   when the call returns); a READONLY connection then polls the shard's replica until it holds the
   block (HEXISTS, back to back): the time from the write's answer to the replica having it. Idle;
   while the churn of 2. runs (in its own process); and while --ingest-clients processes stream
   event batches (shard_bench's ingest) as fast as they can (a stress: this host's 2 cores are then
   saturated by 6 Redis and the clients, and the lag is mostly the replica waiting for a core).
2. stale answers: --workers workers store and evict 64-block chains (parent-first, leaf-first, one
   message per worker every 20 ms, the live publisher's pace; a heavy churn: each message stores or
   evicts a whole prompt's blocks) while Lookups of those chains go in pairs: master and replica at
   once, and (the control: the same race without replication) master and master at once. A pair
   differs when any worker's matched blocks differ; the pick differs when the best match (a
   router's first candidate) differs. The replica's share minus the control's is what the lag adds.
3. failover: Lookups in a loop from a --read-replicas store while a replica is killed, then a
   master: each Lookup's outcome (answered / UNAVAILABLE) with its time, and the windows.

    python benchmarks/replica_bench.py [--probes 500] [--workers 64] [--seconds 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis

from kvmesh.contract.errors import Unavailable
from kvmesh.contract.index_protocol import Registration
from kvmesh.contract.types import BlockRemoved, BlockStored, Load
from kvmesh.kv_service.redis_cluster import home_shard
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import RedisCluster
from kvmesh.replay.records import percentile as pct
from kvmesh.transport.loop import new_event_loop

TTL = 3_600_000
NS = "replica-bench"
SHARD_BENCH = Path(__file__).with_name("shard_bench.py")


def wid_on(shard: int, prefix: str) -> str:
    return next(f"{prefix}{i}" for i in range(10_000) if home_shard(f"{prefix}{i}", 3) == shard)


async def in_sync(idx: RedisIndex, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        await idx.redis.check_replicas()
        states = idx.redis.replicas()
        if states and all(ok for _, _, ok in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas not in sync: {states}")
        await asyncio.sleep(0.1)


# -- 1. lag ---------------------------------------------------------------------------------------
async def lag(cluster: RedisCluster, idx: RedisIndex, probes: int) -> list[float]:
    wid = wid_on(0, "probe-")
    now = int(time.time() * 1000)
    await idx.register_worker(Registration(wid, "10.0.0.1:50061", "probe", 16, "sha256_128", 10 * probes, 1), TTL, now)
    await in_sync(idx)
    replica = next(addr for k, addr, _ in idx.redis.replicas() if k == 0)
    node = redis.Redis(port=int(replica.rsplit(":", 1)[1]), single_connection_client=True)
    node.execute_command("READONLY")
    key = idx.prefixes[0] + "bh"
    out = []
    for seq in range(1, probes + 1):
        h = os.urandom(16)
        await idx.publish(wid, 1, seq, [BlockStored([h])], now)
        t0 = time.perf_counter()
        while not node.hexists(key, h):  # NOTE: blocking, back to back: nothing else runs on this loop
            pass
        out.append((time.perf_counter() - t0) * 1e6)
        await asyncio.sleep(0.002)
    node.close()
    return out


def start_ingest(url: str, clients: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, str(SHARD_BENCH), "--client", url, "3", str(1000 + 40 * k), "40",
                               "1000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for k in range(clients)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


# -- 2. stale answers ----------------------------------------------------------------------------
async def churn(idx: RedisIndex, workers: int, chains: list[list[bytes]], stop: asyncio.Event) -> int:
    """The churning workers (in a process of their own: ``--churn``) until ``stop``; messages sent."""
    now = int(time.time() * 1000)
    wids = [f"ch{w:03d}" for w in range(workers)]
    for w in wids:
        await idx.register_worker(Registration(w, "10.0.0.1:50061", "churn", 16, "sha256_128", 1_000_000, 1), TTL, now)
    messages = 0

    async def worker(w: str, rng: random.Random) -> None:
        nonlocal messages
        held: list[int] = []
        seq = 0
        await asyncio.sleep(rng.random() * 0.02)
        while not stop.is_set():
            seq += 1
            if held and (len(held) >= 4 or rng.random() < 0.4):
                c = held.pop(rng.randrange(len(held)))
                depth = rng.randrange(8, 64)
                events = [BlockRemoved(chains[c][depth:][::-1])]  # leaf-first: it keeps chains[c][:depth]
            else:
                c = rng.randrange(len(chains))
                held.append(c)
                events = [BlockStored(chains[c])]
            await idx.publish(w, 1, seq, events, now, Load(num_running=seq % 7))
            messages += 1
            await asyncio.sleep(0.02)

    await asyncio.gather(*(worker(w, random.Random(k)) for k, w in enumerate(wids)))
    return messages


async def churn_main(url: str, workers: int, chains_file: str) -> int:
    chains = [[bytes.fromhex(h) for h in c] for c in json.loads(Path(chains_file).read_text())]
    idx = RedisIndex(url, NS, shards=3)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), stop.set)  # NOTE: any line (or EOF) on stdin stops it
    print("started", flush=True)
    messages = await churn(idx, workers, chains, stop)
    await idx.close()
    return messages


def best(answer: list) -> tuple[str, int]:
    m = max(answer, key=lambda m: (m.matched_blocks, m.worker_id))
    return m.worker_id, m.matched_blocks


async def paired(a: RedisIndex, b: RedisIndex, chains: list[list[bytes]], seconds: float) -> dict:
    rng = random.Random(7)
    now = int(time.time() * 1000)
    n = differ = pick = 0
    gaps: list[int] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        c = chains[rng.randrange(len(chains))]
        x, y = await asyncio.gather(a.lookup("churn", c, now), b.lookup("churn", c, now))
        n += 1
        mx = {m.worker_id: m.matched_blocks for m in x}
        my = {m.worker_id: m.matched_blocks for m in y}
        if mx != my:
            differ += 1
            gaps.append(sum(abs(mx[w] - my.get(w, 0)) for w in mx))
        if best(x)[0] != best(y)[0]:
            pick += 1
    return {"pairs": n, "differ": differ / n, "pick_differs": pick / n,
            "blocks_apart_when_differ": statistics.mean(gaps) if gaps else 0.0}


# -- 3. failover ---------------------------------------------------------------------------------
async def failover(cluster: RedisCluster, idx: RedisIndex, chain: list[bytes], kill: str) -> dict:
    await in_sync(idx)
    now = int(time.time() * 1000)
    k, replica, _ = next(s for s in idx.redis.replicas() if s[0] == 0)
    rport = int(replica.rsplit(":", 1)[1])
    master_id = next(n["master"] for n in cluster.nodes() if n["port"] == rport)
    mport = next(n["port"] for n in cluster.nodes() if n["id"] == master_id)
    victim = cluster.ports.index(rport if kill == "replica" else mport)
    timeline: list[tuple[float, str, float]] = []
    t0 = time.perf_counter()
    cluster.kill(victim)
    while time.perf_counter() - t0 < 8:
        s = time.perf_counter()
        try:
            await asyncio.wait_for(idx.lookup("churn", chain, now), 10)
            outcome = "answered"
        except Unavailable:
            outcome = "unavailable"
        timeline.append((s - t0, outcome, (time.perf_counter() - s) * 1e3))
        await asyncio.sleep(0.01)
    cluster.start_node(victim)  # back: a replica again (a killed master rejoins as its successor's replica)
    cluster.wait_ok()
    unavailable = [t for t, o, _ in timeline if o == "unavailable"]
    return {"killed": kill, "lookups": len(timeline), "unavailable": len(unavailable),
            "unavailable_from_s": min(unavailable, default=None), "unavailable_until_s": max(unavailable, default=None),
            "slowest_ms": max(ms for _, _, ms in timeline)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probes", type=int, default=500, help="lag probes, idle and loaded each (default 500)")
    ap.add_argument("--ingest-clients", type=int, default=1, help="ingest processes loading the cluster (default 1)")
    ap.add_argument("--workers", type=int, default=64, help="churning workers in 2. (default 64)")
    ap.add_argument("--chains", type=int, default=32, help="64-block chains they store and evict (default 32)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of paired Lookups per comparison (default 10)")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--churn", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.churn:
        url, workers, chains_file = a.churn
        print(json.dumps({"messages": asyncio.run(churn_main(url, int(workers), chains_file))}))
        return 0
    loop = new_event_loop()
    fig: dict = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpus": len(os.sched_getaffinity(0))}
    with RedisCluster(masters=3, replicas=1) as cluster:
        idx = RedisIndex(cluster.url, NS, shards=3, read_replicas=True)
        loop.run_until_complete(idx.ping())
        idle = loop.run_until_complete(lag(cluster, idx, a.probes))
        chains = [[os.urandom(16) for _ in range(64)] for _ in range(a.chains)]
        chains_file = Path(f"/tmp/replica-bench-{os.getpid()}.json")
        chains_file.write_text(json.dumps([[h.hex() for h in c] for c in chains]))
        churner = subprocess.Popen([sys.executable, __file__, "--churn", cluster.url, str(a.workers), str(chains_file)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert churner.stdout is not None and churner.stdout.readline().strip() == "started"
        masters = RedisIndex(cluster.url, NS, shards=3)
        masters2 = RedisIndex(cluster.url, NS, shards=3)
        try:
            time.sleep(2.0)
            churning = loop.run_until_complete(lag(cluster, idx, a.probes))
            loop.run_until_complete(in_sync(idx))
            rep = loop.run_until_complete(paired(masters2, idx, chains, a.seconds))
            ctl = loop.run_until_complete(paired(masters2, masters, chains, a.seconds))
        finally:
            out, _ = churner.communicate("stop\n", timeout=60)
            chains_file.unlink()
        messages = json.loads(out.strip().splitlines()[-1])["messages"]
        procs = start_ingest(cluster.url, a.ingest_clients)
        try:
            loaded = loop.run_until_complete(lag(cluster, idx, a.probes))
        finally:
            for p in procs:
                p.kill()
                p.wait()
        fig["lag_us"] = {name: {"p50": statistics.median(v), "p99": pct(v, 99), "max": max(v)}
                         for name, v in (("idle", idle), ("churn", churning), ("ingest flat out", loaded))}
        print(f"replica benchmark {fig['when']}: a 3-master Redis Cluster with a replica each, loopback, "
              f"{fig['cpus']} CPUs shared by 6 Redis and the clients")
        for name, v in fig["lag_us"].items():
            print(f"1. lag ({name}): write answered -> on the replica: p50 {v['p50']:.0f} us, p99 {v['p99']:.0f} us, "
                  f"max {v['max']:.0f} us ({a.probes} probes)")
        fig["stale"] = {"replica": rep, "control": ctl, "event_messages": messages}
        print(f"2. stale answers, {a.workers} workers churning ({messages:,} event messages): master vs replica "
              f"{rep['pairs']:,} pairs: answers differ {rep['differ']:.2%}, the pick {rep['pick_differs']:.2%} "
              f"({rep['blocks_apart_when_differ']:.1f} blocks apart when they differ); master vs master (control) "
              f"{ctl['pairs']:,} pairs: {ctl['differ']:.2%}, the pick {ctl['pick_differs']:.2%}")
        fig["failover"] = [loop.run_until_complete(failover(cluster, idx, chains[0], kill))
                           for kill in ("replica", "master")]
        for f in fig["failover"]:
            window = (f"UNAVAILABLE from {f['unavailable_from_s']:.2f} s to {f['unavailable_until_s']:.2f} s after the "
                      "kill" if f["unavailable"] else "none UNAVAILABLE")
            print(f"3. {f['killed']} of shard 0 killed: {f['lookups']} Lookups in 8 s, {f['unavailable']} UNAVAILABLE "
                  f"({window}); slowest {f['slowest_ms']:.0f} ms")
        for i in (idx, masters, masters2):
            loop.run_until_complete(i.close())
    if a.json:
        Path(a.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
