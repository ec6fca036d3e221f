"""One conformance suite, run against both index stores (memory and a real redis-server), the
Redis store in one shard and sharded (4 shards on one redis-server; 3 and 4 shards on a real
3-master Redis Cluster), each Redis variant also with 2 hashes per event-apply call."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.errors import FailedPrecondition, NotFound
from kvmesh.contract.index_protocol import Pending, Registration, Reservation
from kvmesh.contract.types import (
    AdapterLevel,
    AdapterResidency,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Load,
    Tier,
)
from kvmesh.kv_service.index import Action, PendingConfig
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.kv_service.store_redis import RedisIndex

TTL = 10_000
T0 = 1_000_000


pytestmark = pytest.mark.anyio


STORES = ["memory", "redis", "redis-2-per-call", "redis-4-shards", "redis-4-shards-2-per-call",
          "cluster-3-shards", "cluster-4-shards-2-per-call"]


@pytest.fixture(params=STORES)
async def index(request):
    if request.param == "memory":
        idx = MemoryIndex()
    else:
        # *-2-per-call: every batch of more than 2 hashes is applied in several script calls,
        # so each scenario also checks that a batch in parts ends as the whole batch would.
        # NOTE: with 4 shards the suite's workers w0..w3 live on 4 different shards (home_shard),
        # so every scenario with two workers merges answers across shards; on the 3-master cluster
        # 4 shards put two shards on one master (their calls pipelined on one connection).
        per_call = 2 if request.param.endswith("-2-per-call") else 256
        shards = 4 if "-4-shards" in request.param else 3 if "-3-shards" in request.param else 1
        url = (request.getfixturevalue("redis_cluster").url if request.param.startswith("cluster")
               else request.getfixturevalue("redis_url"))
        idx = RedisIndex(url, namespace=request.getfixturevalue("redis_namespace"), max_blocks_per_call=per_call,
                         shards=shards)
    yield idx
    await idx.close()


def chain(n: int, start: int = 0, salt: str = "") -> list[bytes]:
    """n chained block hashes of a prompt whose tokens start at ``start``."""
    return BlockHasher("m", 4).hash_prompt(list(range(start, start + 4 * n)), cache_salt=salt)


def reg(wid: str, *, model: str = "m", bs: int = 4, algo: str = "sha256_128", nb: int = 100, epoch: int = 1):
    return Registration(wid, f"127.0.0.1:{abs(hash(wid)) % 1000 + 50000}", model, bs, algo, nb, epoch)


async def join(index, wid: str, now: int = T0, **kw) -> None:
    await index.register_worker(reg(wid, **kw), TTL, now)


async def matches(index, hashes, model="m", now=T0) -> dict[str, int]:
    return {m.worker_id: m.matched_blocks for m in await index.lookup(model, hashes, now)}


async def test_two_workers_with_overlapping_chains(index):
    a, b = chain(6), chain(6)[:2]
    await join(index, "w1")
    await join(index, "w2")
    assert (await index.publish("w1", 1, 1, [BlockStored(a)], T0)).action == Action.ACK
    # w2 holds the first two blocks plus its own continuation.
    b_tail = BlockHasher("m", 4).hash_prompt(list(range(8)) + [99] * 8)[2:]
    assert (await index.publish("w2", 1, 1, [BlockStored(b + b_tail, None)], T0)).action == Action.ACK
    assert await matches(index, a) == {"w1": 6, "w2": 2}
    assert await matches(index, b + b_tail) == {"w1": 2, "w2": 4}
    assert await index.holders(a[0], T0) == ["w1", "w2"]
    assert await index.holders(a[5], T0) == ["w1"]
    st = await index.stats(T0)
    assert (st.live_workers, st.indexed_blocks, st.block_replicas) == (2, 8, 10)


async def test_lookups_answer_each_workers_first_miss_while_its_blocks_are_prefix_closed(index):
    """The prefix invariant (docs/kv-service.md "Lookup"): stores arrive parent-first and evictions
    leaf-first, so the search's answer is the walk's, the first block the worker misses."""
    h = chain(40)
    for w in ("w0", "w1", "w2", "w3"):
        await join(index, w)
    await index.publish("w0", 1, 1, [BlockStored(h)], T0)
    await index.publish("w1", 1, 1, [BlockStored(h[:17])], T0)
    await index.publish("w2", 1, 1, [BlockStored(h[:1])], T0)
    await index.publish("w3", 1, 1, [BlockStored(chain(40, start=1000))], T0)
    assert await matches(index, h) == {"w0": 40, "w1": 17, "w2": 1, "w3": 0}
    # a pool frees a request's blocks tail-first; a worker extends what it holds parent-first
    await index.publish("w0", 1, 2, [BlockRemoved(h[39:19:-1])], T0)
    await index.publish("w1", 1, 2, [BlockStored(h[17:30])], T0)
    await index.publish("w2", 1, 2, [BlockRemoved(h[:1])], T0)
    assert await matches(index, h) == {"w0": 20, "w1": 30, "w2": 0, "w3": 0}
    assert await matches(index, h[:25]) == {"w0": 20, "w1": 25, "w2": 0, "w3": 0}
    assert await matches(index, h[:1]) == {"w0": 1, "w1": 1, "w2": 0, "w3": 0}
    fork = BlockHasher("m", 4).hash_prompt(list(range(40)) + [7] * 80)  # h's first 10 blocks, then its own
    assert fork[:10] == h[:10] and fork[10] != h[10]
    assert await matches(index, fork) == {"w0": 10, "w1": 10, "w2": 0, "w3": 0}
    assert await matches(index, chain(3, start=500)) == {"w0": 0, "w1": 0, "w2": 0, "w3": 0}


async def test_a_hole_in_a_workers_prefix_is_answered_by_the_end_of_a_run_it_holds(index):
    """A worker that broke the invariant (blocks 0, 2 and 3 of a chain, not 1): its answer is some
    k >= the walk's with block k-1 held and block k not (docs/kv-service.md "Lookup"); which k is the
    search's, the same in every store. A worker without block 0 matches nothing."""
    h = chain(4)
    await join(index, "w1")
    await join(index, "w2")
    await index.publish("w1", 1, 1, [BlockStored([h[0], h[2], h[3]])], T0)
    await index.publish("w2", 1, 1, [BlockStored(h[1:])], T0)
    assert await matches(index, h) == {"w1": 4, "w2": 0}
    assert await matches(index, h[:2]) == {"w1": 1, "w2": 0}
    assert await matches(index, chain(3, start=500)) == {"w1": 0, "w2": 0}


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_the_linear_walk_stops_at_the_first_miss(store, request):
    """--lookup-walk linear: the walk the search replaced (the benchmarks' baseline)."""
    if store == "memory":
        index = MemoryIndex(lookup_walk="linear")
    else:
        index = RedisIndex(request.getfixturevalue("redis_url"), namespace=request.getfixturevalue("redis_namespace"),
                           lookup_walk="linear")
    try:
        h = chain(4)
        await join(index, "w1")
        await join(index, "w2")
        await index.publish("w1", 1, 1, [BlockStored([h[0], h[2], h[3]])], T0)
        await index.publish("w2", 1, 1, [BlockStored(h[:3])], T0, Load(num_running=2))
        found = {m.worker_id: (m.matched_blocks, m.load.num_running) for m in await index.lookup("m", h, T0)}
        assert found == {"w1": (1, 0), "w2": (3, 2)}
        assert await matches(index, chain(3, start=500)) == {"w1": 0, "w2": 0}
    finally:
        await index.close()


