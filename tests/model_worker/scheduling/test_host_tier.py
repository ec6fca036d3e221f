"""The host KV tier in the engine core: blocks evicted from the device go to a host pool (LRU with
refcounts), come back when a new request's prefix continues there, and every move is an event.

Scenarios assert exact block ids, host blocks, transfers and events, as test_prefix_caching.py
does for the device pool; a random load checks that the events, replayed per tier, always equal
what each pool holds.
"""

from __future__ import annotations

import random

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    SamplingParams,
    Tier,
)
from kvmesh.model_worker.scheduling.block_pool import KVCacheBlock
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.host_block_pool import HostBlockPool, KVTransfers, host_blocks_for
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.kv_cache_spec import KVCacheConfig
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.scheduling.scheduler import Scheduler

BS = 4
HASHER = BlockHasher("test-model", block_size=BS)
HOST = Tier.HOST


def make_request(request_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), block_hasher=HASHER)


def run(s: Scheduler, request: Request) -> tuple[KVTransfers | None, list[int]]:
    """Adds ``request`` and steps until nothing is left; returns its admission step's transfers and
    its block table at admission."""
    s.add_request(request)
    out = s.schedule()
    transfers, table = out.kv_transfers, list(out.scheduled[-1].block_ids)
    while True:
        s.update_from_output(out, {r.request.request_id: [7] for r in out.scheduled if r.sample})
        if not s.has_unfinished_requests():
            return transfers, table
        out = s.schedule()


def host_lru(kv: KVCacheManager) -> list[bytes]:
    """The host tier's unreferenced hashes, least recently used first (empty blocks skipped)."""
    assert kv.host_pool is not None
    return [b.block_hash for b in kv.host_pool.lru.get_all_free_blocks() if b.block_hash is not None]


# -- the host pool alone ---------------------------------------------------------------------------
def test_host_pool_is_an_lru_with_refcounts() -> None:
    events: list[KVCacheEvent] = []
    pool = HostBlockPool(3, events.append)
    h = [bytes([i]) * 16 for i in range(6)]
    pool.offload([(h[0], 10), (h[1], 11)])
    assert events == [BlockStored([h[0], h[1]], tier=HOST)]
    t = pool.take_transfers()
    assert t == KVTransfers(offloads=[(10, 0), (11, 1)])
    assert pool.take_transfers() is None
    # A hash offered again only becomes most recently used: no copy, no event.
    pool.offload([(h[0], 12)])
    assert pool.take_transfers() is None and len(events) == 1
    assert [b.block_hash for b in pool.lru.get_all_free_blocks()] == [None, h[1], h[0]]
    # A held block (being loaded) is out of the queue: the next stores evict around it.
    (blk,) = pool.find_run([h[1]], 0, 1)
    pool.hold([blk])
    pool.load([blk], [20])
    pool.offload([(h[2], 13), (h[3], 14)])
    assert events[1:] == [BlockRemoved([h[0]], tier=HOST), BlockStored([h[2], h[3]], tier=HOST)]
    assert pool.take_transfers() == KVTransfers(offloads=[(13, 2), (14, 0)], loads=[(1, 20)])
    # Taking the transfers released the loaded block to the recent end of the queue.
    assert [b.block_hash for b in pool.lru.get_all_free_blocks()] == [h[2], h[3], h[1]]
    # More new blocks than room: the oldest of them are dropped (they would go next anyway).
    pool.offload([(h[4], 15), (h[5], 16), (h[0], 17), (h[2], 18)])
    assert events[3:] == [BlockRemoved([h[3], h[1]], tier=HOST), BlockStored([h[5], h[0]], tier=HOST)]
    assert pool.take_transfers() == KVTransfers(offloads=[(16, 0), (17, 1)])
    assert set(pool.cached) == {h[2], h[5], h[0]}


def test_a_host_block_stored_twice_in_one_step_is_copied_once() -> None:
    pool = HostBlockPool(1, None)
    a, b = b"a" * 16, b"b" * 16
    pool.offload([(a, 5)])
    pool.offload([(b, 6)])  # a second allocation of the same step evicts a at once
    assert pool.take_transfers() == KVTransfers(offloads=[(6, 0)])
    assert set(pool.cached) == {b}


def test_sizes_in_blocks_or_gib() -> None:
    assert host_blocks_for(7, None, 1 << 20) == 7
    assert host_blocks_for(None, None, 1 << 20) == 0 == host_blocks_for(0, 0.0, 1 << 20)
    assert host_blocks_for(None, 0.5, 1 << 20) == 512
    with pytest.raises(ValueError, match="holds no KV block"):
        host_blocks_for(None, 1e-9, 1 << 20)
    with pytest.raises(ValueError, match="at least one block"):
        HostBlockPool(0, None)


