"""KVCacheManager prefix-caching scenarios (after vLLM's tests/v1/core/test_prefix_caching.py).

Every scenario asserts exact block ids, the exact free-queue order (head = evicted first) and the
exact events. Pools here have 11 blocks: the null block 0 and usable blocks 1..10.
"""

from __future__ import annotations

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, SamplingParams
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.request import Request, RequestStatus

BS = 16
HASHER = BlockHasher("test-model", block_size=BS)
COMMON = list(range(3 * BS))  # three full blocks shared by the requests below


def make_request(request_id: str, tokens: list[int], cache_salt: str = "") -> Request:
    return Request(
        request_id, tokens, SamplingParams(max_tokens=8), block_hasher=HASHER, cache_salt=cache_salt
    )


def make_manager(num_blocks: int = 11, **kwargs: bool) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, **kwargs)


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(m: KVCacheManager, ids: list[int]) -> list[int]:
    return [m.block_pool.blocks[i].ref_cnt for i in ids]


def admit(m: KVCacheManager, req: Request) -> list[int]:
    """A scheduler's first admission: lookup, allocate the rest of the prompt, mark computed."""
    hit_blocks, hit_tokens = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - hit_tokens, hit_tokens, hit_blocks)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in new]


def test_prefill_allocates_caches_full_blocks_and_emits_one_stored() -> None:
    m = make_manager()
    req = make_request("0", COMMON + [3] * 7)  # 55 tokens: 3 full blocks + 7
    assert m.get_computed_blocks(req) == ([], 0)
    assert admit(m, req) == [1, 2, 3, 4]
    assert m.get_block_ids("0") == [1, 2, 3, 4]
    h = req.block_hashes
    assert len(h) == 3
    assert [m.block_pool.blocks[i].block_hash for i in (1, 2, 3, 4)] == [h[0], h[1], h[2], None]
    assert m.cached_block_hashes() == set(h)
    assert free_ids(m) == [5, 6, 7, 8, 9, 10]
    assert m.take_events() == [BlockStored(h, None)]
    assert m.usage == 0.4


def test_hit_while_owner_is_live_then_after_it_is_freed() -> None:
    m = make_manager()
    req0 = make_request("0", COMMON + [3] * 7)
    admit(m, req0)
    m.take_events()

    req1 = make_request("1", COMMON + [5] * 5)
    blocks, hit = m.get_computed_blocks(req1)
    assert ([b.block_id for b in blocks], hit) == ([1, 2, 3], 48)
    assert admit(m, req1) == [5]
    assert m.get_block_ids("1") == [1, 2, 3, 5]
    assert ref_cnts(m, [1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]
    assert free_ids(m) == [6, 7, 8, 9, 10]
    assert m.take_events() == []  # block 5 is partial; the hits were already stored

    # Freed in reverse: the tail of each chain joins the queue first.
    m.free(req0)
    assert free_ids(m) == [6, 7, 8, 9, 10, 4]
    assert ref_cnts(m, [1, 2, 3]) == [1, 1, 1]
    m.free(req1)
    assert free_ids(m) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]
    assert m.get_block_ids("1") == []

    # A hit on free blocks takes them back off the queue; new blocks come from the head.
    req2 = make_request("2", COMMON + [7] * 6)
    assert admit(m, req2) == [6]
    assert m.get_block_ids("2") == [1, 2, 3, 6]
    assert free_ids(m) == [7, 8, 9, 10, 4, 5]
    assert ref_cnts(m, [1, 2, 3, 6]) == [1, 1, 1, 1]
    assert m.take_events() == []
    # Four lookups (req1 was looked up twice), counted in tokens.
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (55 + 53 + 53 + 54, 0 + 48 + 48 + 48)


def test_decode_crossing_a_block_boundary_caches_the_filled_block() -> None:
    m = make_manager()
    req = make_request("0", list(range(2 * BS - 1)))  # 31 tokens
    assert admit(m, req) == [1, 2]
    h0 = req.block_hashes[0]
    assert m.take_events() == [BlockStored([h0], None)]

    req.append_output_token_ids(100)  # token 32 fills block 2
    assert len(req.block_hashes) == 2
    h1 = req.block_hashes[1]
    assert h1 == HASHER.hash_block(h0, list(range(31)[16:]) + [100])
    assert m.allocate_slots(req, 1) == []  # its slot is in block 2
    req.num_computed_tokens += 1
    assert m.block_pool.blocks[2].block_hash == h1
    assert m.take_events() == [BlockStored([h1], h0)]

    req.append_output_token_ids([101])
    new = m.allocate_slots(req, 1)
    assert new is not None and [b.block_id for b in new] == [3]
    assert m.take_events() == []
    assert m.get_block_ids("0") == [1, 2, 3]


