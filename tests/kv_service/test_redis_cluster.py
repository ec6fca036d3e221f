"""The sharded Redis store on a real Redis Cluster on loopback (redis-server --cluster-enabled,
built with redis-cli --cluster create): where the shards live, one parallel round per Lookup, a
namespace's shard count kept, registrations racing across shards, and the faults of
docs/kv-service.md "Shards": a master killed (kill -9) and restarted with no replica, and a master
killed with its replica promoted.

The conformance suite runs on the cluster too (test_index_conformance.py, cluster-* stores).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from redis.asyncio.connection import Connection

from kvmesh.contract.errors import FailedPrecondition, NotFound, Unavailable
from kvmesh.contract.types import BlockStored, Load
from kvmesh.kv_service.index import Action
from kvmesh.kv_service.redis_cluster import home_shard, shard_tags
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import RedisCluster
from tests.support.index import T0, TTL, chain, matches, one_id_per_shard, reg, wait_for

pytestmark = pytest.mark.anyio

async def populated(url: str, namespace: str, shards: int = 3) -> tuple[RedisIndex, list[str], dict[str, list[bytes]]]:
    """An index with one worker per shard, each holding a chain of its own behind a shared one."""
    idx = RedisIndex(url, namespace, shards=shards)
    wids = one_id_per_shard(shards)
    shared = chain(3)
    chains = {w: shared + chain(5, start=1000 * (k + 1)) for k, w in enumerate(wids)}
    for w in wids:
        await idx.register_worker(reg(w), TTL, T0)
        assert (await idx.publish(w, 1, 1, [BlockStored(chains[w])], T0)).action == Action.ACK
    return idx, wids, chains


def port_index(cluster: RedisCluster, port: int) -> int:
    return cluster.ports.index(port)


def shard_keys(cluster: RedisCluster, node: int, namespace: str) -> set[str]:
    """The shard tags of the namespace's index keys node ``node`` holds."""
    keys = cluster.cli(node, "KEYS", f"kvm:{{{namespace}/*").split()
    return {k.split("{", 1)[1].split("}", 1)[0] for k in keys}


# -- where shards live, one round, the shard count ---------------------------------------------
async def test_each_shard_lives_on_its_own_master(redis_cluster, redis_namespace):
    idx, wids, chains = await populated(redis_cluster.url, redis_namespace)
    try:
        masters = redis_cluster.master_ports()
        assert len(masters) == 3
        tags = shard_tags(redis_namespace, 3)
        # master k (in slot order) holds shard k's keys and nothing of the other shards
        assert [shard_keys(redis_cluster, port_index(redis_cluster, p), redis_namespace) for p in masters] == \
            [{t} for t in tags]
        assert await matches(idx, chains[wids[1]]) == {wids[0]: 3, wids[1]: 8, wids[2]: 3}
    finally:
        await idx.close()


async def test_a_lookup_is_one_parallel_round_to_the_shards(redis_cluster, redis_namespace, monkeypatch):
    idx, wids, chains = await populated(redis_cluster.url, redis_namespace)
    try:
        await matches(idx, chains[wids[0]])  # connections open, scripts loaded, loads cached
        log: list[tuple[str, int]] = []
        send, read = Connection.send_packed_command, Connection.read_response

        async def logged_send(self, command, check_health=True):
            log.append(("send", self.port))
            return await send(self, command, check_health)

        async def logged_read(self, *args, **kwargs):
            log.append(("read", self.port))
            return await read(self, *args, **kwargs)

        monkeypatch.setattr(Connection, "send_packed_command", logged_send)
        monkeypatch.setattr(Connection, "read_response", logged_read)
        assert await matches(idx, chains[wids[2]]) == {wids[0]: 3, wids[1]: 3, wids[2]: 8}
        monkeypatch.undo()
        # every shard's request (one transaction of 4 commands: MULTI, 4 x QUEUED and EXEC's list come
        # back) is out before the first reply is read: one round trip, not three
        assert [op for op, _ in log] == ["send"] * 3 + ["read"] * 3 * 6
        assert {p for _, p in log} == set(redis_cluster.master_ports())
    finally:
        await idx.close()


async def test_a_namespace_keeps_its_shard_count(redis_url, redis_namespace):
    one = RedisIndex(redis_url, redis_namespace)
    three = RedisIndex(redis_url, redis_namespace, shards=3)
    try:
        await one.ping()
        with pytest.raises(FailedPrecondition, match=r"kept in 1 shard\(s\).*not 3.*--shards 1.*new --namespace"):
            await three.ping()
        with pytest.raises(FailedPrecondition):
            await three.register_worker(reg("w1"), TTL, T0)  # refused on every call, not only at start
    finally:
        await one.close()
        await three.close()


