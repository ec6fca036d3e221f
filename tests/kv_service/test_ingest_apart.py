"""Reads apart from ingest (issue 49): a Lookup, a Reserve and a heartbeat are answered while an event
batch is held in the middle of its apply, and the batch lands whole, in order, once let go.

The hold is a store writer whose publish blocks the thread it runs on until the test lets it go, as
a long apply holds its event loop (it waits without the GIL, as an apply waiting on I/O does). With
``--ingest-loop apart`` and the batches put back on the serving loop by any change, nothing else is
answered meanwhile: the Lookup below never returns while the hold lasts, and the test fails on the
Lookup's deadline."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.kv_service.config import RedisStoreConfig, ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import free_port
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

CHAIN = BlockHasher("m", 4).hash_prompt(list(range(24)))
HOLD_S = 60
"""How long a held apply waits at most for the test to let it go (a failing test must still end)."""


def register(stub, wid: str) -> None:
    stub.RegisterWorker(pb.RegisterWorkerRequest(
        worker_id=wid, address="127.0.0.1:50061", model_id="m", block_size=4, hash_algorithm=pb.HASH_ALGORITHM_SHA256_128,
        num_blocks=1000, epoch=7), timeout=10)


def batch(wid: str, seq: int, hashes: list[bytes], parent: bytes = b"") -> pb.PublishEventsRequest:
    return pb.PublishEventsRequest(worker_id=wid, epoch=7, seq=seq, events=[
        pb.KVEvent(stored=pb.BlockStored(block_hashes=hashes, parent_hash=parent))])


def publish(stub, *batches: pb.PublishEventsRequest) -> list[tuple[int, int]]:
    return [(r.seq, r.action) for r in stub.PublishEvents(iter(batches), timeout=HOLD_S)]


def lookup(stub) -> list[tuple[str, int]]:
    r = stub.Lookup(pb.LookupRequest(model_id="m", block_hashes=CHAIN), timeout=10)
    return [(w.worker_id, w.matched_blocks) for w in r.workers]


class HeldWriter(RedisIndex):
    """A RedisIndex whose publish, once ``armed``, says it ``entered`` and blocks its thread until ``release``."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.loop_thread: str | None = None

    async def publish(self, *args, **kw):
        self.loop_thread = threading.current_thread().name
        if self.armed:
            self.entered.set()
            self.release.wait(HOLD_S)  # NOTE: blocks the loop it runs on, as a long apply does
        return await super().publish(*args, **kw)


class HoldingIndex(RedisIndex):
    """The Redis store, whose writer is a HeldWriter of the same namespace."""

    def writer(self) -> HeldWriter | None:
        if self.ingest_loop != "apart":
            return None
        self.held = HeldWriter(self.url, self.namespace, ingest_loop="shared")
        return self.held


@pytest.fixture
def kv(redis_url, redis_namespace):
    index = HoldingIndex(redis_url, redis_namespace, ingest_loop="apart")
    server = KVServiceServer(index, "127.0.0.1", free_port(), ServiceConfig(lease_ttl_ms=60_000)).start()
    channel = dial(f"127.0.0.1:{server.port}")
    yield pb_grpc.KVServiceStub(channel), index
    index.held.release.set()
    channel.close()
    server.stop(0.5)


def test_reads_are_answered_while_a_batch_is_held(kv):
    stub, index = kv
    register(stub, "w1")
    register(stub, "w2")
    ack = pb.PUBLISH_ACTION_ACK
    assert publish(stub, batch("w1", 1, CHAIN[:2]), batch("w2", 1, CHAIN[:1])) == [(1, ack), (1, ack)]
    held = index.held
    assert held.loop_thread == "kv-ingest"
    held.armed = True
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(publish, stub, batch("w1", 2, CHAIN[2:], CHAIN[1]))
        assert held.entered.wait(HOLD_S), "the batch never reached the store's writer"
        try:
            # NOTE: the batch is held: every read answers the index as it was before it
            assert lookup(stub) == [("w1", 2), ("w2", 1)]
            assert stub.Reserve(pb.ReserveRequest(model_id="m", worker_id="w2", router_id="ra", request_id="r1",
                                                  prefill_tokens=10, blocks=1), timeout=10).reserved
            assert not stub.Heartbeat(pb.HeartbeatRequest(worker_id="w2", epoch=7), timeout=10).resync
            assert not pending.done()
        finally:
            held.release.set()
        assert pending.result(HOLD_S) == [(2, ack)]
    held.armed = False
    assert lookup(stub) == [("w1", 6), ("w2", 1)]
    # the worker's order holds across the hold: a gap is still a gap, the next seq still applies
    assert publish(stub, batch("w1", 4, CHAIN[:1])) == [(4, pb.PUBLISH_ACTION_RESYNC)]
    assert publish(stub, batch("w1", 3, CHAIN[:1])) == [(3, ack)]


def test_the_writer_is_the_same_index_through_connections_of_its_own(redis_url, redis_namespace):
    index = RedisIndex(redis_url, redis_namespace, max_blocks_per_call=7, shards=3, lookup_walk="linear",
                       ingest_loop="apart")
    writer = index.writer()
    assert isinstance(writer, RedisIndex) and writer is not index and writer.redis is not index.redis
    assert (writer.namespace, writer.shards, writer.max_blocks_per_call, writer.lookup_walk, writer.writer()) == (
        redis_namespace, 3, 7, "linear", None)
    assert RedisIndex(redis_url, redis_namespace).writer() is None
    assert RedisStoreConfig().ingest_loop == "shared"
    with pytest.raises(ValueError, match="--ingest-loop must be one of apart, shared"):
        RedisStoreConfig(ingest_loop="thread").check()