def test_eviction_takes_the_lru_chain_tail_first() -> None:
    m = make_manager()
    req0 = make_request("0", COMMON + [3] * 7)
    req1 = make_request("1", list(range(1000, 1000 + 2 * BS)))  # two other full blocks, no tail
    admit(m, req0)
    assert admit(m, req1) == [5, 6]
    m.free(req0)
    m.free(req1)
    assert free_ids(m) == [7, 8, 9, 10, 4, 3, 2, 1, 6, 5]
    m.take_events()

    # Five fresh blocks: 7..10 were never cached, 4 was partial: nothing is evicted.
    req2 = make_request("2", list(range(2000, 2000 + 5 * BS - 1)))
    assert admit(m, req2) == [7, 8, 9, 10, 4]
    stored = req2.block_hashes
    assert m.take_events() == [BlockStored(stored, None)]
    # Two more evict req0's chain from its tail: block 3 (h2) then block 2 (h1).
    req3 = make_request("3", list(range(3000, 3000 + 2 * BS - 1)))
    assert admit(m, req3) == [3, 2]
    h = req0.block_hashes
    assert m.take_events() == [BlockRemoved([h[2], h[1]]), BlockStored([req3.block_hashes[0]], None)]
    assert free_ids(m) == [1, 6, 5]
    # req0's first block survives and is still a hit; the rest of its chain is gone.
    blocks, hit = m.get_computed_blocks(make_request("4", COMMON + [9]))
    assert ([b.block_id for b in blocks], hit) == ([1], BS)
    assert m.cached_block_hashes() == {h[0], *req1.block_hashes, *stored, req3.block_hashes[0]}


def test_not_enough_blocks_changes_nothing() -> None:
    m = make_manager()
    req0 = make_request("0", COMMON + [3] * 7)
    admit(m, req0)
    m.free(req0)
    m.take_events()
    queue_before = free_ids(m)
    assert queue_before == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]

    # Hits 3 free blocks (which would leave the queue) and needs 8 more: 11 > 10 free.
    big = make_request("big", COMMON + list(range(500, 500 + 7 * BS + 1)))
    blocks, hit = m.get_computed_blocks(big)
    assert hit == 48
    assert m.allocate_slots(big, big.num_tokens - hit, hit, blocks) is None
    assert free_ids(m) == queue_before
    assert all(b.ref_cnt == 0 for b in m.block_pool.blocks)
    assert m.get_block_ids("big") == []
    assert m.take_events() == []
    assert m.num_free_blocks == 10
    # Exactly enough (3 hits + 7 new) succeeds, evicting nothing that is still needed.
    fits = make_request("fits", COMMON + list(range(500, 500 + 7 * BS)))
    assert admit(m, fits) == [5, 6, 7, 8, 9, 10, 4]
    assert m.num_free_blocks == 0


def test_reset_prefix_cache_refused_while_in_use() -> None:
    m = make_manager()
    req = make_request("0", COMMON + [3])
    admit(m, req)
    m.take_events()
    assert m.reset_prefix_cache() is False
    assert m.take_events() == []
    m.free(req)
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared()]
    assert m.cached_block_hashes() == set()
    assert m.get_computed_blocks(make_request("1", COMMON + [3])) == ([], 0)


def test_cache_salt_isolates_tenants() -> None:
    m = make_manager()
    admit(m, make_request("a", COMMON + [1], cache_salt="tenant-a"))
    other = make_request("b", COMMON + [1], cache_salt="tenant-b")
    assert m.get_computed_blocks(other) == ([], 0)
    same = make_request("a2", COMMON + [1], cache_salt="tenant-a")
    blocks, hit = m.get_computed_blocks(same)
    assert ([b.block_id for b in blocks], hit) == ([1, 2, 3], 48)


