"""Hybrid KV allocator scenarios (after vLLM's hybrid / sliding-window prefix-caching tests).

Block size 2 and window 4 throughout: a sliding-window hit needs ceil((4-1)/2) = 2 cached blocks
before its end. Exact block ids, exact free-queue order, exact events.
"""

from __future__ import annotations

import random

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import BlockRemoved, BlockStored, SamplingParams
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    SlidingWindowSpec,
)
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.scheduling.scheduler import Scheduler

BS, W = 2, 4
HASHER = BlockHasher("test-model", block_size=BS)
FULL = FullAttentionSpec(BS)
SWA = SlidingWindowSpec(BS, W)
HYBRID = KVCacheConfig(BS, (KVCacheGroup(FULL, (0,)), KVCacheGroup(SWA, (1,))))
PURE_SWA = KVCacheConfig(BS, (KVCacheGroup(SWA, (0, 1)),))


def make_request(request_id: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), block_hasher=HASHER)


def make_manager(config: KVCacheConfig, num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, kv_cache_config=config)


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def admit(m: KVCacheManager, req: Request) -> int:
    """Lookup + allocate the whole rest of the prompt; returns the hit in tokens."""
    hit_blocks, hit_tokens = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - hit_tokens, hit_tokens, hit_blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return hit_tokens


def evict(m: KVCacheManager, group_id: int, block_hash: bytes) -> None:
    """Drops a hash from one group's map, as if the pool had handed its block out again."""
    m.block_pool.cached_blocks_by_group[group_id].pop(block_hash)


# --- layer grouping ------------------------------------------------------------------------------


def test_layers_grouped_by_type_full_first_equal_sizes() -> None:
    gemma2 = KVCacheConfig.from_sliding_windows([4096, None] * 4, 16)
    assert [(type(g.spec).__name__, g.layer_ids) for g in gemma2.groups] == [
        ("FullAttentionSpec", (1, 3, 5, 7)),
        ("SlidingWindowSpec", (0, 2, 4, 6)),
    ]
    qwen2 = KVCacheConfig.from_sliding_windows([None, None, 24, 24], 16)
    assert [g.layer_ids for g in qwen2.groups] == [(0, 1), (2, 3)] and qwen2.layers_per_group == 2
    mistral = KVCacheConfig.from_sliding_windows([32, 32], 16)
    assert mistral.groups == (KVCacheGroup(SlidingWindowSpec(16, 32), (0, 1)),)
    uneven = KVCacheConfig.from_sliding_windows([None, None, None, 8, 8, 8, 8, 8, 8], 16)
    assert [g.layer_ids for g in uneven.groups] == [(0, 1, 2), (3, 4, 5), (6, 7, 8)]
    assert KVCacheConfig.from_sliding_windows([None] * 3, 16) == KVCacheConfig.full_attention(16, 3)


def test_max_blocks_per_request_window_plus_one_step() -> None:
    assert FULL.max_blocks_per_request(100, 8) == 50
    # The window's 3 keys + an 8-token chunk = 11 tokens = 6 blocks, + 1 the window may straddle.
    assert SWA.max_blocks_per_request(100, 8) == 7
    assert SWA.max_blocks_per_request(6, 8) == 3  # never more than the request's own length
    assert HYBRID.max_blocks_per_request(100, 8) == 57
    # 4096-window Mistral at 8k context with a 2048-token step: 385 blocks of 16, not 512.
    assert SlidingWindowSpec(16, 4096).max_blocks_per_request(8192, 2048) == 385


# --- sliding-window hit search -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("cached", "hit_blocks", "real"),
    [
        # cached[i]: block i is in the map. Right to left, the hit ends after the last run of 2.
        ("TTTTTTTTTT", 10, [8, 9]),
        ("TTTFFTTFFF", 7, [5, 6]),
        ("TTTFFTTFFT", 7, [5, 6]),
        ("TFTFTFTFTF", 1, [0]),  # no run of 2: only the leading run from the start
        ("TTFTF", 2, [0, 1]),
        ("FTTFF", 3, [1, 2]),
        ("FTFTF", 0, []),
        ("FFFFF", 0, []),
        ("T", 1, [0]),
    ],
)
def test_sliding_window_possible_cached_prefix(cached: str, hit_blocks: int, real: list[int]) -> None:
    m = make_manager(PURE_SWA, num_blocks=12)
    req = make_request("0", list(range(len(cached) * BS + 1)))
    blocks = m.block_pool.get_new_blocks(len(cached))
    for i, (flag, block) in enumerate(zip(cached, blocks, strict=True)):
        if flag == "T":
            block.block_hash = req.block_hashes[i]
            m.block_pool.cached_blocks_by_group[0][block.block_hash] = {block.block_id: block}
    hit = m.coordinator.managers[0].find_longest_cache_hit(req.block_hashes, len(cached))
    assert len(hit) == hit_blocks
    assert [b.block_id for b in hit] == [blocks[i].block_id if i in real else 0 for i in range(hit_blocks)]


