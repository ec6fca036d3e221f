"""The block tables of one KV cache group, with the policy of its layer type.

``FullAttentionManager``: every block of a request stays; a prefix hit is the run of cached
blocks from the start. ``SlidingWindowManager``: blocks that fall wholly out of the window are
freed and their table entries become the null block; a prefix hit only needs the window's blocks
before its end. Both draw from the one ``BlockPool``; kv_cache_coordinator.py drives them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Sequence

from kvmesh.model_worker.scheduling.block_pool import BlockPool, KVCacheBlock
from kvmesh.model_worker.scheduling.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)
from kvmesh.model_worker.scheduling.request import Request


class SingleTypeKVCacheManager(ABC):
    """Per-request block tables of one group.

    Args:
        spec: the layer type of the group.
        block_pool: the pool every group shares.
        group_id: this group's index; keys its cached-block map and its events.
    """

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        # NOTE: a table's null entries, if any, are a prefix of it (sliding window only), and
        # every group's table of one request has the same length: entry i covers tokens
        # [i*bs, (i+1)*bs) in every group.
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # NOTE: num_cached_block[r] leading entries of r's table are cached (hit, cached by r, or
        # null); a request's entry exists from its first allocation until free().
        self.num_cached_block: dict[str, int] = {}

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most ``max_num_blocks`` blocks valid for this group's layers.

        Returns one entry per hit block (the null block where the layers need no KV); its length
        is the hit in blocks.
        """

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees the blocks no token from ``num_computed_tokens`` on will read."""

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free-queue blocks an allocation covering ``num_tokens`` tokens would take.

        NOTE: hit blocks sitting in the free queue count too: touching them takes them out of it.
        """
        num_required = cdiv(num_tokens, self.block_size)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(0, num_required - len(new_computed_blocks) - num_held)
        return num_new + sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)

    def add_computed_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> None:
        """Takes the hit blocks of a newly admitted request (referencing them)."""
        assert request_id not in self.num_cached_block, "hit blocks are only for a new request"
        self.block_pool.touch(blocks)
        self.req_to_blocks[request_id].extend(blocks)
        self.num_cached_block[request_id] = len(blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Extends the table to cover ``num_tokens`` tokens; returns the new blocks."""
        req_blocks = self.req_to_blocks[request_id]
        self.num_cached_block.setdefault(request_id, len(req_blocks))
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []  # NOTE: the common decode step: the table already covers the new token
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Puts the request's full blocks among its first ``num_tokens`` tokens in the map."""
        rid = request.request_id
        num_cached = self.num_cached_block[rid]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full, self.group_id)
        self.num_cached_block[rid] = num_full

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Forgets the request and returns its table (the caller frees the blocks)."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every token's KV stays; hits are left-to-right."""

    def __init__(self, spec: FullAttentionSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[KVCacheBlock]:
        # NOTE: a full-attention hit needs every block before its end, so the first miss ends it.
        blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nothing: every later token reads every earlier one."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window ``W``: only the blocks of the last ``W - 1`` tokens before a step matter."""

    def __init__(self, spec: SlidingWindowSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        self.sliding_window = spec.sliding_window
        self.window_blocks = spec.window_blocks

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_num_blocks: int) -> list[KVCacheBlock]:
        """Right to left: the hit ends after the last run of ``ceil((W-1)/bs)`` cached blocks.

        A hit of ``n`` blocks is valid when the token at ``n*bs`` finds the ``W - 1`` keys before
        it, i.e. blocks ``[n - window_blocks, n)`` are cached; or when blocks ``[0, n)`` all are.
        """
        null = self.block_pool.null_block
        max_num_blocks = min(max_num_blocks, len(block_hashes))
        if self.window_blocks == 0:
            return [null] * max_num_blocks  # W == 1: a token reads only itself
        blocks = [null] * max_num_blocks
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            blocks[i] = block
            run += 1
            if run == self.window_blocks:
                # NOTE: entries set for a broken run lie past a miss, so past i + run: cut off.
                return blocks[: i + run]
        # Reached the start: the leading run is a hit (no token before it is needed).
        return blocks[:run]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees the blocks wholly before the window of the token at ``num_computed_tokens``.

        The freed blocks join the free queue latest first (as ``KVCacheManager.free`` orders a
        chain: its tail is evicted first); their entries become the null block. Cached ones stay
        in the map until evicted, so a later request can still hit them.
        """
        first_useful_block = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        blocks = self.req_to_blocks.get(request_id)
        if first_useful_block <= 0 or not blocks:
            return
        null = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        for i in range(min(first_useful_block, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break  # the nulls are a prefix: everything before is skipped already
            removed.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(removed)


def make_manager(spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> SingleTypeKVCacheManager:
    """The manager of ``spec``'s layer type."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, block_pool, group_id)
    return FullAttentionManager(spec, block_pool, group_id)
