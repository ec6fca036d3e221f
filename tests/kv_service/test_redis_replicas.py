"""Lookups from replicas (``read_replicas``, `kvmesh kv-service --read-replicas`) on real Redis
replicas on loopback: a Redis Cluster with replicas (redis-cli --cluster create --cluster-replicas)
and a plain redis-server with one (--replicaof). Lookups go to the replicas, spread over them, and
answer what the masters answer once replicated; writes and Reserve stay on the masters; and the
faults of docs/kv-service.md "Lookups from replicas": a replica killed (and back), a replica
promoted (manual failover), a master killed (its replica answers on, then is promoted). Through every
fault each Lookup is answered or fails UNAVAILABLE, none hangs (each is given 10 s: a hang, not a slow
answer, trips it).
"""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.contract.errors import Unavailable
from kvmesh.contract.index_protocol import Reservation
from kvmesh.contract.types import BlockStored, Load
from kvmesh.kv_service.index import Action
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import RedisCluster, RedisServer
from tests.support.index import T0, TTL, chain, matches, one_id_per_shard, reg, wait_for

pytestmark = pytest.mark.anyio


def evalsha_ro_calls(cli) -> int:
    """EVALSHA_RO calls a node answered since its stats were reset (``cli``: redis-cli on that node);
    not those it refused (NOSCRIPT: the first call after a replica started)."""
    for line in cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_evalsha_ro:"):
            stats = dict(kv.split("=") for kv in line.split(":", 1)[1].split(","))
            return int(stats["calls"]) - int(stats.get("failed_calls", 0))
    return 0


async def populate(idx: RedisIndex, shards: int) -> tuple[list[str], dict[str, list[bytes]]]:
    """One worker per shard, each holding a chain of its own behind a shared one (written through
    the read_replicas index: writes go to the masters)."""
    wids = one_id_per_shard(shards)
    shared = chain(3)
    chains = {w: shared + chain(5, start=1000 * (k + 1)) for k, w in enumerate(wids)}
    for w in wids:
        await idx.register_worker(reg(w), TTL, T0)
        assert (await idx.publish(w, 1, 1, [BlockStored(chains[w])], T0, Load(num_running=2))).action == Action.ACK
    return wids, chains


async def all_in_sync(idx: RedisIndex, expect: int) -> bool:
    await idx.redis.check_replicas()
    states = idx.redis.replicas()
    return len(states) == expect and all(ok for _, _, ok in states)


def expected(wids: list[str], deep: str) -> dict[str, int]:
    return {w: 8 if w == deep else 3 for w in wids}


async def lookup_or_unavailable(idx: RedisIndex, hashes: list[bytes]) -> dict[str, int] | None:
    """One Lookup through a fault: its answer, or None for a clean UNAVAILABLE; never a hang."""
    try:
        return await asyncio.wait_for(matches(idx, hashes), 10)
    except Unavailable:
        return None


@pytest.fixture
def cluster():
    """3 masters with a replica each (fault tests change it: one per test)."""
    with RedisCluster(masters=3, replicas=1, node_timeout_ms=1000) as c:
        yield c


async def test_lookups_go_to_every_shards_replicas_and_writes_to_the_masters(redis_namespace):
    with RedisCluster(masters=3, replicas=2) as cluster:
        idx = RedisIndex(cluster.url, redis_namespace, shards=3, read_replicas=True)
        try:
            wids, chains = await populate(idx, 3)
            await wait_for(lambda: all_in_sync(idx, 6), 30, "the replicas in sync")
            await wait_for(lambda: _eq(matches(idx, chains[wids[1]]), expected(wids, wids[1])), 30,
                           "the replicas to have the index")
            for i in range(len(cluster.ports)):
                cluster.cli(i, "CONFIG", "RESETSTAT")
            before = idx.redis.replica_lookups
            for k in range(60):
                w = wids[k % 3]
                assert await matches(idx, chains[w]) == expected(wids, w)
            masters = set(cluster.master_ports())
            calls = {p: evalsha_ro_calls(lambda *a, i=i: cluster.cli(i, *a)) for i, p in enumerate(cluster.ports)}
            assert all(calls[p] == 0 for p in masters), calls
            assert all(calls[p] > 0 for p in calls if p not in masters), calls  # both replicas of each shard
            assert sum(calls.values()) == 60 * 3
            assert idx.redis.replica_lookups - before == 60 * 3
            # writes and Reserve go to the masters (a replica would refuse them)
            assert (await idx.publish(wids[0], 1, 2, [BlockStored(chain(1, start=9000))], T0)).action == Action.ACK
            assert (await idx.reserve(Reservation("m", wids[0], "r1", "req-1", 100, 2), T0)).reserved
            await idx.heartbeat(wids[0], 1, Load(num_running=5), TTL, T0)
            got = await wait_for(lambda: _pending_seen(idx, chains[wids[0]], wids[0]), 30,
                                 "the pick and load replicated")
            assert (got.pending.requests, got.load.num_running) == (1, 5)
        finally:
            await idx.close()


