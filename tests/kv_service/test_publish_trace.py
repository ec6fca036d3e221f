"""A worker's event stream is no trace per batch (issue 50, docs/tracing.md "Event batches"): a PublishEvents
stream is a ``kv.publish_events`` server span per window of batches, a ``kv.batch`` event per batch, each
window linked to the one before it. A real kv_service (memory store) in this process, tracing on with its
spans in memory."""

from __future__ import annotations

import pytest

from kvmesh.kv_service import publish_trace
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.loopback import free_port
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc
from tests.support.tracing import spans_named, tracing_in_memory

RPC = {"rpc.system": "grpc", "rpc.service": "kvmesh.v1.KVService", "rpc.method": "PublishEvents"}


def stored(seq: int) -> pb.KVEvent:
    return pb.KVEvent(stored=pb.BlockStored(block_hashes=[seq.to_bytes(16, "big")]))


@pytest.fixture
def stub(monkeypatch):
    server = KVServiceServer(MemoryIndex(), "127.0.0.1", free_port()).start()
    channel = dial(f"127.0.0.1:{server.port}")
    stub = pb_grpc.KVServiceStub(channel)
    stub.RegisterWorker(pb.RegisterWorkerRequest(
        worker_id="w1", address="127.0.0.1:1", model_id="m", block_size=4,
        hash_algorithm=pb.HASH_ALGORITHM_SHA256_128, num_blocks=100, epoch=1), timeout=5)
    yield stub
    channel.close()
    server.stop(0.5)


def publish(stub, seqs: range) -> list[int]:
    batches = [pb.PublishEventsRequest(worker_id="w1", epoch=1, seq=s, events=[stored(s)]) for s in seqs]
    return [r.seq for r in stub.PublishEvents(iter(batches), timeout=5)]


def test_a_stream_of_batches_is_windows_of_one_span_with_an_event_per_batch(monkeypatch, stub):
    spans = tracing_in_memory(monkeypatch)
    monkeypatch.setattr(publish_trace, "WINDOW_BATCHES", 4)
    assert publish(stub, range(1, 11)) == list(range(1, 11))
    windows = sorted(spans_named(spans, "kv.publish_events"), key=lambda s: s.start_time)
    assert [len(w.events) for w in windows] == [4, 4, 2]  # ten batches, three spans: no trace per batch
    assert [e.attributes["kvmesh.seq"] for w in windows for e in w.events] == list(range(1, 11))
    assert {e.name for w in windows for e in w.events} == {"kv.batch"}
    assert all(e.attributes["kvmesh.action"] == "ack" for w in windows for e in w.events)
    for before, after in zip(windows, windows[1:], strict=False):
        assert [link.context.span_id for link in after.links] == [before.context.span_id]
    for w in windows:
        assert w.kind.name == "SERVER" and {k: w.attributes[k] for k in RPC} == RPC
        assert w.attributes["rpc.grpc.status_code"] == 0 and w.attributes["kvmesh.worker_id"] == "w1"
    assert not spans_named(spans, "kv.apply_events")
    assert {s.name for s in spans.get_finished_spans() if s.parent is None} == {"kv.publish_events"}


def test_a_stream_that_fails_ends_its_window_with_error_status(monkeypatch, stub):
    spans = tracing_in_memory(monkeypatch)
    bad = pb.PublishEventsRequest(worker_id="w1", epoch=1, seq=1, snapshot_hashes=[b"x" * 16])
    with pytest.raises(Exception, match="snapshot"):
        list(stub.PublishEvents(iter([bad]), timeout=5))
    (window,) = spans_named(spans, "kv.publish_events")
    assert window.status.status_code.name == "ERROR" and window.attributes["rpc.grpc.status_code"] == 3
    assert window.attributes["error.type"] == "InvalidArgument"
