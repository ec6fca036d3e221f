"""BlockPool and FreeBlockQueue: exact block ids, exact free-queue order, lazy eviction."""

from __future__ import annotations

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, SamplingParams
from kvmesh.model_worker.scheduling.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvmesh.model_worker.scheduling.request import Request

BLOCK_SIZE = 4
HASHER = BlockHasher("test-model", block_size=BLOCK_SIZE)


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4), block_hasher=HASHER)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_remove_popleft_append() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free_blocks == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    assert [b.block_id for b in q.popleft_n(2)] == [1, 3]
    q.append_n([blocks[0], blocks[2]])
    assert [b.block_id for b in q.get_all_free_blocks()] == [4, 0, 2]
    assert q.num_free_blocks == 3
    with pytest.raises(ValueError):
        q.popleft_n(4)
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])  # not in the queue
    assert q.num_free_blocks == 3


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block, *got])  # freeing the null block is a no-op
    assert free_ids(pool) == [1, 2, 3]
    assert pool.null_block.ref_cnt == 0
    assert pool.get_usage() == 0.0


def test_free_appends_in_given_order_and_touch_takes_from_the_middle() -> None:
    pool = BlockPool(num_blocks=6)
    a, b, c, d, e = pool.get_new_blocks(5)
    pool.touch([b])  # b is shared: ref 2
    pool.free_blocks([c, b, a])
    assert free_ids(pool) == [3, 1]  # b still referenced once
    assert b.ref_cnt == 1
    pool.free_blocks([e, b, d])
    assert free_ids(pool) == [3, 1, 5, 2, 4]
    pool.touch([a, b])
    assert free_ids(pool) == [3, 5, 4]
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)


def test_lazy_eviction_emits_removed_when_a_cached_block_is_reused() -> None:
    pool = BlockPool(num_blocks=4)
    req = make_request("r", list(range(8)))
    h0, h1 = req.block_hashes
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert pool.take_events() == [BlockStored([h0, h1], None)]
    assert pool.get_cached_block(h0) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    # Still cached while free: a hit could take them back.
    assert pool.get_cached_block(h1) is blocks[1]
    assert pool.take_events() == []
    got = pool.get_new_blocks(2)  # block 3 (never cached) and block 2 (h1)
    assert [b.block_id for b in got] == [3, 2]
    assert pool.get_cached_block(h1) is None
    assert got[1].block_hash is None
    assert pool.get_cached_block(h0) is blocks[0]
    assert pool.take_events() == [BlockRemoved([h1])]


def test_cache_full_blocks_parent_is_the_block_before_the_run() -> None:
    pool = BlockPool(num_blocks=5)
    req = make_request("r", list(range(12)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 1)
    pool.cache_full_blocks(req, blocks, 1, 3)
    h = req.block_hashes
    assert pool.take_events() == [BlockStored([h[0]], None), BlockStored([h[1], h[2]], h[0])]
    assert [b.block_hash for b in blocks] == h


def test_reset_prefix_cache_only_when_all_blocks_are_free() -> None:
    pool = BlockPool(num_blocks=3)
    req = make_request("r", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    # Reusing a reset block emits no removal: the clear already said it.
    pool.get_new_blocks(2)
    assert pool.take_events() == []


def test_events_disabled_records_nothing() -> None:
    pool = BlockPool(num_blocks=3, enable_events=False)
    req = make_request("r", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.free_blocks(blocks)
    pool.get_new_blocks(2)
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