async def test_refcount_transitions_and_entry_deleted_at_zero(index):
    h = chain(3)
    await join(index, "w1")
    await join(index, "w2")
    await index.publish("w1", 1, 1, [BlockStored(h)], T0)
    await index.publish("w2", 1, 1, [BlockStored(h[:1])], T0)
    assert await index.holders(h[0], T0) == ["w1", "w2"]
    await index.publish("w1", 1, 2, [BlockRemoved([h[0]])], T0)
    assert await index.holders(h[0], T0) == ["w2"]
    await index.publish("w2", 1, 2, [BlockRemoved([h[0]])], T0)
    assert await index.holders(h[0], T0) == []
    assert (await index.stats(T0)).indexed_blocks == 2


async def test_removal_is_scoped_to_the_publishing_worker(index):
    h = chain(3)
    await join(index, "w1")
    await join(index, "w2")
    await index.publish("w1", 1, 1, [BlockStored(h)], T0)
    await index.publish("w2", 1, 1, [BlockStored(h)], T0)
    await index.publish("w1", 1, 2, [BlockRemoved(h)], T0)
    assert await matches(index, h) == {"w1": 0, "w2": 3}
    # Removing blocks a worker never held changes nothing.
    await index.publish("w1", 1, 3, [BlockRemoved(h)], T0)
    assert await matches(index, h) == {"w1": 0, "w2": 3}


async def test_lru_cap_evicts_least_recently_stored(index):
    h = chain(6)
    await join(index, "w1", nb=4)
    await index.publish("w1", 1, 1, [BlockStored(h[:4])], T0)
    await index.publish("w1", 1, 2, [BlockStored([h[0]])], T0)  # h0 becomes most recent
    await index.publish("w1", 1, 3, [BlockStored(h[4:6], h[3])], T0)  # 6 distinct > cap 4: evict h1, h2
    assert [await index.holders(x, T0) for x in h] == [["w1"], [], [], ["w1"], ["w1"], ["w1"]]
    assert (await index.workers(T0))[0].blocks_indexed == 4
    assert (await index.stats(T0)).indexed_blocks == 4


async def test_lease_expiry_hides_worker_at_once_and_reap_cleans_up(index):
    h = chain(2)
    await join(index, "w1")
    await join(index, "w2")
    await index.publish("w1", 1, 1, [BlockStored(h)], T0)
    await index.publish("w2", 1, 1, [BlockStored(h)], T0)
    await index.heartbeat("w2", 1, Load(num_running=3), TTL, T0 + TTL - 1)
    later = T0 + TTL  # w1's lease ends here; w2 renewed
    assert await matches(index, h, now=later) == {"w2": 2}
    assert await index.holders(h[0], later) == ["w2"]
    assert [w.registration.worker_id for w in await index.workers(later)] == ["w2"]
    with pytest.raises(NotFound, match="register it again"):
        await index.heartbeat("w1", 1, Load(), TTL, later)
    with pytest.raises(NotFound):
        await index.publish("w1", 1, 2, [BlockStored(h)], later)
    assert await index.reap_expired(later) == 1
    assert [w.registration.worker_id for w in await index.workers(later, include_expired=True)] == ["w2"]
    assert (await index.stats(later)).block_replicas == 2


async def test_seq_gap_asks_for_resync_and_changes_nothing(index):
    h = chain(3)
    await join(index, "w1")
    await index.publish("w1", 1, 1, [BlockStored(h[:1])], T0)
    res = await index.publish("w1", 1, 3, [BlockStored(h[1:], h[0])], T0)
    assert res.action == Action.RESYNC and "expected 2, got 3" in res.reason
    assert await matches(index, h) == {"w1": 1}
    # The snapshot replaces the worker's set and moves seq on.
    assert (await index.snapshot("w1", 1, 4, h[1:], T0)).action == Action.ACK
    assert [await index.holders(x, T0) for x in h] == [[], ["w1"], ["w1"]]
    assert (await index.publish("w1", 1, 5, [BlockStored([h[0]])], T0)).action == Action.ACK
    assert (await index.workers(T0))[0].last_seq == 5