async def test_two_specs_registering_at_once_on_two_shards_are_never_both_kept(redis_cluster, redis_namespace):
    """Two replicas register two workers of one model with different block sizes at the same
    moment, on two shards: at most one is kept, and the model never has live workers of two specs."""
    a, b = one_id_per_shard(2)[0], one_id_per_shard(3, "other-")[1]
    assert home_shard(a, 3) != home_shard(b, 3)
    r1, r2 = RedisIndex(redis_cluster.url, redis_namespace, shards=3), RedisIndex(redis_cluster.url, redis_namespace, shards=3)
    try:
        outcomes = set()
        for k in range(8):
            model = f"m{k}"
            got = await asyncio.gather(r1.register_worker(reg(a, model=model), TTL, T0),
                                       r2.register_worker(reg(b, bs=8, model=model), TTL, T0),
                                       return_exceptions=True)
            assert all(g is None or isinstance(g, FailedPrecondition) for g in got), got
            kept = [w for w in await r1.workers(T0) if w.registration.model_id == model]
            assert len({w.registration.block_size for w in kept}) <= 1
            assert len(kept) == sum(g is None for g in got) <= 1
            outcomes.add(len(kept))
            for w in (a, b):  # free the ids for the next model
                await r1.redis.on(r1.home(w), "admin", "unregister", w, 1)
        assert 0 in outcomes  # the race did happen: both were refused at least once
    finally:
        await r1.close()
        await r2.close()