async def _eq(coro, want) -> bool:
    return (await coro) == want


async def _pending_seen(idx: RedisIndex, hashes: list[bytes], wid: str):
    m = next(m for m in await idx.lookup("m", hashes, T0) if m.worker_id == wid)
    return m if m.pending.requests and m.load.num_running == 5 else None


async def test_a_plain_redis_with_a_replica_answers_lookups_from_the_replica(redis_namespace):
    with RedisServer() as master, RedisServer(extra_args=("--replicaof", "127.0.0.1", str(master.port))) as replica:
        replica_cli = _cli(replica.port)
        idx = RedisIndex(master.url, redis_namespace, read_replicas=True)
        try:
            wids, chains = await populate(idx, 1)
            await wait_for(lambda: all_in_sync(idx, 1), 30, "the replica in sync")
            await wait_for(lambda: _eq(matches(idx, chains[wids[0]]), {wids[0]: 8}), 30, "the replica to have it")
            replica_cli("CONFIG", "RESETSTAT")
            _cli(master.port)("CONFIG", "RESETSTAT")
            for _ in range(10):
                assert await matches(idx, chains[wids[0]]) == {wids[0]: 8}
            assert evalsha_ro_calls(replica_cli) == 10
            assert evalsha_ro_calls(_cli(master.port)) == 0
        finally:
            await idx.close()


