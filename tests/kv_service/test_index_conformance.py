"""One conformance suite, run against both index stores (memory and a real redis-server)."""

from __future__ import annotations

import threading

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.errors import FailedPrecondition, NotFound
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, Load
from kvmesh.kv_service.index import Action, Registration
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.kv_service.store_redis import RedisIndex

TTL = 10_000
T0 = 1_000_000


@pytest.fixture(params=["memory", "redis"])
def index(request):
    if request.param == "memory":
        idx = MemoryIndex()
    else:
        idx = RedisIndex(request.getfixturevalue("redis_url"), namespace=request.getfixturevalue("redis_namespace"))
    yield idx
    idx.close()


def chain(n: int, start: int = 0, salt: str = "") -> list[bytes]:
    """n chained block hashes of a prompt whose tokens start at ``start``."""
    return BlockHasher("m", 4).hash_prompt(list(range(start, start + 4 * n)), cache_salt=salt)


def reg(wid: str, *, model: str = "m", bs: int = 4, algo: str = "sha256_128", nb: int = 100, epoch: int = 1):
    return Registration(wid, f"127.0.0.1:{abs(hash(wid)) % 1000 + 50000}", model, bs, algo, nb, epoch)


def join(index, wid: str, now: int = T0, **kw) -> None:
    index.register_worker(reg(wid, **kw), TTL, now)


def matches(index, hashes, model="m", now=T0) -> dict[str, int]:
    return {m.worker_id: m.matched_blocks for m in index.lookup(model, hashes, now)}


def test_two_workers_with_overlapping_chains(index):
    a, b = chain(6), chain(6)[:2]
    join(index, "w1")
    join(index, "w2")
    assert index.publish("w1", 1, 1, [BlockStored(a)], T0).action == Action.ACK
    # w2 holds the first two blocks plus its own continuation.
    b_tail = BlockHasher("m", 4).hash_prompt(list(range(8)) + [99] * 8)[2:]
    assert index.publish("w2", 1, 1, [BlockStored(b + b_tail, None)], T0).action == Action.ACK
    assert matches(index, a) == {"w1": 6, "w2": 2}
    assert matches(index, b + b_tail) == {"w1": 2, "w2": 4}
    assert index.holders(a[0], T0) == ["w1", "w2"]
    assert index.holders(a[5], T0) == ["w1"]
    st = index.stats(T0)
    assert (st.live_workers, st.indexed_blocks, st.block_replicas) == (2, 8, 10)


def test_lookup_stops_at_first_miss(index):
    h = chain(4)
    join(index, "w1")
    index.publish("w1", 1, 1, [BlockStored([h[0], h[2], h[3]])], T0)
    assert matches(index, h) == {"w1": 1}
    assert matches(index, chain(3, start=500)) == {"w1": 0}


def test_refcount_transitions_and_entry_deleted_at_zero(index):
    h = chain(3)
    join(index, "w1")
    join(index, "w2")
    index.publish("w1", 1, 1, [BlockStored(h)], T0)
    index.publish("w2", 1, 1, [BlockStored(h[:1])], T0)
    assert index.holders(h[0], T0) == ["w1", "w2"]
    index.publish("w1", 1, 2, [BlockRemoved([h[0]])], T0)
    assert index.holders(h[0], T0) == ["w2"]
    index.publish("w2", 1, 2, [BlockRemoved([h[0]])], T0)
    assert index.holders(h[0], T0) == []
    assert index.stats(T0).indexed_blocks == 2


def test_removal_is_scoped_to_the_publishing_worker(index):
    h = chain(3)
    join(index, "w1")
    join(index, "w2")
    index.publish("w1", 1, 1, [BlockStored(h)], T0)
    index.publish("w2", 1, 1, [BlockStored(h)], T0)
    index.publish("w1", 1, 2, [BlockRemoved(h)], T0)
    assert matches(index, h) == {"w1": 0, "w2": 3}
    # Removing blocks a worker never held changes nothing.
    index.publish("w1", 1, 3, [BlockRemoved(h)], T0)
    assert matches(index, h) == {"w1": 0, "w2": 3}


