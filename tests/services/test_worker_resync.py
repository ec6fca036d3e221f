"""The worker's side of a resync: after the kv_service answers RESYNC, or after its own event queue
overflows, the worker sends a snapshot and the index equals its cache again.

The worker is the real WorkerServer on the tiny model, the kv_service the real one on Redis. A
lost batch is made by a gRPC hop between them that forwards every call and drops one
PublishEvents message: the worker cannot tell, only the kv_service's seq check can.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from kvmesh.v1 import worker_pb2 as pb
from kvmesh.v1 import worker_pb2_grpc as pb_grpc
from tests.support import wait_until

PUBLISH = "/kvmesh.v1.KVService/PublishEvents"


class LossyHop(grpc.GenericRpcHandler):
    """Forwards every call to ``target`` unchanged, except that it drops the next PublishEvents
    message for which ``drop_next(predicate)``'s predicate holds."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._predicate: Callable[[kpb.PublishEventsRequest], bool] | None = None
        self._lock = threading.Lock()
        self.dropped: list[kpb.PublishEventsRequest] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        self.server.add_generic_rpc_handlers([self])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def drop_next(self, predicate: Callable[[kpb.PublishEventsRequest], bool]) -> None:
        with self._lock:
            self._predicate = predicate

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if details.method == PUBLISH:
            return grpc.stream_stream_rpc_method_handler(self._publish, kpb.PublishEventsRequest.FromString,
                                                         kpb.PublishEventsResponse.SerializeToString)
        return grpc.unary_unary_rpc_method_handler(self._unary(details.method))  # bytes in, bytes out

    def _unary(self, method: str) -> Callable:
        call = self._channel.unary_unary(method)

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                return call(request, timeout=context.time_remaining(), metadata=context.invocation_metadata())
            except grpc.RpcError as err:
                context.abort(err.code(), err.details())

        return forward

    def _publish(self, requests: Iterator[kpb.PublishEventsRequest], context: grpc.ServicerContext):
        def passed() -> Iterator[kpb.PublishEventsRequest]:
            for req in requests:
                with self._lock:
                    drop = self._predicate is not None and self._predicate(req)
                    if drop:
                        self._predicate = None
                        self.dropped.append(req)
                if not drop:
                    yield req

        call = kpb_grpc.KVServiceStub(self._channel).PublishEvents(passed(), metadata=context.invocation_metadata())
        context.add_callback(call.cancel)
        try:
            yield from call
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                context.abort(err.code(), err.details())

    def stop(self) -> None:
        self.server.stop(0)
        self._channel.close()


@pytest.fixture
def hop(kv_server) -> Iterator[LossyHop]:
    h = LossyHop(f"127.0.0.1:{kv_server.port}")
    yield h
    h.stop()


def prompt(k: int, n: int = 70) -> list[int]:
    return [(13 * i + 31 * k) % 250 + 5 for i in range(n)]


def generate(worker, ids: list[int], max_tokens: int = 4) -> None:
    stub = pb_grpc.WorkerStub(dial(worker.address))
    list(stub.Generate(pb.WorkerGenerateRequest(prompt_token_ids=ids, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True)), timeout=60))


def index_equals_cache(kv: kpb_grpc.KVServiceStub, worker) -> bool:
    """The index holds exactly the worker's cached blocks (one worker: no other holder)."""
    cached = worker.engine.cached_block_hashes()
    held = {h for h in cached if worker.worker_id in kv.GetBlock(kpb.GetBlockRequest(block_hash=h), timeout=5).holders}
    st = kv.GetStats(kpb.GetStatsRequest(), timeout=5)
    return held == cached and st.indexed_blocks == st.block_replicas == len(cached)


def stored_in(req: kpb.PublishEventsRequest) -> set[bytes]:
    return {h for e in req.events if e.HasField("stored") for h in e.stored.block_hashes}


def test_resync_answer_gets_a_snapshot_that_restores_the_lost_batch(kv_server, hop, start_worker):
    kv = kpb_grpc.KVServiceStub(dial(f"127.0.0.1:{kv_server.port}"))
    worker = start_worker("w1", hop.address)
    generate(worker, prompt(1))
    wait_until(lambda: index_equals_cache(kv, worker), what="the index to hold the first prompt")
    resyncs = kv.GetStats(kpb.GetStatsRequest(), timeout=5).resyncs_total
    hop.drop_next(lambda req: bool(stored_in(req)))
    generate(worker, prompt(2))  # its blocks travel in the batch the hop loses
    wait_until(lambda: hop.dropped, what="the hop to lose a batch")
    lost = stored_in(hop.dropped[0])
    assert lost and lost <= worker.engine.cached_block_hashes()
    # The next message (the load report of the finished request, or prompt 3's batch) arrives one
    # seq too far: RESYNC. The worker's snapshot brings back the lost blocks along with everything
    # else it caches.
    generate(worker, prompt(3))
    wait_until(lambda: index_equals_cache(kv, worker), what="the index to equal the worker's cache after a resync")
    assert kv.GetStats(kpb.GetStatsRequest(), timeout=5).resyncs_total > resyncs
    assert all(worker.worker_id in kv.GetBlock(kpb.GetBlockRequest(block_hash=h), timeout=5).holders for h in lost)


def test_event_queue_overflow_sends_a_snapshot(kv_server, start_worker, monkeypatch, caplog):
    kv = kpb_grpc.KVServiceStub(dial(f"127.0.0.1:{kv_server.port}"))
    worker = start_worker("w1", f"127.0.0.1:{kv_server.port}")
    generate(worker, prompt(1))
    wait_until(lambda: index_equals_cache(kv, worker), what="the index to hold the first prompt")
    # A kv_service that falls behind, made small: the stream takes a batch at most once a second
    # and the queue overflows past 2 batches, so the steps of a few concurrent requests overflow it.
    worker.publisher.batcher.max_queued = 2
    worker.publisher.batcher.interval_s = 1.0
    caplog.set_level(logging.WARNING, logger="kvmesh.worker.publisher")
    threads = [threading.Thread(target=generate, args=(worker, prompt(10 + k, 40 + 7 * k), 40)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert any("dropping queued events for a snapshot" in r.getMessage() for r in caplog.records), \
        "the event queue never overflowed: the test did not test anything"
    wait_until(lambda: index_equals_cache(kv, worker), 15, "the index to equal the worker's cache after the overflow")