async def test_seq_regression_is_refused_and_changes_nothing(index):
    h = chain(2)
    await join(index, "w1")
    await index.publish("w1", 1, 1, [BlockStored(h[:1])], T0)
    await index.publish("w1", 1, 2, [BlockStored(h[1:], h[0])], T0)
    with pytest.raises(FailedPrecondition, match="seq regression.*got 2, last applied 2"):
        await index.publish("w1", 1, 2, [AllBlocksCleared()], T0)
    with pytest.raises(FailedPrecondition, match="seq regression"):
        await index.snapshot("w1", 1, 1, [], T0)
    assert await matches(index, h) == {"w1": 2}


async def test_new_epoch_resyncs_and_stale_epoch_is_refused(index):
    h = chain(2)
    await join(index, "w1", epoch=5)
    await index.publish("w1", 5, 1, [BlockStored(h)], T0)
    res = await index.publish("w1", 6, 1, [AllBlocksCleared()], T0)
    assert res.action == Action.RESYNC and "new epoch" in res.reason
    assert await matches(index, h) == {"w1": 2}
    with pytest.raises(FailedPrecondition, match="stale epoch 4"):
        await index.publish("w1", 4, 9, [AllBlocksCleared()], T0)
    with pytest.raises(FailedPrecondition, match="dead epoch 4"):
        await index.snapshot("w1", 4, 9, [], T0)
    assert (await index.snapshot("w1", 6, 1, h[:1], T0)).action == Action.ACK
    info = (await index.workers(T0))[0]
    assert (info.registration.epoch, info.last_seq) == (6, 1)
    assert await matches(index, h) == {"w1": 1}


async def test_all_cleared_drops_only_that_worker(index):
    h = chain(3)
    await join(index, "w1")
    await join(index, "w2")
    await index.publish("w1", 1, 1, [BlockStored(h)], T0)
    await index.publish("w2", 1, 1, [BlockStored(h[:2])], T0)
    await index.publish("w1", 1, 2, [AllBlocksCleared(), BlockStored(h[:1])], T0)  # events apply in order
    assert await matches(index, h) == {"w1": 1, "w2": 2}
    assert (await index.stats(T0)).indexed_blocks == 2


async def test_reregistration_starts_empty_with_seq_reset(index):
    h = chain(2)
    await join(index, "w1", epoch=1)
    await index.publish("w1", 1, 1, [BlockStored(h)], T0)
    await join(index, "w1", epoch=2)
    assert await matches(index, h) == {"w1": 0}
    assert (await index.publish("w1", 2, 1, [BlockStored(h[:1])], T0)).action == Action.ACK
    with pytest.raises(FailedPrecondition, match="stale registration"):
        await join(index, "w1", epoch=1)


async def test_registration_spec_must_agree_with_live_workers(index):
    await join(index, "w1", bs=4)
    with pytest.raises(FailedPrecondition, match="block_size=4, hash=sha256_128.*block_size=8"):
        await join(index, "w2", bs=8)
    with pytest.raises(FailedPrecondition, match="hash=xxh3_128"):
        await join(index, "w2", algo="xxh3_128")
    with pytest.raises(FailedPrecondition, match="live for model 'm'"):
        await join(index, "w1", model="other")
    assert [w.registration.worker_id for w in await index.workers(T0)] == ["w1"]
    await join(index, "w3", model="other", bs=8)  # another model has its own spec
    # Once the model's workers are gone, a new spec is accepted.
    await index.reap_expired(T0 + TTL)
    await join(index, "w2", bs=8, now=T0 + TTL)
    assert (await index.model_spec("m")).block_size == 8


async def test_lookup_is_per_model_and_reports_load(index):
    h = chain(2)
    await join(index, "w1")
    await join(index, "x1", model="other")
    await index.publish("x1", 1, 1, [BlockStored(h)], T0)
    # NOTE: the work counters too (routers learn step costs from them), through either store
    load = Load(2, 1, 90, 100, 300, busy_s=12.5, steps=900, prefill_tokens=40_000, prefill_pairs=3 * 10**11,
                decode_tokens=700, decode_context_tokens=2 * 10**6, max_num_batched_tokens=8192)
    await index.heartbeat("w1", 1, load, TTL, T0)
    got = await index.lookup("m", h, T0)
    assert [(m.worker_id, m.matched_blocks, m.load, m.block_size) for m in got] == [("w1", 0, load, 4)]
    assert await index.lookup("nobody", h, T0) == []
    # the LoRA adapters it has loaded (issue 52), names with the encoding's own separators among them
    lora = replace(load, max_loras=2, adapters=(AdapterResidency("sql:lora|v2", AdapterLevel.GPU, 3),
                                                AdapterResidency("a,b;c", AdapterLevel.CPU, 0)))
    await index.heartbeat("w1", 1, lora, TTL, T0)
    assert [m.load for m in await index.lookup("m", h, T0)] == [lora]


