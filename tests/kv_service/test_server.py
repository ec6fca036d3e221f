"""The kv_service over real gRPC on loopback, on a real redis-server."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.kv_service.config import FaultConfig, ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import free_port
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc
from tests.support import wait_until

SHA = pb.HASH_ALGORITHM_SHA256_128
LEASE_MS = 2000


@pytest.fixture(params=["apart", "shared"])
def kv(request, redis_url, redis_namespace):
    """Batches applied on a loop of their own (the default) or on the serving loop (--ingest-loop)."""
    server = KVServiceServer(RedisIndex(redis_url, redis_namespace, ingest_loop=request.param), "127.0.0.1", free_port(),
                             ServiceConfig(lease_ttl_ms=LEASE_MS, reap_interval_s=0.2)).start()
    channel = dial(f"127.0.0.1:{server.port}")
    yield pb_grpc.KVServiceStub(channel), channel
    channel.close()
    server.stop(0.5)


def register(stub, wid="w1", *, bs=4, algo=SHA, epoch=7, nb=1000, model="m", engine="", host_blocks=0):
    return stub.RegisterWorker(pb.RegisterWorkerRequest(
        worker_id=wid, address="127.0.0.1:50061", model_id=model, block_size=bs, hash_algorithm=algo,
        num_blocks=nb, epoch=epoch, engine=engine, host_blocks=host_blocks), timeout=5)


def reserve(stub, **kw):
    fields = {"model_id": "m", "worker_id": "w1", "router_id": "ra", "request_id": "r1", "prefill_tokens": 10,
              "blocks": 1, **kw}
    return stub.Reserve(pb.ReserveRequest(**fields), timeout=5)


def batch(wid, seq, *events, epoch=7, **kw):
    return pb.PublishEventsRequest(worker_id=wid, epoch=epoch, seq=seq, events=list(events), **kw)


def stored(hashes, parent=b""):
    return pb.KVEvent(stored=pb.BlockStored(block_hashes=hashes, parent_hash=parent))


def publish(stub, *batches):
    return [(r.seq, r.action, r.reason) for r in stub.PublishEvents(iter(batches), timeout=5)]


def lookup(stub, hashes, model="m"):
    r = stub.Lookup(pb.LookupRequest(model_id=model, block_hashes=hashes), timeout=5)
    return [(w.worker_id, w.matched_blocks) for w in r.workers]


CHAIN = BlockHasher("m", 4).hash_prompt(list(range(24)))


def test_health_reflection_and_round_trip(kv):
    stub, channel = kv
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvmesh.v1.KVService"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert register(stub).lease_ttl_ms == LEASE_MS
    register(stub, "w2")
    acks = publish(stub, batch("w1", 1, stored(CHAIN[:4])), batch("w1", 2, stored(CHAIN[4:], CHAIN[3])),
                   batch("w2", 1, stored(CHAIN[:2])))
    assert acks == [(1, pb.PUBLISH_ACTION_ACK, ""), (2, pb.PUBLISH_ACTION_ACK, ""), (1, pb.PUBLISH_ACTION_ACK, "")]
    assert lookup(stub, CHAIN) == [("w1", 6), ("w2", 2)]
    ids = list(range(24))
    r = stub.LookupTokens(pb.LookupTokensRequest(model_id="m", token_ids=ids + [1, 2]), timeout=5)
    assert (r.block_size, r.num_blocks_queried, [(w.worker_id, w.matched_blocks) for w in r.workers]) == (
        4, 6, [("w1", 6), ("w2", 2)])
    b = stub.GetBlock(pb.GetBlockRequest(block_hash=CHAIN[0]), timeout=5)
    assert (list(b.holders), b.refcount) == (["w1", "w2"], 2)
    st = stub.GetStats(pb.GetStatsRequest(), timeout=5)
    assert (st.store, st.live_workers, st.indexed_blocks, st.block_replicas, st.lookups_total) == ("redis", 2, 6, 8, 2)


def test_gap_resync_then_snapshot_over_the_stream(kv):
    stub, _ = kv
    register(stub)
    acks = publish(stub, batch("w1", 1, stored(CHAIN[:2])), batch("w1", 3, stored(CHAIN[2:], CHAIN[1])),
                   pb.PublishEventsRequest(worker_id="w1", epoch=7, seq=4, snapshot=True, snapshot_hashes=CHAIN[:3]))
    assert [a[1] for a in acks] == [pb.PUBLISH_ACTION_ACK, pb.PUBLISH_ACTION_RESYNC, pb.PUBLISH_ACTION_ACK]
    assert "seq gap: expected 2, got 3" in acks[1][2]
    assert lookup(stub, CHAIN) == [("w1", 3)]
    assert stub.GetStats(pb.GetStatsRequest(), timeout=5).resyncs_total == 1


def test_the_index_keeps_both_tiers_over_the_wire(kv):
    """Host-tier stores and removals are applied per (block, worker) beside the device's: a Lookup
    answers the host continuation (WorkerMatch.host_blocks, through the reply's cached wire bytes),
    GetBlock the holders per tier, GetStats and ListWorkers the blocks per tier, a snapshot both tiers;
    disk-tier events are counted and not kept, and a batch of them alone is no gap."""
    stub, _ = kv
    register(stub, host_blocks=64)
    host, disk = pb.KV_TIER_HOST, pb.KV_TIER_DISK

    def on(tier, hashes, removed=False):
        if removed:
            return pb.KVEvent(removed=pb.BlockRemoved(block_hashes=hashes, tier=tier))
        return pb.KVEvent(stored=pb.BlockStored(block_hashes=hashes, tier=tier))

    def tiers():
        r = stub.Lookup(pb.LookupRequest(model_id="m", block_hashes=CHAIN), timeout=5)
        return [(w.worker_id, w.matched_blocks, w.host_blocks) for w in r.workers]

    acks = publish(stub,
                   batch("w1", 1, stored(CHAIN[:4])),
                   # a device -> host move of the last two device blocks
                   batch("w1", 2, on(pb.KV_TIER_DEVICE, CHAIN[3:1:-1], removed=True), on(host, CHAIN[3:1:-1])),
                   batch("w1", 3, on(disk, CHAIN[4:])))  # disk events alone: no gap after them
    assert [a[1] for a in acks] == [pb.PUBLISH_ACTION_ACK] * 3
    assert tiers() == [("w1", 2, 2)]
    b = stub.GetBlock(pb.GetBlockRequest(block_hash=CHAIN[2]), timeout=5)
    assert (list(b.holders), b.refcount, list(b.host_holders)) == ([], 0, ["w1"])
    st = stub.GetStats(pb.GetStatsRequest(), timeout=5)
    assert (st.indexed_blocks, st.block_replicas, st.host_indexed_blocks, st.host_block_replicas) == (2, 2, 2, 2)
    (w,) = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
    assert (w.blocks_indexed, w.host_blocks_indexed, w.host_blocks) == (2, 2, 64)
    # loaded back (the host copy stays), then evicted from the host tier
    publish(stub, batch("w1", 4, stored(CHAIN[2:3], CHAIN[1])), batch("w1", 5, on(host, CHAIN[3:4], removed=True)))
    assert tiers() == [("w1", 3, 0)]
    # a snapshot replaces both tiers
    snap = batch("w1", 9, snapshot=True, snapshot_hashes=CHAIN[:1], snapshot_host_hashes=CHAIN[5:0:-1])
    assert publish(stub, snap) == [(9, pb.PUBLISH_ACTION_ACK, "")]
    assert tiers() == [("w1", 1, 5)]
    with pytest.raises(grpc.RpcError) as err:
        publish(stub, batch("w1", 10, snapshot_host_hashes=CHAIN[:1]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "without snapshot=true" in err.value.details()


def test_lease_expiry_removes_worker_from_lookup(kv):
    stub, _ = kv
    # w2 registers first: on its registration lease alone it would leave before w1, so a Lookup
    # with w1 gone and w2 still there shows that w2's heartbeats renewed its lease.
    register(stub, "w2")
    register(stub, "w1")
    publish(stub, batch("w1", 1, stored(CHAIN)), batch("w2", 1, stored(CHAIN)))

    def only_w2_left() -> bool:
        # NOTE: a heartbeat every ~0.1 s against a 2 s lease: only a stall of the whole host
        # for 2 s could let w2 lapse (its heartbeat would then fail with NOT_FOUND).
        stub.Heartbeat(pb.HeartbeatRequest(worker_id="w2", epoch=7), timeout=5)
        found = lookup(stub, CHAIN)
        assert ("w2", 6) in found
        time.sleep(0.05)
        return found == [("w2", 6)]

    wait_until(only_w2_left, 10, "w1's lease to expire")
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(pb.HeartbeatRequest(worker_id="w1", epoch=7), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "register it again" in err.value.details()


def _err(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def test_bad_input_gets_clear_status_and_leaves_index_unchanged(kv):
    stub, _ = kv
    register(stub)
    publish(stub, batch("w1", 1, stored(CHAIN[:3])))
    before = (lookup(stub, CHAIN), stub.GetStats(pb.GetStatsRequest(), timeout=5).indexed_blocks)
    INV, NF, FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION
    cases = [
        (lambda: lookup(stub, []), INV, "block_hashes is empty"),
        (lambda: lookup(stub, [b"short"]), INV, "block_hashes[0] is 5 bytes; block hashes are 16 bytes"),
        (lambda: lookup(stub, CHAIN, model=""), INV, "model_id is empty"),
        (lambda: publish(stub, batch("w1", 2, stored([CHAIN[3], b"x" * 15]))), INV,
         "events[0].stored.block_hashes[1] is 15 bytes"),
        (lambda: publish(stub, batch("w1", 2, pb.KVEvent())), INV, "events[0] sets no event"),
        (lambda: publish(stub, batch("w1", 2, stored(CHAIN[3:]), pb.KVEvent(removed=pb.BlockRemoved(
            block_hashes=CHAIN[:1], tier=9)))), INV, "events[1].removed.tier is 9, not a KVTier"),
        (lambda: publish(stub, batch("ghost", 1, stored(CHAIN))), NF, "worker 'ghost' is not registered"),
        (lambda: publish(stub, batch("w1", 1, stored(CHAIN))), FP, "seq regression for worker 'w1': got 1, last applied 1"),
        (lambda: publish(stub, batch("w1", 0, stored(CHAIN))), INV, "seq must be in [1, 2**53)"),
        (lambda: publish(stub, batch("w1", 2, stored(CHAIN), snapshot=True)), INV, "snapshot batch carries"),
        (lambda: register(stub, "w2", algo=pb.HASH_ALGORITHM_UNSPECIFIED), INV, "hash_algorithm is unset"),
        (lambda: register(stub, "w2", bs=8), FP, "block_size=4, hash=sha256_128"),
        (lambda: register(stub, "bad id!"), INV, "worker_id must be 1-128 characters"),
        (lambda: register(stub, "w2", epoch=0), INV, "epoch must be in [1, 2**53)"),
        (lambda: register(stub, "w2", nb=0), INV, "num_blocks must be >= 1"),
        (lambda: stub.GetBlock(pb.GetBlockRequest(block_hash=b"abc"), timeout=5), INV, "block_hash is 3 bytes"),
        (lambda: stub.FlushWorker(pb.FlushWorkerRequest(worker_id="ghost"), timeout=5), NF, "not registered"),
        (lambda: stub.LookupTokens(pb.LookupTokensRequest(model_id="m", token_ids=[1, 2, 3, 2**31]), timeout=5), INV,
         "token_ids[3] is 2147483648; token ids are < 2**31"),
        (lambda: register(stub, "w2", algo=99), INV, "hash_algorithm is 99, which is not a known algorithm"),
        (lambda: stub.LookupTokens(pb.LookupTokensRequest(model_id="m", token_ids=[1, 2]), timeout=5), INV,
         "make no full block of 4"),
        (lambda: reserve(stub, router_id=""), INV, "router_id must be 1-128 characters"),
        (lambda: reserve(stub, request_id="r\n1"), INV, "request_id 'r\\n1' is not printable ASCII"),
        (lambda: reserve(stub, request_id="r" * 257), INV, "request_id has 257 characters; at most 256"),
        (lambda: reserve(stub, prefill_tokens=2**41), INV, "prefill_tokens must be in [0, 2**40]"),
        (lambda: reserve(stub, worker_id="ghost"), NF, "worker 'ghost' is not a live worker of model 'm'"),
        (lambda: reserve(stub, model_id="other"), NF, "worker 'w1' is not a live worker of model 'other'"),
        (lambda: stub.Heartbeat(pb.HeartbeatRequest(worker_id="w1", epoch=7, load=common_pb2.WorkerLoad(
            admitted_request_ids=["ok", "bad\x00"])), timeout=5), INV, "load.admitted_request_ids[1]"),
        (lambda: stub.Heartbeat(pb.HeartbeatRequest(worker_id="w1", epoch=7, load=common_pb2.WorkerLoad(
            adapters=[common_pb2.AdapterResidency(name="ok"), common_pb2.AdapterResidency(name="")])), timeout=5),
         INV, "load.adapters[1].name must be 1-256 printable characters"),
        (lambda: stub.Heartbeat(pb.HeartbeatRequest(worker_id="w1", epoch=7, load=common_pb2.WorkerLoad(
            adapters=[common_pb2.AdapterResidency(name=f"a{i}") for i in range(1025)])), timeout=5),
         INV, "load.adapters lists 1025 adapters; at most 1024"),
        (lambda: register(stub, "w2", engine="no spaces"), INV, "engine must be 1-32 characters"),
    ]
    for call, code, message in cases:
        got_code, details = _err(call)
        assert (got_code, message in details) == (code, True), (details, message)
    # A model no live worker serves: an empty answer from both lookups, never an error.
    unknown = stub.LookupTokens(pb.LookupTokensRequest(model_id="nope", token_ids=[1] * 8), timeout=5)
    assert (list(unknown.workers), unknown.block_size) == ([], 0)
    assert lookup(stub, CHAIN, model="nope") == []
    after = (lookup(stub, CHAIN), stub.GetStats(pb.GetStatsRequest(), timeout=5).indexed_blocks)
    assert after == before == ([("w1", 3)], 3)
    answer = stub.Lookup(pb.LookupRequest(model_id="m", block_hashes=CHAIN), timeout=5)
    assert not answer.workers[0].HasField("pending")  # no refused Reserve left a pick
    # A good Reserve is seen by the next Lookup; a stale conditional one is refused with the news.
    assert reserve(stub, request_id="ok", router_id="ra", seen_version=0).reserved
    pending = stub.Lookup(pb.LookupRequest(model_id="m", block_hashes=CHAIN), timeout=5).workers[0].pending
    assert (pending.requests, pending.prefill_tokens, pending.blocks, pending.version) == (1, 10, 1, 1)
    refused = reserve(stub, request_id="late", router_id="rb", seen_version=0)
    assert not refused.reserved and [(w.worker_id, w.pending.requests) for w in refused.workers] == [("w1", 1)]
    listed = stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers[0]
    assert (listed.engine, listed.pending.requests) == ("kvmesh", 1)
    # The stream that failed did not poison the next one.
    assert publish(stub, batch("w1", 2, stored(CHAIN[3:], CHAIN[2])))[0][1] == pb.PUBLISH_ACTION_ACK


class _OpenStream:
    """A PublishEvents stream held open, as a worker holds it for its whole life."""

    def __init__(self, stub, wid: str) -> None:
        import queue

        self._q: queue.Queue = queue.Queue()
        self._q.put(batch(wid, 1, pb.KVEvent(all_cleared=pb.AllBlocksCleared())))
        self.call = stub.PublishEvents(iter(self._q.get, None), timeout=30)

    def first_ack(self):
        return next(self.call)

    def close(self) -> None:
        self._q.put(None)
        list(self.call)


def test_open_publisher_streams_past_32_leave_lookup_and_heartbeat_answered(redis_url, redis_namespace):
    """40 workers streaming events at once (a sync server of 32 threads would have none left)."""
    server = KVServiceServer(RedisIndex(redis_url, redis_namespace), "127.0.0.1", free_port()).start()
    channel = dial(f"127.0.0.1:{server.port}")
    stub = pb_grpc.KVServiceStub(channel)
    try:
        streams = []
        for i in range(40):
            register(stub, f"w{i}")
            streams.append(_OpenStream(stub, f"w{i}"))
            assert streams[-1].first_ack().action == pb.PUBLISH_ACTION_ACK
        assert stub.Heartbeat(pb.HeartbeatRequest(worker_id="w39", epoch=7), timeout=5).lease_ttl_ms > 0
        assert sorted(lookup(stub, CHAIN)) == sorted((f"w{i}", 0) for i in range(40))
        assert len(stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers) == 40
        for s in streams:
            s.close()
    finally:
        channel.close()
        server.stop(0.5)


def test_publishers_past_max_publishers_get_resource_exhausted_until_one_leaves(redis_url, redis_namespace):
    server = KVServiceServer(RedisIndex(redis_url, redis_namespace), "127.0.0.1", free_port(),
                             max_publishers=2).start()
    channel = dial(f"127.0.0.1:{server.port}")
    stub = pb_grpc.KVServiceStub(channel)
    try:
        for wid in ("a", "b", "c"):
            register(stub, wid)
        a, b = _OpenStream(stub, "a"), _OpenStream(stub, "b")
        assert a.first_ack().seq == 1 and b.first_ack().seq == 1
        code, details = _err(lambda: publish(stub, batch("c", 1, stored(CHAIN[:2]))))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already serves 2 publishing workers" in details and "--max-publishers" in details
        assert dict(lookup(stub, CHAIN)) == {"a": 0, "b": 0, "c": 0}  # unary calls still answered at the limit
        a.close()
        deadline = time.monotonic() + 5
        while True:  # the slot comes back once the server has wound the closed stream down
            try:
                assert publish(stub, batch("c", 1, stored(CHAIN[:2]))) == [(1, pb.PUBLISH_ACTION_ACK, "")]
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)
        assert dict(lookup(stub, CHAIN)) == {"a": 0, "b": 0, "c": 2}
        b.close()
    finally:
        channel.close()
        server.stop(0.5)


def test_injected_latency_answers_late_and_lands_the_pick_halfway(redis_url, redis_namespace):
    """--lookup-delay-ms / --reserve-delay-ms (the shared view's stress setting): a caller whose deadline is
    shorter than the delay gets DEADLINE_EXCEEDED; the Reserve it gave up on still lands, half the delay in."""
    server = KVServiceServer(RedisIndex(redis_url, redis_namespace), "127.0.0.1", free_port(),
                             ServiceConfig(lease_ttl_ms=10_000),
                             faults=FaultConfig(lookup_delay_ms=2000, reserve_delay_ms=2000)).start()
    channel = dial(f"127.0.0.1:{server.port}")
    stub = pb_grpc.KVServiceStub(channel)
    try:
        register(stub)
        for call in (lambda: stub.Lookup(pb.LookupRequest(model_id="m", block_hashes=CHAIN), timeout=0.5),
                     lambda: stub.Reserve(pb.ReserveRequest(model_id="m", worker_id="w1", router_id="ra",
                                                            request_id="r1", prefill_tokens=10, blocks=1),
                                          timeout=0.5)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers[0].pending.version == 1,
                   timeout=5)
        # A caller that waits out the delay gets its answer, with the pick in it.
        answer = stub.Lookup(pb.LookupRequest(model_id="m", block_hashes=CHAIN), timeout=10)
        assert [(w.worker_id, w.pending.requests, w.pending.version) for w in answer.workers] == [("w1", 1, 1)]
    finally:
        channel.close()
        server.stop(0.5)
