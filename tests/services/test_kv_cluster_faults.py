"""Real workers and the kv_service on a 3-master Redis Cluster (--shards 3), one master killed with
kill -9 and brought back empty: the workers on the other shards never notice; the dead shard's
worker registers again and resends its cache by itself (docs/kv-service.md "Shards", faults).

Workers are the real WorkerServer on the tiny model, the kv_service the real one in process, the
cluster real redis-servers on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.redis_cluster import home_shard, shard_tags
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import RedisCluster, free_port
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from kvmesh.v1 import worker_pb2 as pb
from kvmesh.v1 import worker_pb2_grpc as pb_grpc
from tests.support import wait_until


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(masters=3) as c:
        yield c


@pytest.fixture
def kv_on_cluster(cluster, redis_namespace) -> Iterator[KVServiceServer]:
    server = KVServiceServer(RedisIndex(cluster.url, redis_namespace, shards=3), "127.0.0.1", free_port(),
                             ServiceConfig(lease_ttl_ms=1500, reap_interval_s=0.25)).start()
    yield server
    server.stop(0.5)


def generate(worker, ids: list[int]) -> None:
    stub = pb_grpc.WorkerStub(dial(worker.address))
    list(stub.Generate(pb.WorkerGenerateRequest(prompt_token_ids=ids, sampling=common_pb2.SamplingParams(
        max_tokens=4, ignore_eos=True)), timeout=60))


def indexed(kv: kpb_grpc.KVServiceStub) -> dict[str, kpb.WorkerInfo]:
    return {w.worker_id: w for w in kv.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers}


def holds_its_cache(kv: kpb_grpc.KVServiceStub, worker) -> bool:
    """The index holds exactly the worker's cached blocks for it."""
    try:
        info = indexed(kv).get(worker.worker_id)
        cached = worker.engine.cached_block_hashes()
        return (info is not None and info.blocks_indexed == len(cached) > 0 and all(
            worker.worker_id in kv.GetBlock(kpb.GetBlockRequest(block_hash=h), timeout=5).holders for h in cached))
    except Exception:  # noqa: BLE001 - UNAVAILABLE while the shard is down
        return False


def test_a_master_killed_and_back_its_worker_resends_its_cache_the_others_never_notice(
        cluster, kv_on_cluster, start_worker):
    kv = kpb_grpc.KVServiceStub(dial(f"127.0.0.1:{kv_on_cluster.port}"))
    address = f"127.0.0.1:{kv_on_cluster.port}"
    # NOTE: the kv_service's own calls observed (not replaced): who registered, who sent a snapshot
    svc, seen = kv_on_cluster.service, []
    register, snapshot = svc.register, svc.snapshot

    async def registering(reg):
        seen.append(("register", reg.worker_id))
        return await register(reg)

    async def snapshotting(worker_id, *args, **kwargs):
        seen.append(("snapshot", worker_id))
        return await snapshot(worker_id, *args, **kwargs)

    svc.register, svc.snapshot = registering, snapshotting
    ids = [next(f"w{i}" for i in range(100) if home_shard(f"w{i}", 3) == k) for k in range(3)]
    workers = [start_worker(w, address) for w in ids]
    for k, w in enumerate(workers):
        generate(w, [(7 * i + 13 * k) % 250 + 5 for i in range(70)])
    for w in workers:
        wait_until(lambda w=w: holds_its_cache(kv, w), 10, f"the index to hold {w.worker_id}'s cache")
    before = indexed(kv)
    assert sorted(seen) == sorted(("register", w) for w in ids)

    victim, others = workers[1], [workers[0], workers[2]]
    masters = cluster.master_ports()  # master k holds shard k
    tags = shard_tags(kv_on_cluster.service.index.namespace, 3)

    def seq_on_its_shard(w) -> int:
        """The worker's applied seq, read straight from its shard's master."""
        k = home_shard(w.worker_id, 3)
        return int(cluster.cli(cluster.ports.index(masters[k]), "HGET", f"kvm:{{{tags[k]}}}:w:{w.worker_id}", "seq") or 0)

    cluster.kill(cluster.ports.index(masters[1]))
    # NOTE: while a shard is down every all-shard query (Lookup, ListWorkers, GetBlock) is
    # UNAVAILABLE; the other shards' workers keep publishing their new blocks meanwhile
    assert not holds_its_cache(kv, others[0])
    for k, w in enumerate(others):
        seq = seq_on_its_shard(w)
        generate(w, [(11 * i + 3 * k) % 250 + 5 for i in range(70)])
        wait_until(lambda w=w, seq=seq: seq_on_its_shard(w) > seq, 10, f"{w.worker_id}'s batches applied during the outage")

    cluster.start_node(cluster.ports.index(masters[1]))  # same port and nodes.conf, no data
    cluster.wait_ok()
    # the victim's heartbeat answers NOT_FOUND: it registers again and sends a snapshot, by itself
    wait_until(lambda: holds_its_cache(kv, victim), 15, "the victim's cache back in the index")
    assert ("register", victim.worker_id) in seen[3:] and ("snapshot", victim.worker_id) in seen[3:]
    after = indexed(kv)
    for w in others:
        # their blocks of the outage were applied as they came: no registration, no snapshot, the
        # same epoch, and the index holds their whole caches
        assert [e for e in seen[3:] if e[1] == w.worker_id] == []
        assert after[w.worker_id].epoch == before[w.worker_id].epoch
        assert after[w.worker_id].last_seq > before[w.worker_id].last_seq
        assert holds_its_cache(kv, w)