# -- faults -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bare_cluster():
    """3 masters, no replicas: a killed master's shard is down until it is back (empty)."""
    with RedisCluster(masters=3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def replicated_cluster():
    """3 masters with a replica each; a master unreachable for 1 s is failed over."""
    with RedisCluster(masters=3, replicas=1, node_timeout_ms=1000) as cluster:
        yield cluster


async def test_master_killed_and_restarted_empty_its_workers_register_again(bare_cluster, redis_namespace):
    """What survives a kill -9 of one master with no replica, and what resyncs:
    - while it is down, Lookups fail UNAVAILABLE (a Lookup is answered by every shard or fails; the
      router falls back to rendezvous hashing); workers on the other shards keep publishing;
    - back (empty, no persistence), its workers are unknown: their next heartbeat or batch answers
      NOT_FOUND, they register again and send a snapshot; the other shards' workers never notice."""
    cluster = bare_cluster
    idx, wids, chains = await populated(cluster.url, redis_namespace)
    try:
        down_port = cluster.master_ports()[1]  # shard 1's master
        victim, survivor = wids[1], wids[0]
        cluster.kill(port_index(cluster, down_port))
        with pytest.raises(Unavailable):
            await idx.lookup("m", chains[victim], T0)
        with pytest.raises(Unavailable):
            await idx.heartbeat(victim, 1, Load(), TTL, T0)
        # the other shards keep ingesting (cluster-require-full-coverage no)
        extra = chain(2, start=9000)
        assert (await idx.publish(survivor, 1, 2, [BlockStored(extra)], T0)).action == Action.ACK

        cluster.start_node(port_index(cluster, down_port))  # same port and nodes.conf, no data
        cluster.wait_ok()

        async def heartbeat() -> str:
            try:
                await idx.heartbeat(victim, 1, Load(), TTL, T0 + 1)
            except NotFound:
                return "not found"
            return "renewed"

        assert await wait_for(heartbeat, 10, "shard 1 back") == "not found"  # Unavailable until then
        assert await matches(idx, chains[victim]) == {survivor: 3, wids[2]: 3}  # the victim is gone
        # what the worker's publisher does on NOT_FOUND: register again, then a snapshot of its cache
        await idx.register_worker(reg(victim), TTL, T0 + 1)
        assert (await idx.snapshot(victim, 1, 1, chains[victim], T0 + 1)).action == Action.ACK
        assert await matches(idx, chains[victim]) == {survivor: 3, victim: 8, wids[2]: 3}
        # the survivor kept its blocks, epoch and seq: its next batch applies, no resync
        assert await matches(idx, chains[survivor] + extra) == {survivor: 10, victim: 3, wids[2]: 3}
        assert (await idx.publish(survivor, 1, 3, [BlockStored(chain(1, start=9500))], T0)).action == Action.ACK
    finally:
        await idx.close()


def replicated(cluster: RedisCluster, master: int) -> bool:
    """Every replica of node ``master`` has its whole replication stream."""
    info = dict(line.split(":", 1) for line in cluster.cli(master, "INFO", "replication").splitlines()
                if ":" in line)
    offset = info.get("master_repl_offset")
    slaves = [v for k, v in info.items() if k.startswith("slave")]
    return bool(slaves) and all(f"offset={offset}," in s for s in slaves)


async def test_master_killed_its_replica_promoted_nothing_resyncs(replicated_cluster, redis_namespace):
    """kill -9 a master with a replica: its shard is UNAVAILABLE until the cluster promotes the
    replica (about the node timeout plus an election), then the index finds the new master (CLUSTER
    SLOTS again) and every worker keeps its registration, blocks, epoch and seq: nothing resyncs.
    (A write the replica had not received yet would be lost with the master: the worker's next
    batch then finds a seq gap and is answered RESYNC; here the replica has everything.)"""
    cluster = replicated_cluster
    idx, wids, chains = await populated(cluster.url, redis_namespace)
    try:
        old = cluster.master_ports()[2]
        old_i = port_index(cluster, old)
        await wait_for(lambda: replicated(cluster, old_i), 10, "the replica to catch up")
        before = {w.registration.worker_id: (w.last_seq, w.blocks_indexed) for w in await idx.workers(T0)}
        cluster.kill(old_i)
        with pytest.raises(Unavailable):
            await idx.publish(wids[2], 1, 2, [BlockStored(chain(1, start=7000))], T0)
        other = next(i for i, p in enumerate(cluster.ports) if p != old and cluster.procs[i].poll() is None)
        await wait_for(lambda: len(ms := cluster.master_ports(other)) == 3 and old not in ms, 30,
                       "the replica to be promoted")
        assert await wait_for(lambda: matches(idx, chains[wids[2]]), 10, "the index to find the new master") == \
            {wids[0]: 3, wids[1]: 3, wids[2]: 8}
        assert {w.registration.worker_id: (w.last_seq, w.blocks_indexed) for w in await idx.workers(T0)} == before
        assert (await idx.publish(wids[2], 1, 2, [BlockStored(chain(1, start=7000))], T0)).action == Action.ACK
        assert await idx.heartbeat(wids[2], 1, Load(), TTL, T0) is False
        # the old master comes back as a replica of the new one; the index does not notice
        cluster.start_node(old_i)
        cluster.wait_ok()
        assert old not in cluster.master_ports()
        assert await matches(idx, chains[wids[2]] + chain(1, start=7000)) == {wids[0]: 3, wids[1]: 3, wids[2]: 9}
    finally:
        await idx.close()


# -- the command ---------------------------------------------------------------------------------
KVMESH = str(Path(sys.executable).parent / "kvmesh")


def test_kv_service_on_a_cluster_with_shards_and_a_second_replica_with_another_count_refused(
        redis_cluster, redis_namespace):
    from kvmesh.bench.processes import start_kv_service
    from kvmesh.transport.channels import dial
    from kvmesh.v1 import kv_service_pb2 as kpb
    from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc

    proc, address = start_kv_service("--redis-url", redis_cluster.url, "--namespace", redis_namespace, "--shards", "3")
    try:
        stub = kpb_grpc.KVServiceStub(dial(address))
        wids = one_id_per_shard(3)
        hashes = chain(4)
        for k, w in enumerate(wids):
            stub.RegisterWorker(kpb.RegisterWorkerRequest(worker_id=w, address="10.0.0.1:50061", model_id="m",
                                                          block_size=4, hash_algorithm=kpb.HASH_ALGORITHM_SHA256_128,
                                                          num_blocks=100, epoch=1), timeout=10)
            acks = list(stub.PublishEvents(iter([kpb.PublishEventsRequest(worker_id=w, epoch=1, seq=1, events=[
                kpb.KVEvent(stored=kpb.BlockStored(block_hashes=hashes[:k + 2]))])]), timeout=10))
            assert [a.action for a in acks] == [kpb.PUBLISH_ACTION_ACK]
        got = stub.Lookup(kpb.LookupRequest(model_id="m", block_hashes=hashes), timeout=5)
        assert [(m.worker_id, m.matched_blocks) for m in got.workers] == [(wids[2], 4), (wids[1], 3), (wids[0], 2)]
        st = stub.GetStats(kpb.GetStatsRequest(), timeout=5)
        assert (st.live_workers, st.indexed_blocks, st.block_replicas) == (3, 4, 9)
        # every master holds one shard's keys
        assert sorted(len(shard_keys(redis_cluster, port_index(redis_cluster, p), redis_namespace))
                      for p in redis_cluster.master_ports()) == [1, 1, 1]

        other = subprocess.run([KVMESH, "kv-service", "--port", "0", "--metrics-port", "0", "--redis-url",
                                redis_cluster.url, "--namespace", redis_namespace, "--shards", "2"],
                               capture_output=True, text=True, timeout=30)
        assert other.returncode == 2 and "kept in 3 shard(s)" in other.stderr and "--shards 3" in other.stderr
        bad = subprocess.run([KVMESH, "kv-service", "--port", "0", "--shards", "0"], capture_output=True, text=True,
                             timeout=30)
        assert bad.returncode == 2 and "--shards must be in [1, 256]" in bad.stderr
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