async def test_an_applied_batch_carries_the_workers_load(index):
    """The load rides on the event stream: an applied batch (or snapshot) records it, a batch
    without one leaves it, a refused batch changes nothing; the lease stays the heartbeat's."""
    h = chain(3)
    await join(index, "w1")
    await index.heartbeat("w1", 1, Load(num_running=1), TTL, T0)
    fresh = Load(4, 2, 80, 100, 512, busy_s=1.5, steps=30, max_num_batched_tokens=8192)
    assert (await index.publish("w1", 1, 1, [BlockStored(h[:1])], T0, fresh)).action == Action.ACK

    async def load_now() -> Load:
        (info,) = await index.workers(T0)
        return info.load

    assert await load_now() == fresh
    # NOTE: the first Lookup of a model on this index instance reads the loads straight from the store
    assert [(m.worker_id, m.load) for m in await index.lookup("m", h, T0)] == [("w1", fresh)]
    assert (await index.publish("w1", 1, 2, [BlockStored(h[1:2], h[0])], T0)).action == Action.ACK
    assert await load_now() == fresh  # no load in the batch: unchanged
    assert (await index.publish("w1", 1, 2 + 5, [], T0, Load(num_running=9))).action == Action.RESYNC
    assert await load_now() == fresh  # refused (seq gap): unchanged
    assert (await index.publish("w1", 1, 3, [], T0, Load(num_waiting=7))).action == Action.ACK  # the load alone
    assert await load_now() == Load(num_waiting=7)
    assert (await index.snapshot("w1", 1, 9, h, T0, Load(num_running=3))).action == Action.ACK
    assert await load_now() == Load(num_running=3)
    assert await matches(index, h) == {"w1": 3}
    # the lease is not renewed by batches: it ends a TTL after the heartbeat
    assert await index.lookup("m", h, T0 + TTL + 1) == []


async def test_unknown_worker_is_not_found_and_flush(index):
    h = chain(2)
    with pytest.raises(NotFound):
        await index.publish("ghost", 1, 1, [BlockStored(h)], T0)
    with pytest.raises(NotFound):
        await index.flush_worker("ghost")
    await join(index, "w1")
    await index.publish("w1", 1, 1, [BlockStored(h)], T0)
    assert await index.flush_worker("w1") == 2
    assert await matches(index, h) == {"w1": 0}
    assert (await index.stats(T0)).indexed_blocks == 0


async def test_flush_asks_the_worker_to_resync_until_its_snapshot(index):
    """After a flush the worker owes a snapshot: heartbeats say so, event batches are answered
    RESYNC and change nothing; the snapshot settles it and the index holds the worker's blocks
    again."""
    h = chain(6)
    await join(index, "w1")
    assert await index.heartbeat("w1", 1, Load(), TTL, T0) is False
    await index.publish("w1", 1, 1, [BlockStored(h[:3])], T0)
    assert await index.flush_worker("w1") == 3
    assert await index.heartbeat("w1", 1, Load(), TTL, T0) is True
    res = await index.publish("w1", 1, 2, [BlockStored(h[3:])], T0)
    assert res.action == Action.RESYNC and "FlushWorker" in res.reason
    assert await matches(index, h) == {"w1": 0}
    assert await index.heartbeat("w1", 1, Load(), TTL, T0) is True  # still owed
    assert (await index.snapshot("w1", 1, 3, h, T0)).action == Action.ACK
    assert await index.heartbeat("w1", 1, Load(), TTL, T0) is False
    assert await matches(index, h) == {"w1": 6}
    assert (await index.publish("w1", 1, 4, [BlockRemoved(h[5:])], T0)).action == Action.ACK
    assert await matches(index, h) == {"w1": 5}


async def test_salted_chains_do_not_collide(index):
    await join(index, "w1")
    await index.publish("w1", 1, 1, [BlockStored(chain(2, salt="tenant-a"))], T0)
    assert await matches(index, chain(2, salt="tenant-b")) == {"w1": 0}
    assert await matches(index, chain(2, salt="tenant-a")) == {"w1": 2}


async def test_concurrent_publishers_keep_exact_state(index):
    workers = [f"w{i}" for i in range(4)]
    for w in workers:
        await join(index, w, nb=10_000)
    chains = {w: chain(40, start=1000 * (i + 1)) for i, w in enumerate(workers)}
    shared = chain(5)

    async def run(w: str) -> None:
        seq = 0
        for k in range(0, 40, 4):
            seq += 1
            assert (await index.publish(w, 1, seq, [BlockStored(chains[w][k:k + 4]), BlockStored(shared)], T0)).action == Action.ACK
        seq += 1
        await index.publish(w, 1, seq, [BlockRemoved(chains[w][20:])], T0)

    # Interleaved on one loop: on Redis every await is a round trip where the others run.
    await asyncio.gather(*(run(w) for w in workers))
    for w in workers:
        assert (await matches(index, chains[w]))[w] == 20
    assert await index.holders(shared[0], T0) == workers
    st = await index.stats(T0)
    assert (st.indexed_blocks, st.block_replicas) == (4 * 20 + 5, 4 * 25)


def test_load_encoding_round_trips_and_reads_the_older_five_field_form():
    load = Load(2, 1, 90, 100, 300, busy_s=1.25, steps=7, prefill_tokens=512, prefill_pairs=10**12,
                decode_tokens=40, decode_context_tokens=9000, max_num_batched_tokens=8192)
    assert Load.decode(load.encode()) == load
    assert Load.decode(b"2,1,90,100,300") == Load(2, 1, 90, 100, 300)
    from kvmesh.contract.convert import load_from_pb, load_to_pb

    assert load_from_pb(load_to_pb(load)) == load
    # the newer fields (a bridged engine's block, the host tier's loads) travel in any combination, and a
    # load without them is stored as before them
    assert load.encode().count(",") == 11
    for extra in ({"cache_block_tokens": 32}, {"host_loaded_blocks": 5, "host_load_s": 0.25},
                  {"cache_block_tokens": 32, "host_loaded_blocks": 5, "host_load_s": 0.25}, {"host_load_s": 0.5},
                  {"prefilling_tokens": 70_000}, {"adapter_disk_load_s": 0.5, "prefilling_tokens": 3}):
        newer = replace(load, **extra)
        assert Load.decode(newer.encode()) == newer and load_from_pb(load_to_pb(newer)) == newer
    lora = replace(load, max_loras=4, adapters=(AdapterResidency("x%3A:y", AdapterLevel.CPU, 2),
                                                AdapterResidency("z", AdapterLevel.GPU, 0)))
    assert Load.decode(lora.encode()) == lora and load_from_pb(load_to_pb(lora)) == lora
    assert Load.decode(replace(load, max_loras=4).encode()).adapters == ()