# -- eviction under pressure, through the scheduler --------------------------------------------
def test_blocks_move_device_to_host_to_gone_in_lru_order_and_come_back() -> None:
    """Four usable device blocks, two host blocks, prompts of two full blocks (8 tokens)."""
    kv = KVCacheManager(num_blocks=5, block_size=BS, num_host_blocks=2)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=16), kv)
    A, B, C = (make_request(n, list(range(k, k + 8))) for n, k in (("A", 100), ("B", 200), ("C", 300)))
    a, b, c = A.block_hashes, B.block_hashes, C.block_hashes

    assert run(s, A) == (None, [1, 2])
    assert kv.take_events() == [BlockStored(a, None)]
    assert run(s, B) == (None, [3, 4])  # the empty blocks go first
    assert kv.take_events() == [BlockStored(b, None)]
    # Queue now [2, 1, 4, 3] (chains freed tail first): C evicts A's blocks, tail first; they go to
    # the host tier in that order (a[1] is its least recently used block).
    t, table = run(s, C)
    assert table == [2, 1] and t == KVTransfers(offloads=[(2, 0), (1, 1)])
    assert kv.take_events() == [BlockRemoved([a[1], a[0]]), BlockStored([a[1], a[0]], tier=HOST),
                                BlockStored(c, None)]
    assert host_lru(kv) == [a[1], a[0]]

    # A again: its first block is only in the host tier (its last token is always recomputed, so the
    # hit is one block). It is held and loaded into the first new block (4); the allocation evicts
    # B's blocks (4, 3); the host tier has room for one (a[0] is held): b[1], the older, is dropped,
    # b[0] evicts a[1], the least recently used.
    A2 = make_request("A2", list(range(100, 108)))
    t, table = run(s, A2)
    assert table == [4, 3] and t == KVTransfers(offloads=[(3, 0)], loads=[(1, 4)])
    assert kv.take_events() == [BlockRemoved([b[1], b[0]]), BlockRemoved([a[1]], tier=HOST),
                                BlockStored([b[0]], tier=HOST), BlockStored(a, None)]
    assert A2.num_cached_tokens == BS and kv.host_cache_hits == BS
    # a[0] stays in the host tier, most recently used; the device holds it again too.
    assert host_lru(kv) == [b[0], a[0]]
    assert kv.cached_block_hashes() == {a[0], a[1], c[0], c[1]}
    assert kv.host_block_hashes() == {a[0], b[0]}
    # Every host block is free again and the device pool leaked nothing.
    assert all(blk.ref_cnt == 0 for blk in kv.host_pool.blocks) and kv.num_free_blocks == 4

    # Queue [1, 2, 3, 4] = c[1], c[0], a[1], a[0]. A 15-token prompt takes all four: the host tier
    # has room for two (b[0], a[0]); the most recent two are kept: a[1] (copied, evicting b[0]) and
    # a[0], which the host holds already: it only becomes most recently used, nothing is copied.
    # c[1] and c[0] are older than both and never copied.
    t, table = run(s, make_request("D", list(range(400, 415))))
    assert table == [1, 2, 3, 4] and t == KVTransfers(offloads=[(3, 0)])
    assert kv.take_events()[:3] == [BlockRemoved([c[1], c[0], a[1], a[0]]), BlockRemoved([b[0]], tier=HOST),
                                    BlockStored([a[1]], tier=HOST)]
    assert host_lru(kv) == [a[1], a[0]]


def test_a_prefix_split_between_device_and_host_loads_only_the_host_part() -> None:
    kv = KVCacheManager(num_blocks=7, block_size=BS, num_host_blocks=8)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=24), kv)
    prompt = list(range(16))  # 4 full blocks
    A = make_request("A", prompt)
    run(s, A)
    a = A.block_hashes
    # Two 5-token requests (two blocks each) take the empty blocks 5, 6, then A's tail blocks 4, 3.
    for i in range(2):
        run(s, make_request(f"x{i}", list(range(1000 + 10 * i, 1000 + 10 * i + 5))))
    assert kv.cached_block_hashes() >= {a[0], a[1]} and a[3] not in kv.cached_block_hashes()
    kv.take_events()
    # The same prompt plus one token: device hit a[0], a[1]; host continues with a[2], a[3].
    A2 = make_request("A2", prompt + [99])
    device, n = kv.get_computed_blocks(A2)
    assert n == 2 * BS and [b.block_hash for b in device] == a[:2]
    assert [b.block_hash for b in kv.get_host_blocks(A2, n)] == a[2:4]
    t, table = run(s, A2)
    assert table[:2] == [b.block_id for b in device]
    assert t is not None and [d for _, d in t.loads] == table[2:4]
    assert A2.num_cached_tokens == 16  # every prompt block but the last token's
    stored = [e for e in kv.take_events() if isinstance(e, BlockStored) and e.tier == Tier.DEVICE]
    assert stored[0] == BlockStored(a[2:4], a[1])  # the loaded blocks, chained after the device hit


