"""The kv_service core without a server: run_now on the memory store, metrics on a registry per core."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.index_protocol import Registration
from kvmesh.contract.types import BlockRemoved, BlockStored, Tier
from kvmesh.kv_service.service import KVService, run_now
from kvmesh.kv_service.store_memory import MemoryIndex

CHAIN = BlockHasher("m", 4).hash_prompt(list(range(16)))


def test_memory_core_runs_without_an_event_loop_and_cores_do_not_share_metrics():
    a, b = KVService(MemoryIndex()), KVService(MemoryIndex())
    run_now(a.register(Registration("w1", "127.0.0.1:1", "m", 4, "sha256_128", 100, 1)))
    run_now(a.publish("w1", 1, 1, [BlockStored(CHAIN)]))
    assert [(m.worker_id, m.matched_blocks) for m in run_now(a.lookup("m", CHAIN))] == [("w1", 4)]
    assert (a.metrics.lookups._value.get(), b.metrics.lookups._value.get()) == (1, 0)
    assert b"kvmesh_kv_lookups_total 1.0" in generate_latest(a.metrics.registry)
    assert b"kvmesh_kv_lookups_total 0.0" in generate_latest(b.metrics.registry)


def test_run_now_refuses_a_coroutine_that_suspends():
    async def suspends() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="suspended"):
        run_now(suspends())


def test_host_tier_events_are_applied_and_disk_tier_events_counted_not_applied():
    svc = KVService(MemoryIndex())
    run_now(svc.register(Registration("w1", "127.0.0.1:1", "m", 4, "sha256_128", 100, 1, host_blocks=8)))
    run_now(svc.publish("w1", 1, 1, [BlockStored(CHAIN[:2]), BlockStored(CHAIN[2:], tier=Tier.HOST),
                                     BlockRemoved(CHAIN[:1], tier=Tier.HOST)]))
    run_now(svc.publish("w1", 1, 2, [BlockStored(CHAIN[:1], tier=Tier.DISK), BlockRemoved(CHAIN[3:], tier=Tier.DISK)]))
    assert [(m.worker_id, m.matched_blocks, m.host_blocks) for m in run_now(svc.lookup("m", CHAIN))] == [("w1", 2, 2)]
    ignored = svc.metrics.events_ignored
    assert [ignored.labels(k, t)._value.get() for k, t in (("stored", "host"), ("stored", "disk"),
                                                           ("removed", "disk"))] == [0, 1, 1]
    assert svc.metrics.events_applied.labels("stored")._value.get() == 4
    assert run_now(svc.get_block(CHAIN[2])) == ([], ["w1"])


def test_a_snapshot_past_its_bounds_is_refused_naming_the_field():
    from kvmesh.contract.errors import InvalidArgument
    from kvmesh.contract.limits import MAX_SNAPSHOT_HOST_BLOCKS

    svc = KVService(MemoryIndex())
    run_now(svc.register(Registration("w1", "127.0.0.1:1", "m", 4, "sha256_128", 100, 1)))
    with pytest.raises(InvalidArgument, match=r"snapshot_host_hashes\[1\] is 3 bytes"):
        run_now(svc.snapshot("w1", 1, 1, CHAIN, host_hashes=[CHAIN[0], b"abc"]))
    with pytest.raises(InvalidArgument, match=f"snapshot_host_hashes has {MAX_SNAPSHOT_HOST_BLOCKS + 1} hashes"):
        run_now(svc.snapshot("w1", 1, 1, [], host_hashes=[CHAIN[0]] * (MAX_SNAPSHOT_HOST_BLOCKS + 1)))
    with pytest.raises(InvalidArgument, match="host_blocks must be in"):
        run_now(svc.register(Registration("w2", "127.0.0.1:1", "m", 4, "sha256_128", 100, 1, host_blocks=-1)))
    # within them, a snapshot of both tiers replaces what the index held
    run_now(svc.snapshot("w1", 1, 1, CHAIN[:1], host_hashes=CHAIN[1:]))
    assert [(m.matched_blocks, m.host_blocks) for m in run_now(svc.lookup("m", CHAIN))] == [(1, 3)]


def test_tiers_cross_the_wire_and_the_device_tier_is_sent_as_before():
    from kvmesh.contract.convert import event_to_pb, events_from_pb
    from kvmesh.v1 import kv_service_pb2 as pb

    events = [BlockStored(CHAIN[:2], None), BlockStored(CHAIN[2:], CHAIN[1], tier=Tier.DEVICE),
              BlockStored(CHAIN[:1], tier=Tier.HOST), BlockRemoved(CHAIN[:1], tier=Tier.HOST),
              BlockRemoved(CHAIN[1:2], tier=Tier.DISK), BlockRemoved(CHAIN[2:])]
    wire = [event_to_pb(e) for e in events]
    assert events_from_pb(wire) == events
    # A device event is byte for byte what a worker sent before tiers; an explicit DEVICE reads as one.
    old = pb.KVEvent(stored=pb.BlockStored(block_hashes=CHAIN[:2]))
    assert wire[0].SerializeToString() == old.SerializeToString()
    explicit = pb.KVEvent(removed=pb.BlockRemoved(block_hashes=CHAIN[2:], tier=pb.KV_TIER_DEVICE))
    assert events_from_pb([explicit]) == [BlockRemoved(CHAIN[2:])]
    assert wire[2].stored.tier == pb.KV_TIER_HOST and wire[4].removed.tier == pb.KV_TIER_DISK


def test_a_reserved_pick_tells_every_lookup_and_refusal_which_prefix_its_worker_will_hold():
    """The routers' speculative maps, shared (kv_service/pending_prefixes.py, issue 35): a Reserve carries
    its prompt's anchors (blocks 1, 2, 4, ... and the last); a Lookup of a chain sharing a prefix with it
    answers that prefix's length for the worker (rounded down to a power of two), until the anchors' TTL;
    a refused Reserve answers it for the refused prompt."""
    from kvmesh.contract.index_protocol import Reservation, anchor_positions, anchors_of
    from kvmesh.kv_service.config import PendingConfig, ServiceConfig

    assert anchor_positions(0) == [] and anchor_positions(1) == [0] and anchor_positions(12) == [0, 1, 3, 7, 11]
    clock = [1000]
    svc = KVService(MemoryIndex(), ServiceConfig(pending=PendingConfig(prefix_ttl_ms=2000)), clock=lambda: clock[0])
    for w in ("w1", "w2"):
        run_now(svc.register(Registration(w, "127.0.0.1:1", "m", 4, "sha256_128", 100, 1)))
    hasher = BlockHasher("m", 4)
    shared = list(range(40))  # 10 blocks
    mine = hasher.hash_prompt(shared + [900 + i for i in range(8)])  # 12 blocks
    yours = hasher.hash_prompt(shared + [700 + i for i in range(24)])  # 16 blocks, 10 of them shared
    assert run_now(svc.reserve(Reservation("m", "w1", "ra", "r1", 48, 12, 0, anchors_of(mine)))).reserved
    pending = {m.worker_id: m.pending_blocks for m in run_now(svc.lookup("m", yours))}
    assert pending == {"w1": 8, "w2": 0}  # 10 shared blocks, anchored at 8
    assert {m.worker_id: m.pending_blocks for m in run_now(svc.lookup("m", mine))} == {"w1": 12, "w2": 0}
    # Another router's conditional reservation of w1 that saw none of it is refused, with the news.
    refused = run_now(svc.reserve(Reservation("m", "w1", "rb", "r2", 64, 16, 0, anchors_of(yours))))
    assert not refused.reserved and refused.anchored == {"w1": 4}  # anchors 1, 2, 4, 8 of yours
    clock[0] += 2000
    assert {m.worker_id: m.pending_blocks for m in run_now(svc.lookup("m", yours))} == {"w1": 0, "w2": 0}


def test_a_reserved_picks_anchors_stop_counting_once_the_worker_evicts_those_blocks():
    # the anchors say a reserved pick *will* hold a prefix; the worker's own eviction of it says it does not
    # (a prefix evicted to its host tier within the anchors' TTL must not be priced as a device hit)
    from kvmesh.contract.index_protocol import Reservation, anchors_of
    from kvmesh.kv_service.config import PendingConfig, ServiceConfig

    clock = [1000]
    svc = KVService(MemoryIndex(), ServiceConfig(pending=PendingConfig(prefix_ttl_ms=60_000)), clock=lambda: clock[0])
    run_now(svc.register(Registration("w1", "127.0.0.1:1", "m", 4, "sha256_128", 100, 1)))
    chain = BlockHasher("m", 4).hash_prompt(list(range(48)))  # 12 blocks
    assert run_now(svc.reserve(Reservation("m", "w1", "ra", "r1", 48, 12, 0, anchors_of(chain)))).reserved
    assert [m.pending_blocks for m in run_now(svc.lookup("m", chain))] == [12]
    run_now(svc.publish("w1", 1, 1, [BlockStored(chain)]))
    run_now(svc.publish("w1", 1, 2, [BlockRemoved(chain[4:][::-1])]))  # leaf first: blocks 4-11 evicted
    assert [(m.matched_blocks, m.pending_blocks) for m in run_now(svc.lookup("m", chain))] == [(4, 4)]
    run_now(svc.publish("w1", 1, 3, [BlockRemoved(chain[:4][::-1])]))
    assert [(m.matched_blocks, m.pending_blocks) for m in run_now(svc.lookup("m", chain))] == [(0, 0)]


def test_a_lookups_folded_reservation_is_made_after_its_answer_on_that_answers_version():
    """The Reserve folded into the Lookup (issue 45): the answer does not count the request's own pick; the
    pick is reserved on the answer's version of the worker (not the router's older one); a guess the answer
    contradicts (another worker holds a longer prefix of the chain) is not reserved, so it advertises no
    phantom copy of the prefix; a worker that is not live is no error."""
    from kvmesh.contract.index_protocol import Reservation, anchors_of
    from kvmesh.kv_service.config import PendingConfig, ServiceConfig

    clock = [1_000_000]
    svc = KVService(MemoryIndex(), ServiceConfig(pending=PendingConfig(prefix_ttl_ms=2000)), clock=lambda: clock[0])
    for w in ("w1", "w2"):
        run_now(svc.register(Registration(w, "127.0.0.1:1", "m", 4, "sha256_128", 100, 1)))
    chain = BlockHasher("m", 4).hash_prompt(list(range(4 * 8)))
    run_now(svc.reserve(Reservation("m", "w1", "rb", "other", 10, 1, None)))  # another router, version 1
    stale = Reservation("m", "w1", "ra", "r1", 32, 8, 0, anchors_of(chain))  # seen_version 0: ignored
    found, reserved = run_now(svc.lookup_reserve("m", chain, stale))
    assert reserved and {m.worker_id: m.pending.requests for m in found} == {"w1": 1, "w2": 0}
    assert {m.worker_id: m.pending.requests for m in run_now(svc.lookup("m", chain))} == {"w1": 2, "w2": 0}
    # w1 will hold the chain (r1's anchors): a guess of w2 for the same chain is not reserved
    found, reserved = run_now(svc.lookup_reserve("m", chain, Reservation("m", "w2", "ra", "r2", 32, 8, None,
                                                                          anchors_of(chain))))
    assert not reserved and {m.worker_id: m.pending_blocks for m in found} == {"w1": 8, "w2": 0}
    assert {m.worker_id: m.pending.requests for m in run_now(svc.lookup("m", chain))} == {"w1": 2, "w2": 0}
    found, reserved = run_now(svc.lookup_reserve("m", chain, Reservation("m", "nobody", "ra", "r3", 1, 1, None)))
    assert not reserved and len(found) == 2


def test_the_fold_guard_counts_the_prefixes_reserved_picks_will_hold():
    """Catches the fold guard ignoring pending blocks (issue 50): a worker a reserved pick will fill with the
    chain (its anchors) holds it as far as the guard goes. A second guess of that worker is reserved (it is where
    the answer sends the router); a guess of the other is not (the answer contradicts it)."""
    from kvmesh.contract.index_protocol import Reservation, anchors_of

    svc = KVService(MemoryIndex())
    for w in ("w1", "w2"):
        run_now(svc.register(Registration(w, "127.0.0.1:1", "m", 4, "sha256_128", 100, 1)))
    chain = BlockHasher("m", 4).hash_prompt(list(range(4 * 8)))

    def guess(worker_id: str, request_id: str) -> bool:
        return run_now(svc.lookup_reserve("m", chain, Reservation("m", worker_id, "ra", request_id, 32, 8, None,
                                                                  anchors_of(chain))))[1]

    assert guess("w1", "r1")  # nobody holds any of it: any guess stands
    assert guess("w1", "r2")  # w1 holds nothing yet, but r1's pick will hold the whole chain there
    assert not guess("w2", "r3")
    assert {m.worker_id: (m.matched_blocks, m.pending_blocks, m.pending.requests)
            for m in run_now(svc.lookup("m", chain))} == {"w1": (0, 8, 2), "w2": (0, 0, 0)}