async def test_a_batch_in_parts_lets_a_lookup_in_between_and_a_stray_part_resyncs(redis_url, redis_namespace):
    idx = RedisIndex(redis_url, namespace=redis_namespace, max_blocks_per_call=4)
    try:
        h = chain(10)
        await join(idx, "w1")
        await join(idx, "w2")
        await idx.publish("w2", 1, 1, [BlockStored(h[:2])], T0)
        seen: list[dict[str, int]] = []
        real_call = idx.redis.call

        async def spying_call(script: str, *args):
            if script == "publish" and args[0] == "w1" and args[5] == 1:  # between part 0 and part 1
                seen.append(await matches(idx, h))
            return await real_call(script, *args)

        idx.redis.call = spying_call  # type: ignore[method-assign]
        assert (await idx.publish("w1", 1, 1, [BlockStored(h)], T0)).action == Action.ACK
        idx.redis.call = real_call  # type: ignore[method-assign]
        # Between the parts the index held the first part (a prefix of the worker's events).
        assert seen == [{"w1": 4, "w2": 2}]
        assert await matches(idx, h) == {"w1": 10, "w2": 2}
        assert (await idx.workers(T0))[0].last_seq == 1
        # A part that does not continue the pending batch is answered with RESYNC, nothing applied.
        res = await idx.redis.call("publish", "w1", 1, 2, T0, 0, 1, 1, "S", chain(1, start=500)[0])
        assert [x.decode() if isinstance(x, bytes) else x for x in res][0] == "RESYNC"
        assert await matches(idx, chain(1, start=500)) == {"w1": 0, "w2": 0}
    finally:
        await idx.close()


# --- duplicate events: a worker holds a block or not; there is no count per worker --------------

async def state(index, hashes: list[bytes], now: int = T0) -> tuple[list[list[str]], dict[str, int], tuple[int, int]]:
    """Each block's holders (GetBlock's refcount is their number), each live worker's indexed
    blocks, and the store's (distinct blocks, replicas)."""
    st = await index.stats(now)
    return ([await index.holders(h, now) for h in hashes],
            {w.registration.worker_id: w.blocks_indexed for w in await index.workers(now)},
            (st.indexed_blocks, st.block_replicas))


async def test_a_block_stored_twice_in_one_batch_is_held_once(index):
    h = chain(3)
    await join(index, "w1")
    ack = await index.publish("w1", 1, 1, [BlockStored([h[0], h[1], h[0]]), BlockStored(h[:2])], T0)
    assert ack.action == Action.ACK
    assert await state(index, h) == ([["w1"], ["w1"], []], {"w1": 2}, (2, 2))
    assert await matches(index, h) == {"w1": 2}
    # One removal takes it away, however often it was stored.
    await index.publish("w1", 1, 2, [BlockRemoved([h[0]])], T0)
    assert await state(index, h) == ([[], ["w1"], []], {"w1": 1}, (1, 1))
    assert await matches(index, h) == {"w1": 0}


async def test_removed_after_a_duplicate_stored(index):
    h = chain(3)
    await join(index, "w1")
    # In one batch: stored, stored again, removed -> gone.
    await index.publish("w1", 1, 1, [BlockStored(h[:2]), BlockStored([h[1]]), BlockRemoved([h[1]])], T0)
    assert await state(index, h) == ([["w1"], [], []], {"w1": 1}, (1, 1))
    # Across batches: stored twice, then one removal, then a duplicate removal changes nothing.
    await index.publish("w1", 1, 2, [BlockStored([h[2]])], T0)
    await index.publish("w1", 1, 3, [BlockStored([h[2]])], T0)
    await index.publish("w1", 1, 4, [BlockRemoved([h[2]])], T0)
    assert await state(index, h) == ([["w1"], [], []], {"w1": 1}, (1, 1))
    await index.publish("w1", 1, 5, [BlockRemoved([h[2], h[2]])], T0)
    assert await state(index, h) == ([["w1"], [], []], {"w1": 1}, (1, 1))


async def test_the_same_block_from_two_workers_then_removed_by_one(index):
    h = chain(2)
    await join(index, "w1")
    await join(index, "w2")
    await index.publish("w1", 1, 1, [BlockStored(h), BlockStored(h)], T0)
    await index.publish("w2", 1, 1, [BlockStored(h + h)], T0)  # duplicates of blocks another worker holds
    assert await state(index, h) == ([["w1", "w2"], ["w1", "w2"]], {"w1": 2, "w2": 2}, (2, 4))
    await index.publish("w1", 1, 2, [BlockRemoved([h[0], h[0]])], T0)
    assert await state(index, h) == ([["w2"], ["w1", "w2"]], {"w1": 1, "w2": 2}, (2, 3))
    assert await matches(index, h) == {"w1": 0, "w2": 2}
    await index.publish("w2", 1, 2, [BlockRemoved(h)], T0)
    assert await state(index, h) == ([[], ["w1"]], {"w1": 1, "w2": 0}, (1, 1))


async def test_duplicates_keep_the_lru_order_under_the_cap(index):
    h = chain(3)
    await join(index, "w1", nb=2)
    await index.publish("w1", 1, 1, [BlockStored([h[0], h[1], h[0]])], T0)  # h0 stored last: the most recent
    await index.publish("w1", 1, 2, [BlockStored([h[2]])], T0)  # 3 distinct > cap 2: h1 goes
    assert await state(index, h) == ([["w1"], [], ["w1"]], {"w1": 2}, (2, 2))