# --- hybrid (full + sliding window) hits --------------------------------------------------------


def hybrid_after_one_request() -> tuple[KVCacheManager, list[bytes]]:
    """A 13-token request (6 full blocks + 1 token) computed and freed: every block cached."""
    m = make_manager(HYBRID, num_blocks=17)  # null + 16
    req = make_request("a", list(range(13)))
    assert admit(m, req) == 0
    assert m.get_group_block_ids("a") == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    assert m.get_block_ids("a") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    m.free(req)
    # Position by position from the tail, group 0 first.
    assert free_ids(m) == [15, 16, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8]
    return m, req.block_hashes


def hit_of(m: KVCacheManager, tokens: int = 13) -> tuple[list[int], int]:
    blocks, hit = m.get_computed_blocks(make_request("probe", list(range(tokens))))
    return [b.block_id for b in blocks], hit


def test_hybrid_full_hit_then_sliding_window_block_outside_window_evicted_keeps_hit() -> None:
    m, h = hybrid_after_one_request()
    # Group-major: the full group's 6 blocks, then the window group's (nulls before its window).
    assert hit_of(m) == ([1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 12, 13], 12)
    evict(m, 1, h[0])
    evict(m, 1, h[3])
    assert hit_of(m) == ([1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 12, 13], 12)


def test_hybrid_evicting_the_first_full_attention_block_is_a_miss() -> None:
    m, h = hybrid_after_one_request()
    evict(m, 0, h[0])
    assert hit_of(m) == ([], 0)


def test_hybrid_evicting_the_last_block_of_one_type_shrinks_the_hit() -> None:
    m, h = hybrid_after_one_request()
    evict(m, 0, h[5])  # full attention: the hit ends before block 5; the window then ends at 5 too
    assert hit_of(m) == ([1, 2, 3, 4, 5, 0, 0, 0, 11, 12], 10)

    m, h = hybrid_after_one_request()
    evict(m, 1, h[5])  # window: blocks 3, 4 end a valid window; full attention is cut to match
    assert hit_of(m) == ([1, 2, 3, 4, 5, 0, 0, 0, 11, 12], 10)

    m, h = hybrid_after_one_request()
    evict(m, 1, h[4])  # window: 5 alone is no window; 2, 3 are
    assert hit_of(m) == ([1, 2, 3, 4, 0, 0, 10, 11], 8)


def test_hybrid_fixed_point_window_search_reruns_within_the_shorter_full_hit() -> None:
    m, h = hybrid_after_one_request()
    evict(m, 0, h[4])  # full: 4 blocks
    evict(m, 1, h[2])  # window within 4: blocks 2, 3 are not both there; leading run 0, 1
    assert hit_of(m) == ([1, 2, 8, 9], 4)


def test_hybrid_hit_admission_touches_real_blocks_only_and_frees_in_lockstep() -> None:
    m, _ = hybrid_after_one_request()
    req = make_request("b", list(range(13)))
    assert admit(m, req) == 12
    assert m.get_group_block_ids("b") == [[1, 2, 3, 4, 5, 6, 15], [0, 0, 0, 0, 12, 13, 16]]
    assert m.block_pool.null_block.ref_cnt == 0
    assert free_ids(m) == [7, 14, 11, 10, 9, 8]
    m.free(req)
    assert free_ids(m) == [7, 14, 11, 10, 9, 8, 15, 16, 6, 13, 5, 12, 4, 3, 2, 1]
    assert m.num_free_blocks == 16


# --- sliding window: skipped blocks ------------------------------------------------------------


