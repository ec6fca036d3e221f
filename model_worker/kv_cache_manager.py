"""What KV cache blocks a request gets: prefix-cache hits, new slots, freeing.

The policy here is full attention (every token keeps its slot). The pool (block_pool.py) is
shared state; a hybrid allocator would put several such policies (full, sliding window) over one
pool, each keeping its own per-request block table.
"""

from __future__ import annotations

from collections import defaultdict

from model_worker.block_pool import BlockPool, KVCacheBlock
from model_worker.kv_events import KVCacheEvent
from model_worker.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables over one BlockPool.

    Args:
        num_blocks: blocks in the KV cache, including the null block 0.
        block_size: tokens per block; must equal the requests' block hasher's.
        enable_caching: reuse cached full blocks across requests.
        log_stats: count prefix-cache queries and hits (in tokens).
        enable_events: record block lifecycle events for ``take_events``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        log_stats: bool = True,
        enable_events: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_events)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # NOTE: num_cached_block[r] full blocks of r are in the hash map (hit or cached by r);
        # a request's entry exists from its first allocate_slots until free().
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks.

        Returns:
            The hit blocks (not yet referenced; pass them to ``allocate_slots``) and the number
            of tokens they cover.
        """
        if not self.enable_caching or not request.block_hashes:
            return [], 0
        # NOTE: the last token is always recomputed, even on a full hit: the model must run on
        # at least one token to produce the logits of the next one.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        if self.log_stats:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Gives the request slots for ``num_new_tokens`` more tokens.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens already have slots.
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: tokens covered by ``new_computed_blocks`` (a cache hit).
            new_computed_blocks: hit blocks from ``get_computed_blocks``, on first admission only.
            num_lookahead_tokens: extra slots (speculative tokens); never cached.

        Returns:
            The newly allocated blocks, or None when the pool has too few free blocks; then no
            refcount and no free-queue position has changed.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        new_computed_blocks = new_computed_blocks or []
        req_id = request.request_id
        req_blocks = self.req_to_blocks[req_id]
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # NOTE: hit blocks sitting in the free queue count against the free blocks too: touching
        # them takes them out of it.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                del self.req_to_blocks[req_id]
            return None

        if new_computed_blocks:
            assert self.enable_caching, "cache hits with caching disabled"
            assert req_id not in self.num_cached_block, "hit blocks are only for a new request"
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        self.num_cached_block.setdefault(req_id, len(new_computed_blocks))
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # NOTE: blocks are cached when scheduled, before the model fills them: a request
            # admitted later in the same step may hit them. That is sound because every layer
            # writes the whole batch's KV before any attention of that layer reads it.
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            self._cache_blocks(request, num_tokens_to_cache)
        return new_blocks

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        num_cached = self.num_cached_block[request.request_id]
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request.request_id], num_cached, num_full
        )
        self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Releases every block of the request; unknown requests are ignored."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        # NOTE: reversed so the chain's tail is evicted before its head: the head is the prefix
        # other requests are most likely to share.
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        blocks = self.req_to_blocks.get(request_id)
        return [b.block_id for b in blocks] if blocks else []

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> set[bytes]:
        """Every hash in the cached-block map: the worker's snapshot for a kv_service resync."""
        return set(self.block_pool.cached_block_hash_to_block)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
