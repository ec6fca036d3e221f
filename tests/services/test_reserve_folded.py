"""The Reserve folded into the Lookup (issue 45, docs/router.md "The hop in bare hops"): the Lookup
carries the pick the router would make from its own view, reserved in the same call; when the answer
confirms it no Reserve round trip follows, and when the answer moves the pick the claim releases it.
A real router, kv_service, Redis and workers."""

from __future__ import annotations

import time

from kvmesh.contract.types import SamplingParams
from kvmesh.router.generate_types import GenerateInput
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc
from tests.support import wait_until


def claims(router, outcome: str) -> float:
    return router.metrics.reservations.labels(outcome)._value.get()


def pending(kv_address: str, model_id: str) -> dict[str, int]:
    stub = kv_grpc.KVServiceStub(dial(kv_address))
    answer = stub.Lookup(kv_pb.LookupRequest(model_id=model_id, block_hashes=[b"\0" * 16]), timeout=5)
    return {w.worker_id: w.pending.requests for w in answer.workers}


def test_a_confirmed_pick_sends_no_reserve_and_leaves_nothing_pending(kv_server, start_worker, start_router):
    kv = f"127.0.0.1:{kv_server.port}"
    for i in range(2):
        start_worker(f"w{i}", kv)
    router = start_router(kv, fold_reserve=True)
    stub = router_pb2_grpc.RouterStub(dial(f"127.0.0.1:{router.port}"))
    for k in range(8):
        ids = [(k * 31 + j) % 300 + 3 for j in range(40)]
        out = list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                            sampling=common_pb2.SamplingParams(max_tokens=2)),
                                 timeout=60))
        assert out[-1].finish_reason
    # one reservation per request, no conflict (one router); the first had no answer to guess from, and of
    # the others most picks were the Lookup's own (a guess the answer moves costs the Reserve of before)
    assert claims(router, "folded") + claims(router, "reserved") == 8 and claims(router, "conflict") == 0
    assert claims(router, "folded") >= 5
    model = router.router.pool.model_spec().model_id
    wait_until(lambda: set(pending(kv, model).values()) == {0}, what="the workers' reports retire every pick")


def test_a_pick_the_answer_moves_is_released_where_the_lookup_reserved_it(kv_server, start_worker, start_router):
    """w1 holds prefixes the router never routed (served straight): its own view guesses by load, the
    answer's matches move the pick to w1, and the claim there drops the guess. Picks only (nothing forwarded):
    one pending pick per request, every one on w1."""
    kv = f"127.0.0.1:{kv_server.port}"
    workers = [start_worker(f"w{i}", kv) for i in range(2)]
    router = start_router(kv, speculative_ttl_s=0.0, fold_reserve=True)
    stub = worker_pb2_grpc.WorkerStub(dial(workers[1].address))
    prefixes = [[(p * 17 + j) % 300 + 3 for j in range(64)] for p in range(6)]
    for p, ids in enumerate(prefixes):
        list(stub.Generate(worker_pb2.WorkerGenerateRequest(request_id=f"warm{p}", prompt_token_ids=ids,
                                                            sampling=common_pb2.SamplingParams(max_tokens=1)),
                           timeout=60))
    model = router.router.pool.model_spec().model_id
    time.sleep(0.5)  # the events reach the index
    # one answer seen, so the next Lookups carry a pick
    router.run(router.router.decide(GenerateInput(None, [5] * 20, SamplingParams(max_tokens=2))))
    before = pending(kv, model)
    for ids in prefixes:
        plan, decision = router.run(router.router.decide(GenerateInput(None, ids + [9] * 8,
                                                                      SamplingParams(max_tokens=2))))
        assert decision.worker_id == "w1"
        router.router.core.finish(plan.ticket)  # never forwarded
    after = pending(kv, model)
    assert after["w1"] - before["w1"] == len(prefixes) and after["w0"] == before["w0"]
    # at least one guess was w0 (w1's picks pile up in the router's view) and was released
    assert claims(router, "reserved") >= 1
    assert claims(router, "folded") + claims(router, "reserved") == len(prefixes) + 1