def test_lru_cap_evicts_least_recently_stored(index):
    h = chain(6)
    join(index, "w1", nb=4)
    index.publish("w1", 1, 1, [BlockStored(h[:4])], T0)
    index.publish("w1", 1, 2, [BlockStored([h[0]])], T0)  # h0 becomes most recent
    index.publish("w1", 1, 3, [BlockStored(h[4:6], h[3])], T0)  # 6 distinct > cap 4: evict h1, h2
    assert [index.holders(x, T0) for x in h] == [["w1"], [], [], ["w1"], ["w1"], ["w1"]]
    assert index.workers(T0)[0].blocks_indexed == 4
    assert index.stats(T0).indexed_blocks == 4


def test_lease_expiry_hides_worker_at_once_and_reap_cleans_up(index):
    h = chain(2)
    join(index, "w1")
    join(index, "w2")
    index.publish("w1", 1, 1, [BlockStored(h)], T0)
    index.publish("w2", 1, 1, [BlockStored(h)], T0)
    index.heartbeat("w2", 1, Load(num_running=3), TTL, T0 + TTL - 1)
    later = T0 + TTL  # w1's lease ends here; w2 renewed
    assert matches(index, h, now=later) == {"w2": 2}
    assert index.holders(h[0], later) == ["w2"]
    assert [w.registration.worker_id for w in index.workers(later)] == ["w2"]
    with pytest.raises(NotFound, match="register it again"):
        index.heartbeat("w1", 1, Load(), TTL, later)
    with pytest.raises(NotFound):
        index.publish("w1", 1, 2, [BlockStored(h)], later)
    assert index.reap_expired(later) == 1
    assert [w.registration.worker_id for w in index.workers(later, include_expired=True)] == ["w2"]
    assert index.stats(later).block_replicas == 2


def test_seq_gap_asks_for_resync_and_changes_nothing(index):
    h = chain(3)
    join(index, "w1")
    index.publish("w1", 1, 1, [BlockStored(h[:1])], T0)
    res = index.publish("w1", 1, 3, [BlockStored(h[1:], h[0])], T0)
    assert res.action == Action.RESYNC and "expected 2, got 3" in res.reason
    assert matches(index, h) == {"w1": 1}
    # The snapshot replaces the worker's set and moves seq on.
    assert index.snapshot("w1", 1, 4, h[1:], T0).action == Action.ACK
    assert [index.holders(x, T0) for x in h] == [[], ["w1"], ["w1"]]
    assert index.publish("w1", 1, 5, [BlockStored([h[0]])], T0).action == Action.ACK
    assert index.workers(T0)[0].last_seq == 5


def test_seq_regression_is_refused_and_changes_nothing(index):
    h = chain(2)
    join(index, "w1")
    index.publish("w1", 1, 1, [BlockStored(h[:1])], T0)
    index.publish("w1", 1, 2, [BlockStored(h[1:], h[0])], T0)
    with pytest.raises(FailedPrecondition, match="seq regression.*got 2, last applied 2"):
        index.publish("w1", 1, 2, [AllBlocksCleared()], T0)
    with pytest.raises(FailedPrecondition, match="seq regression"):
        index.snapshot("w1", 1, 1, [], T0)
    assert matches(index, h) == {"w1": 2}


def test_new_epoch_resyncs_and_stale_epoch_is_refused(index):
    h = chain(2)
    join(index, "w1", epoch=5)
    index.publish("w1", 5, 1, [BlockStored(h)], T0)
    res = index.publish("w1", 6, 1, [AllBlocksCleared()], T0)
    assert res.action == Action.RESYNC and "new epoch" in res.reason
    assert matches(index, h) == {"w1": 2}
    with pytest.raises(FailedPrecondition, match="stale epoch 4"):
        index.publish("w1", 4, 9, [AllBlocksCleared()], T0)
    with pytest.raises(FailedPrecondition, match="dead epoch 4"):
        index.snapshot("w1", 4, 9, [], T0)
    assert index.snapshot("w1", 6, 1, h[:1], T0).action == Action.ACK
    info = index.workers(T0)[0]
    assert (info.registration.epoch, info.last_seq) == (6, 1)
    assert matches(index, h) == {"w1": 1}