async def test_a_snapshot_with_duplicates_holds_each_block_once(index):
    h = chain(2)
    await join(index, "w1")
    assert (await index.snapshot("w1", 1, 1, [h[0], h[0], h[1], h[0]], T0)).action == Action.ACK
    assert await state(index, h) == ([["w1"], ["w1"]], {"w1": 2}, (2, 2))
    await index.publish("w1", 1, 2, [BlockRemoved([h[0]])], T0)
    assert await state(index, h) == ([[], ["w1"]], {"w1": 1}, (1, 1))


# -- the shared router view: pending picks -------------------------------------------------------
def pick(wid: str, rid: str, router: str = "ra", seen: int | None = None, prefill: int = 100, blocks: int = 5):
    return Reservation("m", wid, router, rid, prefill, blocks, seen)


async def pending(index, now=T0) -> dict[str, Pending]:
    return {m.worker_id: m.pending for m in await index.lookup("m", chain(1), now)}


async def test_a_pick_counts_in_every_lookup_until_the_workers_report_lists_its_admission(index):
    await join(index, "w0")
    await join(index, "w1")
    assert (await index.reserve(pick("w0", "r1"), T0)).reserved
    assert (await index.reserve(pick("w0", "r2", router="rb", prefill=50, blocks=2), T0 + 1)).reserved
    got = await pending(index, T0 + 2)
    assert got["w0"] == Pending(2, 150, 7, 2)
    assert got["w1"] == Pending()
    # A report that lists r1 as admitted covers it, once: r2 still counts; no double counting.
    admitted = Load(num_waiting=1, queued_prefill_tokens=100, admitted=("r1",), reports_admissions=True)
    await index.heartbeat("w0", 1, admitted, TTL, T0 + 3)
    assert (await pending(index, T0 + 4))["w0"] == Pending(1, 50, 2, 2)
    # The event stream's loads cover picks too; the stored load keeps no admissions.
    await index.publish("w0", 1, 1, [], T0 + 5, Load(num_waiting=2, admitted=("r2", "elsewhere"),
                                                        reports_admissions=True))
    m = {m.worker_id: m for m in await index.lookup("m", chain(1), T0 + 6)}["w0"]
    assert m.pending == Pending(0, 0, 0, 2)
    assert m.load.admitted == ()  # (the Redis store serves loads from a cache: not num_waiting here)
    info = {i.registration.worker_id: i for i in await index.workers(T0 + 6)}
    assert info["w0"].pending == Pending(0, 0, 0, 2)


async def test_a_pick_another_router_made_since_the_lookup_refuses_the_reservation(index):
    await join(index, "w0")
    await join(index, "w1")
    seen = (await pending(index))["w0"].version
    assert (await index.reserve(pick("w0", "a1", router="ra", seen=seen), T0)).reserved
    # The same router's next pick on w0 does not conflict with its own.
    assert (await index.reserve(pick("w0", "a2", router="ra", seen=seen), T0)).reserved
    refused = await index.reserve(pick("w0", "b1", router="rb", seen=seen), T0 + 1)
    assert not refused.reserved
    fresh = refused.pending
    assert fresh["w0"] == Pending(2, 200, 10, 2)
    assert fresh.get("w1", Pending()).requests == 0
    assert (await pending(index, T0 + 2))["w0"].requests == 2  # a refused reservation changes nothing
    # With the fresh version, or unconditionally, it is reserved.
    assert (await index.reserve(pick("w0", "b1", router="rb", seen=fresh["w0"].version), T0 + 2)).reserved
    assert (await index.reserve(pick("w1", "b2", router="rb", seen=None), T0 + 2)).reserved
    assert (await pending(index, T0 + 3))["w0"].requests == 3


async def test_picks_expire_after_their_ttl_and_a_worker_without_admissions_covers_them_by_time(index):
    index.pending_config = PendingConfig(grace_ms=100, ttl_ms=5_000)
    await join(index, "w0")
    await join(index, "w1")
    await index.reserve(pick("w0", "lost"), T0)  # its router died before forwarding it
    await index.reserve(pick("w1", "v1"), T0)
    await index.reserve(pick("w1", "v2"), T0 + 150)
    # w1 is a bridged engine: its report covers the picks taken grace_ms or more before it.
    await index.heartbeat("w1", 1, Load(num_waiting=1), TTL, T0 + 200)
    assert (await pending(index, T0 + 201))["w1"].requests == 1
    # w0 reports admissions; the lost pick's request never arrives: past the TTL a report drops it.
    await index.heartbeat("w0", 1, Load(reports_admissions=True), TTL, T0 + 4_000)
    assert (await pending(index, T0 + 4_001))["w0"].requests == 1
    await index.heartbeat("w0", 1, Load(reports_admissions=True), TTL, T0 + 5_001)
    assert (await pending(index, T0 + 5_002))["w0"].requests == 0
    # An expired pick conflicts with nobody.
    await index.reserve(pick("w1", "old", router="rb"), T0 + 5_100)
    await index.heartbeat("w1", 1, Load(reports_admissions=True), TTL, T0 + 6_000)
    assert not (await index.reserve(pick("w1", "new", router="ra", seen=0), T0 + 10_000)).reserved
    assert (await index.reserve(pick("w1", "new", router="ra", seen=0), T0 + 10_200)).reserved


async def test_a_claim_that_moves_a_folded_pick_releases_it(index):
    """A Lookup's folded pick was w0, the router's pick (on the answer) w1: the claim on w1 drops the same
    request's pick on w0 first; one pick per request counts anywhere."""
    await join(index, "w0")
    await join(index, "w1")
    assert (await index.reserve(pick("w0", "r1"), T0)).reserved
    moved = replace(pick("w1", "r1"), release_worker_id="w0")
    assert (await index.reserve(moved, T0 + 1)).reserved
    got = await pending(index, T0 + 2)
    assert (got["w0"].requests, got["w1"].requests) == (0, 1)
    # releasing a pick that is not there (the Lookup failed before it landed) changes nothing
    assert (await index.reserve(replace(pick("w1", "r2"), release_worker_id="w0"), T0 + 3)).reserved
    got = await pending(index, T0 + 4)
    assert (got["w0"].requests, got["w1"].requests) == (0, 2)


