"""A worker's load reaches routers through the event stream, not only through heartbeats.

The kv_service here has a 60 s lease, so the worker heartbeats every 20 s: once at registration,
then not again during the test. Whatever load a Lookup shows after that came with the worker's
event batches (or a load-only message when the load changed without events).
"""

from __future__ import annotations

import threading

import pytest

from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from kvmesh.v1 import worker_pb2 as pb
from kvmesh.v1 import worker_pb2_grpc as pb_grpc
from tests.support import wait_until


@pytest.mark.parametrize("kv_server", [60_000], indirect=True)  # heartbeats 20 s apart
def test_lookup_sees_a_running_request_and_its_end_without_a_heartbeat(kv_server, start_worker):
    kv = kpb_grpc.KVServiceStub(dial(f"127.0.0.1:{kv_server.port}"))
    worker = start_worker("w1", f"127.0.0.1:{kv_server.port}")
    (info,) = kv.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers
    assert info.load.num_running == 0 and info.lease_remaining_ms > 50_000

    def load() -> common_pb2.WorkerLoad:
        (match,) = kv.Lookup(kpb.LookupRequest(model_id=info.model_id, block_hashes=[b"\x01" * 16]),
                             timeout=5).workers
        return match.load

    stub = pb_grpc.WorkerStub(dial(worker.address))
    # NOTE: long enough (hundreds of decode steps on the tiny model) to be seen running; the
    # decode steps of one request fill a block every 16 tokens, so events flow while it runs.
    call = stub.Generate(pb.WorkerGenerateRequest(prompt_token_ids=list(range(5, 69)), sampling=common_pb2.SamplingParams(
        max_tokens=440, ignore_eos=True)), timeout=120)
    done = threading.Event()
    threading.Thread(target=lambda: (list(call), done.set()), daemon=True).start()
    wait_until(lambda: load().num_running == 1 or done.is_set(), 20, "the index to show the running request")
    assert not done.is_set(), "the request finished before its load was seen: the test saw nothing"
    assert load().steps_total > 0  # the work counters ride along (routers learn step costs from them)
    assert done.wait(120)
    # Finishing stores no block: the load-only message reports the idle worker.
    wait_until(lambda: load().num_running == 0, 5, "the index to show the worker idle again")
    (after,) = kv.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers
    assert after.lease_remaining_ms > 40_000  # still the registration's lease: no heartbeat ran