def test_all_cleared_drops_only_that_worker(index):
    h = chain(3)
    join(index, "w1")
    join(index, "w2")
    index.publish("w1", 1, 1, [BlockStored(h)], T0)
    index.publish("w2", 1, 1, [BlockStored(h[:2])], T0)
    index.publish("w1", 1, 2, [AllBlocksCleared(), BlockStored(h[:1])], T0)  # events apply in order
    assert matches(index, h) == {"w1": 1, "w2": 2}
    assert index.stats(T0).indexed_blocks == 2


def test_reregistration_starts_empty_with_seq_reset(index):
    h = chain(2)
    join(index, "w1", epoch=1)
    index.publish("w1", 1, 1, [BlockStored(h)], T0)
    join(index, "w1", epoch=2)
    assert matches(index, h) == {"w1": 0}
    assert index.publish("w1", 2, 1, [BlockStored(h[:1])], T0).action == Action.ACK
    with pytest.raises(FailedPrecondition, match="stale registration"):
        join(index, "w1", epoch=1)


def test_registration_spec_must_agree_with_live_workers(index):
    join(index, "w1", bs=4)
    with pytest.raises(FailedPrecondition, match="block_size=4, hash=sha256_128.*block_size=8"):
        join(index, "w2", bs=8)
    with pytest.raises(FailedPrecondition, match="hash=xxh3_128"):
        join(index, "w2", algo="xxh3_128")
    with pytest.raises(FailedPrecondition, match="live for model 'm'"):
        join(index, "w1", model="other")
    assert [w.registration.worker_id for w in index.workers(T0)] == ["w1"]
    join(index, "w3", model="other", bs=8)  # another model has its own spec
    # Once the model's workers are gone, a new spec is accepted.
    index.reap_expired(T0 + TTL)
    join(index, "w2", bs=8, now=T0 + TTL)
    assert index.model_spec("m").block_size == 8


def test_lookup_is_per_model_and_reports_load(index):
    h = chain(2)
    join(index, "w1")
    join(index, "x1", model="other")
    index.publish("x1", 1, 1, [BlockStored(h)], T0)
    index.heartbeat("w1", 1, Load(2, 1, 90, 100, 300), TTL, T0)
    got = index.lookup("m", h, T0)
    assert [(m.worker_id, m.matched_blocks, m.load, m.block_size) for m in got] == [
        ("w1", 0, Load(2, 1, 90, 100, 300), 4)
    ]
    assert index.lookup("nobody", h, T0) == []


def test_unknown_worker_is_not_found_and_flush(index):
    h = chain(2)
    with pytest.raises(NotFound):
        index.publish("ghost", 1, 1, [BlockStored(h)], T0)
    with pytest.raises(NotFound):
        index.flush_worker("ghost")
    join(index, "w1")
    index.publish("w1", 1, 1, [BlockStored(h)], T0)
    assert index.flush_worker("w1") == 2
    assert matches(index, h) == {"w1": 0}
    assert index.stats(T0).indexed_blocks == 0


def test_salted_chains_do_not_collide(index):
    join(index, "w1")
    index.publish("w1", 1, 1, [BlockStored(chain(2, salt="tenant-a"))], T0)
    assert matches(index, chain(2, salt="tenant-b")) == {"w1": 0}
    assert matches(index, chain(2, salt="tenant-a")) == {"w1": 2}


def test_concurrent_publishers_keep_exact_state(index):
    workers = [f"w{i}" for i in range(4)]
    for w in workers:
        join(index, w, nb=10_000)
    chains = {w: chain(40, start=1000 * (i + 1)) for i, w in enumerate(workers)}
    shared = chain(5)

    def run(w: str) -> None:
        seq = 0
        for k in range(0, 40, 4):
            seq += 1
            assert index.publish(w, 1, seq, [BlockStored(chains[w][k:k + 4]), BlockStored(shared)], T0).action == Action.ACK
        seq += 1
        index.publish(w, 1, seq, [BlockRemoved(chains[w][20:])], T0)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in workers:
        assert matches(index, chains[w])[w] == 20
    assert index.holders(shared[0], T0) == workers
    st = index.stats(T0)
    assert (st.indexed_blocks, st.block_replicas) == (4 * 20 + 5, 4 * 25)