async def test_a_reregistered_worker_drops_its_picks_and_keeps_counting_versions(index):
    await join(index, "w0")
    await index.reserve(pick("w0", "r1"), T0)
    await index.reserve(pick("w0", "r2"), T0)
    await join(index, "w0", now=T0 + 1, epoch=2)
    assert (await pending(index, T0 + 2))["w0"] == Pending(0, 0, 0, 2)
    # No pick is pending any more: a reservation made with an old version is granted.
    assert (await index.reserve(pick("w0", "r3", router="rb", seen=1), T0 + 3)).reserved
    assert (await pending(index, T0 + 4))["w0"].version == 3


async def test_reserving_a_worker_that_is_not_live_or_serves_another_model_is_not_found(index):
    await join(index, "w0")
    with pytest.raises(NotFound):
        await index.reserve(pick("nobody", "r1"), T0)
    with pytest.raises(NotFound):
        await index.reserve(Reservation("other-model", "w0", "ra", "r1", 1, 1, None), T0)
    with pytest.raises(NotFound):
        await index.reserve(pick("w0", "r1"), T0 + TTL + 1)  # its lease lapsed


async def test_picks_per_worker_are_bounded_oldest_first(index):
    index.pending_config = PendingConfig(max_per_worker=3)
    await join(index, "w0")
    for i in range(5):
        await index.reserve(pick("w0", f"r{i}", prefill=10 ** i), T0 + i)
    p = (await pending(index, T0 + 10))["w0"]
    assert (p.requests, p.prefill_tokens, p.version) == (3, 100 + 1000 + 10_000, 5)


# -- tiers: the device and the host tier per (block, worker) ------------------------------------
HOST = Tier.HOST


def reg_host(wid: str, host_blocks: int, nb: int = 100) -> Registration:
    return Registration(wid, f"127.0.0.1:{abs(hash(wid)) % 1000 + 50000}", "m", 4, "sha256_128", nb, 1,
                        host_blocks=host_blocks)


async def tiers(index, hashes, model="m", now=T0) -> dict[str, tuple[int, int]]:
    """Per live worker: (device prefix, host continuation)."""
    return {m.worker_id: (m.matched_blocks, m.host_blocks) for m in await index.lookup(model, hashes, now)}


def offload(hashes: list[bytes]) -> list:
    """A device pool evicting ``hashes`` (in eviction order) into its host tier: removed (device)
    then stored (host), as a worker reports it."""
    return [BlockRemoved(hashes), BlockStored(hashes, tier=HOST)]


async def test_a_lookup_answers_the_device_prefix_and_how_far_the_host_tier_continues_it(index):
    """docs/kv-service.md "Tiers": the device prefix d as before; the host continuation u - d, u the
    longest prefix held in device or host memory. Evictions are leaf-first, so the host tier gets
    a chain's tail first."""
    h = chain(10)
    for w in ("w0", "w1", "w2", "w3"):
        await index.register_worker(reg_host(w, 50), TTL, T0)
    await index.publish("w0", 1, 1, [BlockStored(h), *offload(h[9:3:-1])], T0)  # device 0-3, host 4-9
    await index.publish("w1", 1, 1, [BlockStored(h[:2])], T0)  # device only
    await index.publish("w2", 1, 1, [BlockStored(h[:3]), *offload(h[2::-1])], T0)  # host only
    await index.publish("w3", 1, 1, [BlockStored(chain(4, start=500))], T0)
    assert await tiers(index, h) == {"w0": (4, 6), "w1": (2, 0), "w2": (0, 3), "w3": (0, 0)}
    assert await tiers(index, h[:1]) == {"w0": (1, 0), "w1": (1, 0), "w2": (0, 1), "w3": (0, 0)}
    fork = BlockHasher("m", 4).hash_prompt(list(range(20)) + [7] * 40)  # h's first 5 blocks, then its own
    assert await tiers(index, fork) == {"w0": (4, 1), "w1": (2, 0), "w2": (0, 3), "w3": (0, 0)}
    # loaded back: stored on the device again, the host copy stays
    await index.publish("w0", 1, 2, [BlockStored(h[4:6], h[3])], T0)
    assert (await tiers(index, h))["w0"] == (6, 4)
    # the host tier evicts its least recently used: the chain's tail
    await index.publish("w0", 1, 3, [BlockRemoved(h[8:], tier=HOST)], T0)
    assert (await tiers(index, h))["w0"] == (6, 2)
    # a host removal never drops a device entry, nor a device removal a host one
    await index.publish("w0", 1, 4, [BlockRemoved(h[:6], tier=HOST)], T0)
    assert (await tiers(index, h))["w0"] == (6, 2)
    await index.publish("w0", 1, 5, [BlockRemoved(h[7:8])], T0)
    assert (await tiers(index, h))["w0"] == (6, 2)
    assert await index.holders(h[4], T0) == ["w0"] and await index.holders(h[4], T0, HOST) == []
    assert await index.holders(h[7], T0) == [] and await index.holders(h[7], T0, HOST) == ["w0"]
    assert await index.holders(h[0], T0, HOST) == ["w2"]