def _cli(port: int):
    import subprocess

    def run(*args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    return run


def shard_nodes(cluster: RedisCluster, idx: RedisIndex, shard: int) -> tuple[int, int]:
    """(master node, replica node) of a shard, as cluster indices."""
    replica_port = next(int(addr.rsplit(":", 1)[1]) for k, addr, _ in idx.redis.replicas() if k == shard)
    replica = cluster.ports.index(replica_port)
    master_id = next(n["master"] for n in cluster.nodes() if n["port"] == replica_port)
    master_port = next(n["port"] for n in cluster.nodes() if n["id"] == master_id)
    return cluster.ports.index(master_port), replica


async def test_a_killed_replica_its_shard_is_read_on_its_master_until_it_is_back(cluster, redis_namespace):
    idx = RedisIndex(cluster.url, redis_namespace, shards=3, read_replicas=True)
    try:
        wids, chains = await populate(idx, 3)
        await wait_for(lambda: all_in_sync(idx, 3), 30, "the replicas in sync")
        master, replica = shard_nodes(cluster, idx, 1)
        cluster.kill(replica)
        for k in range(30):  # the first read on it fails over to the masters; then it is skipped
            w = wids[k % 3]
            assert await asyncio.wait_for(matches(idx, chains[w]), 10) == expected(wids, w)
        assert not dict(((k, a), ok) for k, a, ok in idx.redis.replicas()).get((1, f"127.0.0.1:{cluster.ports[replica]}"))
        cluster.start_node(replica)  # back, empty: it resyncs from its master before it serves again
        cluster.wait_ok()
        await wait_for(lambda: all_in_sync(idx, 3), 30, "the replica in sync again")
        cluster.cli(replica, "CONFIG", "RESETSTAT")
        for k in range(30):
            w = wids[k % 3]
            assert await matches(idx, chains[w]) == expected(wids, w)
        assert evalsha_ro_calls(lambda *a: cluster.cli(replica, *a)) == 30
        assert cluster.procs[master].poll() is None
    finally:
        await idx.close()


async def test_a_replica_promoted_by_a_failover_lookups_and_writes_go_on(cluster, redis_namespace):
    idx = RedisIndex(cluster.url, redis_namespace, shards=3, read_replicas=True)
    try:
        wids, chains = await populate(idx, 3)
        await wait_for(lambda: all_in_sync(idx, 3), 30, "the replicas in sync")
        old_master, promoted = shard_nodes(cluster, idx, 2)
        assert cluster.cli(promoted, "CLUSTER", "FAILOVER") == "OK"  # a manual failover: no write lost
        answered = 0
        for k in range(200):
            got = await lookup_or_unavailable(idx, chains[wids[k % 3]])
            assert got in (None, expected(wids, wids[k % 3]))
            answered += got is not None
            if cluster.ports[promoted] in cluster.master_ports() and cluster.ports[old_master] not in \
                    cluster.master_ports():
                break
            await asyncio.sleep(0.02)
        assert answered > 0
        # the shard's writes reach the new master (MOVED, the slot map read again)
        assert await wait_for(lambda: _published(idx, wids[2]), 30, "writes to the new master") == Action.ACK
        # and the old master, a replica now, serves the shard's Lookups once it is in sync
        await wait_for(lambda: _replica_of_shard(idx, 2, cluster.ports[old_master]), 30,
                       "the old master read as the shard's replica")
        cluster.cli(old_master, "CONFIG", "RESETSTAT")
        deeper = chains[wids[2]] + chain(1, start=7000)
        await wait_for(lambda: _eq(matches(idx, deeper), {wids[0]: 3, wids[1]: 3, wids[2]: 9}), 30, "replicated")
        assert evalsha_ro_calls(lambda *a: cluster.cli(old_master, *a)) > 0
    finally:
        await idx.close()


async def _published(idx: RedisIndex, wid: str) -> Action | None:
    try:
        return (await idx.publish(wid, 1, 2, [BlockStored(chain(1, start=7000))], T0)).action
    except Unavailable:
        return None


async def _replica_of_shard(idx: RedisIndex, shard: int, port: int) -> bool:
    await idx.redis.check_replicas()
    return any(k == shard and a.endswith(f":{port}") and ok for k, a, ok in idx.redis.replicas())


async def test_a_killed_master_its_replica_answers_from_what_it_has_then_as_the_new_master(cluster,
                                                                                          redis_namespace):
    """A replica whose master died keeps answering Lookups from what it had (REPLICA_STALE_S of a
    broken link at most): the shard's Lookups go on through the failover (one may fail UNAVAILABLE
    while the slot map changes); once promoted it answers as the master and takes the writes."""
    idx = RedisIndex(cluster.url, redis_namespace, shards=3, read_replicas=True)
    try:
        wids, chains = await populate(idx, 3)
        await wait_for(lambda: all_in_sync(idx, 3), 30, "the replicas in sync")
        await wait_for(lambda: _eq(matches(idx, chains[wids[0]]), expected(wids, wids[0])), 30, "replicated")
        master, replica = shard_nodes(cluster, idx, 0)
        cluster.kill(master)
        before_promotion: list[bool] = []
        for k in range(600):
            promoted = cluster.ports[replica] in cluster.master_ports(replica)
            got = await lookup_or_unavailable(idx, chains[wids[k % 3]])
            assert got in (None, expected(wids, wids[k % 3]))
            if not promoted:
                before_promotion.append(got is not None)
            elif got is not None:
                break
            await asyncio.sleep(0.02)
        assert promoted and got is not None
        assert any(before_promotion), "no Lookup answered between the master's death and the promotion"
        # a write finds the new master once the slot map is read again (after a failed call, or the
        # replica check's next round)
        assert await wait_for(lambda: _published(idx, wids[0]), 30, "writes to the new master") == Action.ACK
        assert await matches(idx, chains[wids[0]] + chain(1, start=7000)) == {wids[0]: 9, wids[1]: 3, wids[2]: 3}
    finally:
        await idx.close()


def test_kv_service_read_replicas_flag_serves_grpc_lookups_from_replicas(redis_namespace):
    import subprocess
    import sys
    import time
    from pathlib import Path

    from kvmesh.bench.processes import start_kv_service
    from kvmesh.transport.channels import dial
    from kvmesh.v1 import kv_service_pb2 as kpb
    from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc

    kvmesh = str(Path(sys.executable).parent / "kvmesh")
    bad = subprocess.run([kvmesh, "kv-service", "--port", "0", "--metrics-port", "0", "--store", "memory",
                          "--read-replicas"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--read-replicas applies to the Redis store" in bad.stderr
    with RedisCluster(masters=3, replicas=1) as cluster:
        proc, address = start_kv_service("--redis-url", cluster.url, "--namespace", redis_namespace, "--shards", "3",
                                         "--read-replicas")
        try:
            stub = kpb_grpc.KVServiceStub(dial(address))
            hashes = chain(4)
            wids = one_id_per_shard(3)
            for k, w in enumerate(wids):
                stub.RegisterWorker(kpb.RegisterWorkerRequest(
                    worker_id=w, address="10.0.0.1:50061", model_id="m", block_size=4,
                    hash_algorithm=kpb.HASH_ALGORITHM_SHA256_128, num_blocks=100, epoch=1), timeout=10)
                acks = list(stub.PublishEvents(iter([kpb.PublishEventsRequest(worker_id=w, epoch=1, seq=1, events=[
                    kpb.KVEvent(stored=kpb.BlockStored(block_hashes=hashes[:k + 2]))])]), timeout=10))
                assert [a.action for a in acks] == [kpb.PUBLISH_ACTION_ACK]
            want = [(wids[2], 4), (wids[1], 3), (wids[0], 2)]
            replicas = [i for i, p in enumerate(cluster.ports) if p not in cluster.master_ports()]
            deadline = time.monotonic() + 30
            while True:  # the replicas are checked, then read; until then the masters answer
                got = stub.Lookup(kpb.LookupRequest(model_id="m", block_hashes=hashes), timeout=5)
                served = sum(evalsha_ro_calls(lambda *a, i=i: cluster.cli(i, *a)) for i in replicas)
                if served and [(m.worker_id, m.matched_blocks) for m in got.workers] == want:
                    break
                assert time.monotonic() < deadline, "no Lookup answered by the replicas"
                time.sleep(0.05)
        finally:
            proc.terminate()
            proc.wait(10)
