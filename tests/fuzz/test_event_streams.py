"""Malformed event batches are refused and leave the index exactly as it was (both stores).

A fake worker registers and stores a known chain; every bad batch is then sent on its own stream
and the index (GetStats, the worker's row, the holders of each block) is compared before/after.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from tests.fuzz.conftest import assert_serving

C = grpc.StatusCode
HELD = [bytes([i]) * 16 for i in range(1, 6)]
EPOCH = 1000


def batch(seq: int, events=(), epoch: int = EPOCH, worker_id: str = "ev1", **kw) -> kpb.PublishEventsRequest:
    return kpb.PublishEventsRequest(worker_id=worker_id, epoch=epoch, seq=seq, events=list(events), **kw)


def stored(*hashes: bytes) -> kpb.KVEvent:
    return kpb.KVEvent(stored=kpb.BlockStored(block_hashes=list(hashes)))


def send(stub, req: kpb.PublishEventsRequest) -> kpb.PublishEventsResponse:
    return next(stub.PublishEvents(iter([req]), timeout=5))


def state(stub) -> tuple:
    st_ = stub.GetStats(kpb.GetStatsRequest(), timeout=5)
    me = [(w.epoch, w.last_seq, w.blocks_indexed, w.live)
          for w in stub.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers if w.worker_id == "ev1"]
    holders = [tuple(stub.GetBlock(kpb.GetBlockRequest(block_hash=h), timeout=5).holders)
               for h in [*HELD, b"\x77" * 16]]
    return st_.live_workers, st_.indexed_blocks, st_.block_replicas, me, holders


@pytest.fixture
def held(kv_address):
    stub = kpb_grpc.KVServiceStub(dial(kv_address))
    stub.RegisterWorker(kpb.RegisterWorkerRequest(worker_id="ev1", address="127.0.0.1:1", model_id="ev-model",
                                                  block_size=16, hash_algorithm=kpb.HASH_ALGORITHM_SHA256_128,
                                                  num_blocks=64, epoch=EPOCH), timeout=5)
    assert send(stub, batch(1, [kpb.KVEvent(all_cleared=kpb.AllBlocksCleared()), stored(*HELD)])).action == \
        kpb.PUBLISH_ACTION_ACK
    before = state(stub)
    assert before[3] == [(EPOCH, 1, 5, True)] and before[4] == [("ev1",)] * 5 + [()]
    return stub, before, kv_address


BAD = {
    "hash of 15 bytes": (batch(2, [stored(b"\x77" * 16, b"\x01" * 15)]), C.INVALID_ARGUMENT),
    "parent hash of 3 bytes": (batch(2, [kpb.KVEvent(stored=kpb.BlockStored(block_hashes=[b"\x77" * 16],
                                                                            parent_hash=b"abc"))]),
                               C.INVALID_ARGUMENT),
    "removal with a 17-byte hash": (batch(2, [kpb.KVEvent(removed=kpb.BlockRemoved(
        block_hashes=[HELD[0], b"\x01" * 17]))]), C.INVALID_ARGUMENT),
    "event with no kind": (batch(2, [stored(b"\x77" * 16), kpb.KVEvent()]), C.INVALID_ARGUMENT),
    "unknown worker": (batch(2, [stored(b"\x77" * 16)], worker_id="nobody"), C.NOT_FOUND),
    "seq regression": (batch(1, [kpb.KVEvent(removed=kpb.BlockRemoved(block_hashes=HELD))]),
                       C.FAILED_PRECONDITION),
    "older epoch": (batch(9, [stored(b"\x77" * 16)], epoch=EPOCH - 1), C.FAILED_PRECONDITION),
    "snapshot for a dead epoch": (batch(9, epoch=EPOCH - 1, snapshot=True, snapshot_hashes=[b"\x77" * 16]),
                                  C.FAILED_PRECONDITION),
    "snapshot with events": (batch(2, [stored(b"\x77" * 16)], snapshot=True), C.INVALID_ARGUMENT),
    "snapshot hashes without snapshot": (batch(2, snapshot_hashes=[b"\x77" * 16]), C.INVALID_ARGUMENT),
    "snapshot with a short hash": (batch(2, snapshot=True, snapshot_hashes=[b"\x77" * 16, b"x"]),
                                   C.INVALID_ARGUMENT),
    "seq 0": (batch(0, [stored(b"\x77" * 16)]), C.INVALID_ARGUMENT),
    "epoch 2**53": (batch(2, [stored(b"\x77" * 16)], epoch=2**53), C.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_batch_is_refused_and_changes_nothing(held, case):
    stub, before, _ = held
    req, code = BAD[case]
    with pytest.raises(grpc.RpcError) as err:
        send(stub, req)
    assert err.value.code() == code, err.value.details()
    assert state(stub) == before
    # The worker's next batch on a new stream still applies: the refusal cost it nothing.
    assert send(stub, batch(2, [stored(b"\x77" * 16)])).action == kpb.PUBLISH_ACTION_ACK


@pytest.mark.parametrize("req", [batch(5, [stored(b"\x77" * 16)]), batch(2, [stored(b"\x77" * 16)], epoch=EPOCH + 1)],
                         ids=["seq gap", "newer epoch"])
def test_gap_or_newer_epoch_asks_for_a_snapshot_and_changes_nothing(held, req):
    stub, before, _ = held
    resp = send(stub, req)
    assert resp.action == kpb.PUBLISH_ACTION_RESYNC and resp.seq == req.seq
    assert state(stub) == before


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases=st.lists(st.sampled_from(list(BAD)), min_size=1, max_size=5),
       junk=st.lists(st.binary(max_size=40), max_size=3))
def test_any_sequence_of_bad_batches_changes_nothing(held, cases, junk):
    stub, before, address = held
    for case in cases:
        req = kpb.PublishEventsRequest()
        req.CopyFrom(BAD[case][0])
        req.snapshot_hashes.extend(junk if req.snapshot else [])
        with pytest.raises(grpc.RpcError) as err:
            send(stub, req)
        assert err.value.code() not in (C.INTERNAL, C.UNKNOWN)
    assert state(stub) == before
    assert_serving(address)
