"""The miss audit (issue 35; docs/router.md, "Miss audit"): the router compares, per request, the blocks
the index said the chosen worker holds with the cached tokens the engine reports, counts per worker,
warns when a worker's mismatch rate over a window passes --audit-miss-rate, and reports its counts to
the kv_service, where `kvmesh admin audit` reads them.

Each known cause of a silent miss is planted in a real worker (real Redis, kv_service, tiny-model
workers, an in-process router): evictions the index never hears of, and a worker that hashes its
blocks under another root (its cache hits are then unseen by the index). The third cause, a bridge
whose engine event stream stops, runs against real vLLM: tests/vllm/test_vllm_workers.py. A healthy
run raises no alarm.
"""

from __future__ import annotations

import logging
import random

import pytest

from kvmesh.client import Client
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import BlockRemoved
from kvmesh.kv_client.admin_client import AdminClient
from kvmesh.router.server import RouterServer
from tests.support import wait_until

WINDOW, RATE = 12, 0.5


@pytest.fixture
def router_on(start_router):
    """A router auditing over a window of WINDOW requests at --audit-miss-rate RATE."""
    return lambda kv_address: start_router(kv_address, router_kw={"audit_window": WINDOW, "audit_miss_rate": RATE})


def workload(seed: int, prefixes: int, rounds: int, prefix_blocks: int = 3) -> list[list[int]]:
    """``rounds`` passes over ``prefixes`` prompts of ``prefix_blocks`` shared blocks plus a block of their own."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 600) for _ in range(16 * prefix_blocks)] for _ in range(prefixes)]
    return [head + [rng.randrange(3, 600) for _ in range(16)] for _ in range(rounds) for head in heads]


def serve(router: RouterServer, prompts: list[list[int]]) -> None:
    with Client(f"127.0.0.1:{router.port}", timeout=60) as c:
        for ids in prompts:
            c.generate(ids, max_tokens=2, ignore_eos=True)


def audit_of(kv_address: str, worker_id: str, requests: int):
    """The kv_service's sums for the worker once the router reported ``requests`` of them."""
    admin = AdminClient(kv_address)
    wait_until(lambda: admin.audit().get(worker_id) is not None and admin.audit()[worker_id].requests >= requests,
               timeout=10, what="the router's audit report")
    return admin.audit()[worker_id]


def alarms(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "miss audit" in r.getMessage()]


def test_a_healthy_run_raises_no_alarm_and_predictions_match_the_engine(kv_server, start_worker, router_on, caplog):
    caplog.set_level(logging.WARNING, logger="kvmesh.router")
    kv = f"127.0.0.1:{kv_server.port}"
    for w in ("w1", "w2"):
        start_worker(w, kv)
    router = router_on(kv)
    prompts = workload(1, prefixes=12, rounds=3)  # 12 x 4 blocks a round: the 127-block pools evict
    serve(router, prompts)
    admin = AdminClient(kv)
    wait_until(lambda: sum(a.requests for a in admin.audit().values()) == len(prompts), timeout=10,
               what="the router's audit report")
    sums = list(admin.audit().values())
    assert sorted(admin.audit()) == ["w1", "w2"] and all(a.engine == "kvmesh" for a in sums)
    assert sum(a.cached_hits for a in sums) >= 12, sums  # the later rounds mostly hit their prefixes
    assert sum(a.silent_misses for a in sums) <= 1 and sum(a.unseen_hits for a in sums) <= 1
    assert alarms(caplog) == []


def test_evictions_the_index_never_hears_of_are_silent_misses(kv_server, start_worker, router_on, caplog):
    caplog.set_level(logging.WARNING, logger="kvmesh.router")
    kv = f"127.0.0.1:{kv_server.port}"
    worker = start_worker("w-drops", kv, num_blocks=24, max_model_len=256)
    take = worker.engine.take_kv_events
    # NOTE: the planted fault: the worker publishes what it stores and never what it evicts.
    worker.engine.take_kv_events = lambda: [e for e in take() if not isinstance(e, BlockRemoved)]
    router = router_on(kv)
    # A hot prefix used by every other request stays in the engine's cache (each hit refreshes it) and
    # ages out of the index's own bound first; the cold prompts between turn the 23-block pool over.
    rng = random.Random(2)
    hot = [rng.randrange(3, 600) for _ in range(48)]
    prompts = []
    for i in range(40):
        prompts.append(hot + [rng.randrange(3, 600) for _ in range(16)] if i % 2 else
                       [rng.randrange(3, 600) for _ in range(64)])
    cold = [p for i, p in enumerate(prompts) if i % 2 == 0]
    prompts += [cold[-4], cold[-5], cold[-6]] * 2  # blocks the index still lists, evicted by the engine
    serve(router, prompts)
    a = audit_of(kv, "w-drops", len(prompts))
    assert a.silent_misses + a.unseen_hits >= WINDOW * RATE
    assert a.silent_misses >= 1 and a.engine == "kvmesh"
    assert any("silent misses" in m or "unseen hits" in m for m in alarms(caplog)), alarms(caplog)


def test_a_worker_hashing_under_another_root_has_its_hits_unseen(kv_server, start_worker, router_on, caplog):
    caplog.set_level(logging.WARNING, logger="kvmesh.router")
    kv = f"127.0.0.1:{kv_server.port}"
    worker = start_worker("w-seed", kv)
    cfg = worker.engine.config
    # NOTE: the planted fault: the engine keys (and publishes) its blocks under another root, as a
    # worker started with another hash seed or model id would; it registers the model's spec.
    worker.engine.block_hasher = worker.engine.inputs.block_hasher = BlockHasher("another-seed", cfg.block_size,
                                                                                cfg.hash_algorithm)
    router = router_on(kv)
    prompts = workload(3, prefixes=4, rounds=6)
    serve(router, prompts)
    a = audit_of(kv, "w-seed", len(prompts))
    assert a.predicted_hits == 0 and a.cached_hits >= 4 * 5  # the engine hits; the index never predicts one
    assert a.unseen_hits == a.cached_hits and a.silent_misses == 0
    assert any("unseen hits" in m for m in alarms(caplog)), alarms(caplog)