async def test_tiers_are_counted_apart_in_stats_and_workers(index):
    h = chain(6)
    await index.register_worker(reg_host("w1", 40), TTL, T0)
    await index.register_worker(reg_host("w2", 0), TTL, T0)
    await index.publish("w1", 1, 1, [BlockStored(h), *offload(h[5:1:-1])], T0)
    await index.publish("w2", 1, 1, [BlockStored(h[:3]), *offload(h[2:1:-1])], T0)
    st = await index.stats(T0)
    assert (st.indexed_blocks, st.block_replicas, st.host_indexed_blocks, st.host_block_replicas) == (2, 4, 4, 5)
    info = {i.registration.worker_id: i for i in await index.workers(T0)}
    assert (info["w1"].blocks_indexed, info["w1"].host_blocks_indexed, info["w1"].registration.host_blocks) == (2, 4, 40)
    assert (info["w2"].blocks_indexed, info["w2"].host_blocks_indexed, info["w2"].registration.host_blocks) == (2, 1, 0)


async def test_all_cleared_a_flush_and_a_reregistration_drop_both_tiers(index):
    h = chain(4)
    for w in ("w1", "w2"):
        await index.register_worker(reg_host(w, 10), TTL, T0)
        await index.publish(w, 1, 1, [BlockStored(h), *offload(h[3:1:-1])], T0)
    await index.publish("w1", 1, 2, [AllBlocksCleared(), BlockStored(h[:1])], T0)
    assert await tiers(index, h) == {"w1": (1, 0), "w2": (2, 2)}
    assert await index.flush_worker("w2") == 4  # 2 device + 2 host entries
    assert (await tiers(index, h))["w2"] == (0, 0)
    assert (await index.snapshot("w2", 1, 3, h[:1], T0, host_hashes=h[3:0:-1])).action == Action.ACK
    assert (await tiers(index, h))["w2"] == (1, 3)
    await index.register_worker(replace(reg_host("w2", 10), epoch=2), TTL, T0)
    assert (await tiers(index, h))["w2"] == (0, 0)
    st = await index.stats(T0)
    assert (st.host_indexed_blocks, st.host_block_replicas) == (0, 0)


async def test_a_snapshot_replaces_both_tiers(index):
    h = chain(8)
    await index.register_worker(reg_host("w1", 10), TTL, T0)
    await index.publish("w1", 1, 1, [BlockStored(h[:6]), *offload(h[5:3:-1])], T0)
    assert await tiers(index, h) == {"w1": (4, 2)}
    # a gap: RESYNC; the snapshot the worker sends holds its whole cache, both tiers
    assert (await index.publish("w1", 1, 3, [BlockStored(h[6:], h[5])], T0)).action == Action.RESYNC
    assert (await index.snapshot("w1", 1, 4, h[:2], T0, host_hashes=[h[7], h[6], h[5], h[4], h[3], h[2]])).action \
        == Action.ACK
    assert await tiers(index, h) == {"w1": (2, 6)}
    assert [await index.holders(x, T0, HOST) for x in h] == [[], [], ["w1"], ["w1"], ["w1"], ["w1"], ["w1"], ["w1"]]
    # a snapshot without host hashes empties the host tier
    assert (await index.snapshot("w1", 1, 5, h[:3], T0)).action == Action.ACK
    assert await tiers(index, h) == {"w1": (3, 0)}
    assert (await index.stats(T0)).host_indexed_blocks == 0


async def test_each_tier_is_capped_at_its_own_size_least_recently_stored_first(index):
    h = chain(10)
    await index.register_worker(reg_host("w1", 3, nb=10), TTL, T0)
    # device holds 0-3; 9..4 offloaded leaf-first: the host tier keeps the 3 most recent, 6, 5, 4
    await index.publish("w1", 1, 1, [BlockStored(h), *offload(h[9:3:-1])], T0)
    assert await tiers(index, h) == {"w1": (4, 3)}
    assert [bool(await index.holders(x, T0, HOST)) for x in h] == [False] * 4 + [True] * 3 + [False] * 3
    info = (await index.workers(T0))[0]
    assert (info.blocks_indexed, info.host_blocks_indexed) == (4, 3)
    # a worker that declares no host tier is capped at 8 x its device blocks (UNDECLARED_HOST_FACTOR)
    await index.register_worker(reg_host("w2", 0, nb=1), TTL, T0)
    await index.publish("w2", 1, 1, [BlockStored(h[i:i + 1], tier=HOST) for i in range(10)], T0)
    assert (await index.workers(T0))[1].host_blocks_indexed == 8


async def test_a_hole_in_the_union_is_answered_by_the_end_of_a_run_it_holds(index):
    """Where a worker's blocks break the prefix invariant in the union of its tiers, its host
    answer is the search's (kv_service/prefix_search.continued_prefix), the same in every store:
    device 0-1, host 3-5 and 7 of 8 blocks: the device answer 2, the host search from it ends at 6
    (the walk: 2, block 2 is held nowhere). A worker without host blocks continues nothing, holes or not."""
    h = chain(8)
    await index.register_worker(reg_host("w1", 50), TTL, T0)
    await index.register_worker(reg_host("w2", 50), TTL, T0)
    await index.publish("w1", 1, 1, [BlockStored(h[:2]), BlockStored([h[3], h[4], h[5], h[7]], tier=HOST)], T0)
    await index.publish("w2", 1, 1, [BlockStored([*h[:4], h[5]])], T0)  # device answer 4, a block past it
    assert await tiers(index, h) == {"w1": (2, 4), "w2": (4, 0)}


async def test_a_workers_role_is_kept_as_registered(index):
    """Prefill/decode disaggregation: the role a worker registers with is what ListWorkers answers."""
    for wid, role in [("w0", "prefill"), ("w1", "decode"), ("w2", "both")]:
        r = reg(wid)
        await index.register_worker(Registration(r.worker_id, r.address, r.model_id, r.block_size, r.hash_algorithm,
                                                 r.num_blocks, r.epoch, role=role), TTL, T0)
    assert {i.registration.worker_id: i.registration.role for i in await index.workers(T0)} == {
        "w0": "prefill", "w1": "decode", "w2": "both"}