def test_sliding_window_decode_frees_blocks_that_leave_the_window_in_order() -> None:
    m = make_manager(PURE_SWA, num_blocks=11)
    req = make_request("0", [10, 11, 12, 13, 14])
    assert admit(m, req) == 0
    assert m.get_block_ids("0") == [1, 2, 3] and free_ids(m) == [4, 5, 6, 7, 8, 9, 10]
    steps = [
        # (table after the step, free queue after it): the token at position p reads p-3..p.
        ([0, 2, 3], [4, 5, 6, 7, 8, 9, 10, 1]),  # computes pos 5: block 0 (pos 0, 1) is out
        ([0, 2, 3, 4], [5, 6, 7, 8, 9, 10, 1]),  # pos 6: block 1 still holds pos 3
        ([0, 0, 3, 4], [5, 6, 7, 8, 9, 10, 1, 2]),  # pos 7
        ([0, 0, 3, 4, 5], [6, 7, 8, 9, 10, 1, 2]),  # pos 8
    ]
    for table, queue in steps:
        req.append_output_token_ids(20 + req.num_tokens)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        assert (m.get_block_ids("0"), free_ids(m)) == (table, queue)
    # The freed blocks stay cached: a prompt sharing the first 8 tokens hits via blocks 2, 3.
    m.free(req)
    assert free_ids(m) == [6, 7, 8, 9, 10, 1, 2, 5, 4, 3]
    blocks, hit = m.get_computed_blocks(make_request("1", req.all_token_ids[:8] + [99]))
    assert ([b.block_id for b in blocks], hit) == ([0, 0, 3, 4], 8)


def test_sliding_window_chunked_prefill_frees_several_blocks_latest_first() -> None:
    m = make_manager(PURE_SWA, num_blocks=11)
    req = make_request("0", list(range(14)))
    assert m.allocate_slots(req, 2) is not None  # chunk 1: pos 0-1
    req.num_computed_tokens = 2
    assert m.allocate_slots(req, 10) is not None  # chunk 2: pos 2-11, reads from pos -1
    req.num_computed_tokens = 12
    assert m.get_block_ids("0") == [1, 2, 3, 4, 5, 6] and free_ids(m) == [7, 8, 9, 10]
    assert m.allocate_slots(req, 2) is not None  # chunk 3: pos 12-13 read from pos 9: block 4 on
    assert m.get_block_ids("0") == [0, 0, 0, 0, 5, 6, 7]
    assert free_ids(m) == [8, 9, 10, 4, 3, 2, 1]
    assert m.take_events() == [
        BlockStored(req.block_hashes[:1], None),
        BlockStored(req.block_hashes[1:6], req.block_hashes[0]),
        BlockStored(req.block_hashes[6:7], req.block_hashes[5]),
    ]


def test_sliding_window_failed_allocation_still_frees_out_of_window_blocks_only() -> None:
    m = make_manager(PURE_SWA, num_blocks=5)
    req = make_request("0", list(range(8)))
    assert admit(m, req) == 0
    assert m.get_block_ids("0") == [1, 2, 3, 4] and free_ids(m) == []
    req.append_output_token_ids(50)
    # pos 8 reads pos 5-8: blocks 0, 1 leave the window, and 2 blocks come free for pos 8-10.
    new = m.allocate_slots(req, 1, num_lookahead_tokens=2)
    assert new is not None and [b.block_id for b in new] == [2, 1]
    assert m.get_block_ids("0") == [0, 0, 3, 4, 2, 1] and free_ids(m) == []

    m = make_manager(PURE_SWA, num_blocks=5)
    req = make_request("0", list(range(8)))
    admit(m, req)
    req.append_output_token_ids(50)
    assert m.allocate_slots(req, 1, num_lookahead_tokens=4) is None  # pos 8-12 need 3 blocks
    # The out-of-window blocks were freed all the same; nothing else changed.
    assert m.get_block_ids("0") == [0, 0, 3, 4] and free_ids(m) == [2, 1]


# --- events ------------------------------------------------------------------------------------