# -- the events replayed per tier always equal the pools ------------------------------------------
class TieredIndex:
    """What an index that keeps tiers would know of one worker: a set of hashes per tier."""

    def __init__(self) -> None:
        self.tiers: dict[Tier, set[bytes]] = {t: set() for t in Tier}
        self.moves = {"offloaded": 0, "host_evicted": 0}

    def apply(self, events: list[KVCacheEvent]) -> None:
        for e in events:
            if isinstance(e, AllBlocksCleared):
                for held in self.tiers.values():
                    held.clear()
                continue
            held = self.tiers[e.tier]
            if isinstance(e, BlockStored):
                assert e.block_hashes and (e.tier == Tier.DEVICE or e.parent_block_hash is None)
                if e.tier == HOST:
                    assert not held & set(e.block_hashes), "a host store of a hash the host holds"
                    self.moves["offloaded"] += len(e.block_hashes)
                held.update(e.block_hashes)
            else:
                assert set(e.block_hashes) <= held, f"removal of a hash {e.tier.name} never stored"
                held.difference_update(e.block_hashes)
                if e.tier == HOST:
                    self.moves["host_evicted"] += len(e.block_hashes)


def test_replayed_tiers_match_both_pools_under_random_load() -> None:
    rng = random.Random(36)
    kv = KVCacheManager(num_blocks=14, block_size=BS, num_host_blocks=9)
    s = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=20, max_model_len=40,
                                  num_scheduler_steps=3), kv)
    index = TieredIndex()
    prefixes = [[rng.randrange(50) for _ in range(rng.choice((8, 12, 16)))] for _ in range(6)]
    next_id = resets = 0
    for step in range(600):
        if rng.random() < 0.35:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            s.add_request(make_request(f"r{next_id}", tokens, max_tokens=rng.randrange(1, 10)))
            next_id += 1
        if s.requests and rng.random() < 0.04:
            s.abort_request(rng.choice(sorted(s.requests)))
        if step % 100 == 99:
            idle = kv.num_free_blocks == kv.num_blocks - 1
            assert kv.reset_prefix_cache() is idle
            resets += idle
        out = s.schedule()
        t = out.kv_transfers
        if t is not None:
            # the runner's contract: distinct host blocks per step, loads into blocks of this step
            assert len({h for _, h in t.offloads}) == len(t.offloads)
            assert {d for _, d in t.loads} <= {b for r in out.scheduled for b in r.block_ids}
        for k in range(out.num_steps):
            s.update_from_output(out, {r.request.request_id: [rng.randrange(50)] for r in out.scheduled
                                       if r.sample and r.window_steps > k})
            if k + 1 < out.num_steps and not s.prepare_window_step(out):
                break
        index.apply(kv.take_events())
        assert index.tiers[Tier.DEVICE] == kv.cached_block_hashes()
        assert index.tiers[HOST] == kv.host_block_hashes()
        assert all(b.ref_cnt == 0 for b in kv.host_pool.blocks), "a host block held past its step"
    # The load did what the tier is for: offloads, host evictions, loads back, and resets.
    assert index.moves["offloaded"] > 50 and index.moves["host_evicted"] > 20
    assert kv.host_cache_hits > 0 and kv.host_pool.num_loaded > 20 and resets > 0


# -- what the tier refuses ----------------------------------------------------------------------------
def test_the_host_tier_needs_caching_and_full_attention() -> None:
    with pytest.raises(ValueError, match="needs prefix caching"):
        KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False, num_host_blocks=4)
    windowed = KVCacheConfig.from_sliding_windows([None, 8], BS)
    with pytest.raises(ValueError, match="full attention in every layer"):
        KVCacheManager(num_blocks=8, block_size=BS, kv_cache_config=windowed, num_host_blocks=4)


def test_block_identity_of_the_host_pool_is_its_own() -> None:
    # NOTE: host block ids index the host tensor: they start at 0 (no null block here).
    pool = HostBlockPool(2, None)
    assert [b.block_id for b in pool.blocks] == [0, 1] and not any(b.is_null for b in pool.blocks)
    assert isinstance(pool.blocks[0], KVCacheBlock)