def test_duplicate_full_blocks_are_inserted_without_dedup() -> None:
    m = make_manager()
    a = make_request("a", COMMON + [1])
    b = make_request("b", COMMON + [1])
    # Both look up before either allocates (same step): both miss and compute the prefix.
    assert m.get_computed_blocks(a) == ([], 0)
    assert m.get_computed_blocks(b) == ([], 0)
    assert m.allocate_slots(a, 49) is not None
    assert m.allocate_slots(b, 49) is not None
    assert m.get_block_ids("a") == [1, 2, 3, 4]
    assert m.get_block_ids("b") == [5, 6, 7, 8]
    h = a.block_hashes
    assert m.take_events() == [BlockStored(h, None), BlockStored(h, None)]
    assert list(m.block_pool.cached_block_hash_to_block[h[0]]) == [1, 5]
    assert m.block_pool.get_cached_block(h[0]).block_id == 1

    m.free(a)
    m.free(b)
    assert free_ids(m) == [9, 10, 4, 3, 2, 1, 8, 7, 6, 5]
    # Evicting a's copies (3, 2, 1) leaves b's: the worker still holds the hashes, no removal.
    assert admit(m, make_request("c", list(range(700, 700 + 6 * BS)))) == [9, 10, 4, 3, 2, 1]
    assert [e for e in m.take_events() if isinstance(e, BlockRemoved)] == []
    assert m.block_pool.get_cached_block(h[0]).block_id == 5
    # Evicting the last copies does remove them (tail first).
    assert admit(m, make_request("d", list(range(900, 900 + 3 * BS)))) == [8, 7, 6]  # 8: partial
    assert m.take_events()[0] == BlockRemoved([h[2], h[1]])


def test_last_prompt_token_is_always_recomputed() -> None:
    m = make_manager()
    first = make_request("0", list(COMMON))  # exactly three full blocks
    assert admit(m, first) == [1, 2, 3]
    h = first.block_hashes
    assert m.take_events() == [BlockStored(h, None)]

    again = make_request("1", list(COMMON))
    blocks, hit = m.get_computed_blocks(again)
    assert ([b.block_id for b in blocks], hit) == ([1, 2], 32)  # not the last block
    new = m.allocate_slots(again, 16, hit, blocks)
    assert new is not None and [b.block_id for b in new] == [4]
    # The recomputed last block is cached again as a duplicate of block 3, parented on h[1].
    assert m.take_events() == [BlockStored([h[2]], h[1])]
    assert list(m.block_pool.cached_block_hash_to_block[h[2]]) == [3, 4]


def test_lookahead_slots_are_allocated_but_not_cached() -> None:
    m = make_manager()
    req = make_request("0", list(range(BS)))  # one full block
    new = m.allocate_slots(req, 8, num_lookahead_tokens=BS)
    assert new is not None and [b.block_id for b in new] == [1, 2]
    assert m.take_events() == []  # only 8 tokens computed: no full block yet
    req.num_computed_tokens = 8
    assert m.allocate_slots(req, 8) == []
    assert m.take_events() == [BlockStored([req.block_hashes[0]], None)]


def test_caching_disabled_never_hits_nor_emits() -> None:
    m = make_manager(enable_caching=False)
    req = make_request("0", COMMON + [3])
    assert admit(m, req) == [1, 2, 3, 4]
    m.free(req)
    assert m.get_computed_blocks(make_request("1", COMMON + [3])) == ([], 0)
    assert m.cached_block_hashes() == set()
    assert m.take_events() == []
    assert free_ids(m) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]


def test_request_block_hashes_follow_every_full_block_of_all_tokens() -> None:
    req = make_request("0", list(range(BS + 5)), cache_salt="s")
    assert req.block_hashes == HASHER.hash_prompt(list(range(BS + 5)), "s")
    assert (req.num_tokens, req.num_cached_tokens, req.finish_reason) == (BS + 5, -1, None)
    req.append_output_token_ids(list(range(50, 50 + 2 * BS)))  # fills block 1 and block 2
    req.append_output_token_ids(7)
    assert req.all_token_ids == req.prompt_token_ids + req.output_token_ids
    assert (req.num_tokens, req.num_output_tokens) == (3 * BS + 6, 2 * BS + 1)
    assert req.block_hashes == HASHER.hash_prompt(req.all_token_ids, "s")
    assert len(req.block_hashes) == 3
    plain = Request("1", list(range(2 * BS)), SamplingParams())
    plain.append_output_token_ids(list(range(BS)))
    assert plain.block_hashes == []
    assert [RequestStatus.is_finished(s) for s in RequestStatus] == [False, False, False, True, True, True]