def test_events_carry_the_group_and_the_worker_publishes_group_0() -> None:
    m = make_manager(HYBRID, num_blocks=13)
    a = make_request("a", list(range(9)))  # 4 full blocks + 1 token
    admit(m, a)
    h = a.block_hashes
    assert m.get_group_block_ids("a") == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert m.take_events(all_groups=True) == [BlockStored(h, None, group_id=0), BlockStored(h, None, group_id=1)]
    m.free(a)
    assert free_ids(m) == [11, 12, 5, 10, 4, 9, 3, 8, 2, 7, 1, 6]
    b = make_request("b", [7] * 5)
    admit(m, b)
    # Group 0 takes 11, 12, 5; group 1 takes 10, 4, 9: one pool, so group 1 evicts a block of
    # group 0 (4, position 3) as well as its own (9). Blocks 5 and 10 were never full.
    assert m.get_group_block_ids("b") == [[11, 12, 5], [10, 4, 9]]
    hb = b.block_hashes
    assert m.take_events(all_groups=True) == [
        BlockRemoved([h[3]], group_id=0),
        BlockRemoved([h[3]], group_id=1),
        BlockStored(hb, None, group_id=0),
        BlockStored(hb, None, group_id=1),
    ]
    assert m.cached_block_hashes() == {h[0], h[1], h[2], hb[0], hb[1]}
    m.free(b)
    c = make_request("c", list(range(9)))
    assert admit(m, c) == 6  # full: 3 blocks; window: blocks 1, 2 end a valid window
    assert m.get_group_block_ids("c") == [[1, 2, 3, 6, 5], [0, 7, 8, 9, 12]]
    # Published: group 0 only (its block 12 was evicted by group 1's allocation).
    assert m.take_events() == [BlockRemoved([hb[1]], group_id=0), BlockStored([h[3]], h[2], group_id=0)]


def test_published_events_replay_to_the_snapshot_under_random_hybrid_load() -> None:
    rng = random.Random(5)
    m = make_manager(HYBRID, num_blocks=30)
    held: set[bytes] = set()
    live: list[Request] = []
    for i in range(300):
        if live and (rng.random() < 0.4 or len(live) > 3):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            base = rng.choice([[1, 2, 3, 4, 5, 6], [9, 9, 9, 9], []])
            req = make_request(str(i), base + [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            hit_blocks, hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, hit_blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                live.append(req)
        for e in m.take_events():
            assert e.group_id == 0
            if isinstance(e, BlockStored):
                held.update(e.block_hashes)
            else:
                held.difference_update(e.block_hashes)
        assert held == m.cached_block_hashes()


# --- scheduler over the hybrid manager ---------------------------------------------------------


def test_scheduler_accepts_a_pool_smaller_than_max_model_len_when_windows_bound_it() -> None:
    kv = make_manager(PURE_SWA, num_blocks=8)  # 7 usable = 14 tokens; a window request needs 5
    Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_model_len=100), kv)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_model_len=100), make_manager(HYBRID, 8))


@pytest.mark.parametrize(("config", "num_blocks"), [(HYBRID, 40), (PURE_SWA, 12)], ids=["hybrid", "pure-swa"])
def test_no_leaked_blocks_after_drain_with_preemption_aborts_and_shared_prefixes(
    config: KVCacheConfig, num_blocks: int
) -> None:
    rng = random.Random(11)
    kv = make_manager(config, num_blocks=num_blocks)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=12, max_model_len=40), kv)
    prefix = list(range(100, 110))
    for i in range(30):
        tokens = (prefix if i % 2 else []) + [rng.randrange(90) for _ in range(rng.randrange(1, 16))]
        sched.add_request(make_request(str(i), tokens, max_tokens=rng.randrange(1, 16)))
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for s in out.scheduled:
            tables = s.block_tables
            assert len({len(t) for t in tables}) == 1, "every group's table has one length"
            for spec, table in zip((g.spec for g in config.groups), tables, strict=True):
                first_needed = max(0, s.start - W + 1) // BS if isinstance(spec, SlidingWindowSpec) else 0
                assert 0 not in table[first_needed:], "a block the step reads is missing"
        sampled = {s.request.request_id: [7] for s in out.scheduled if s.sample}
        sched.update_from_output(out, sampled)
        if steps % 7 == 3 and sched.running:
            sched.abort_request(sched.running[-1].request_id)
        steps += 1
    assert sched.num_preemptions > 0
    assert kv.num_free_blocks == num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.prefix_cache_hits > 0
