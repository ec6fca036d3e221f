"""What KV cache blocks a request gets: prefix-cache hits, new slots, freeing.

One policy per KV cache group (single_type_managers.py: full attention, sliding window) over one
shared pool (block_pool.py), driven by kv_cache_coordinator.py. A model without windows has one
full-attention group, and this class then behaves exactly as a plain full-attention manager.

NOTE: lists of blocks that span groups (a hit, the new blocks of an allocation, ``get_block_ids``)
are group-major: group 0's entries, then group 1's, ...; every group contributes the same number
of entries to a hit (sliding-window groups the null block where they need no KV).
"""

from __future__ import annotations

from kvmesh.contract.types import AllBlocksCleared, KVCacheEvent
from kvmesh.model_worker.scheduling.block_pool import BlockPool, KVCacheBlock
from kvmesh.model_worker.scheduling.host_block_pool import HostBlockPool, KVTransfers
from kvmesh.model_worker.scheduling.kv_cache_coordinator import KVCacheCoordinator
from kvmesh.model_worker.scheduling.kv_cache_spec import FullAttentionSpec, KVCacheConfig, cdiv
from kvmesh.model_worker.scheduling.request import Request

__all__ = ["KVCacheManager", "cdiv"]


class KVCacheManager:
    """Per-request block tables, one per KV cache group, over one BlockPool.

    Args:
        num_blocks: blocks in the KV cache, including the null block 0.
        block_size: tokens per block; must equal the requests' block hasher's.
        enable_caching: reuse cached full blocks across requests.
        log_stats: count prefix-cache queries and hits (in tokens).
        enable_events: record block lifecycle events for ``take_events``.
        kv_cache_config: the model's groups; None = one full-attention group.
        num_host_blocks: blocks of the host tier (host_block_pool.py); 0 = none. Needs prefix
            caching and one full-attention group.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        log_stats: bool = True,
        enable_events: bool = True,
        kv_cache_config: KVCacheConfig | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if kv_cache_config is None:
            kv_cache_config = KVCacheConfig.full_attention(block_size)
        if kv_cache_config.block_size != block_size:
            raise ValueError(f"the KV cache config has blocks of {kv_cache_config.block_size}, not {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.kv_cache_config = kv_cache_config
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_events, kv_cache_config.num_groups)
        self.coordinator = KVCacheCoordinator(kv_cache_config, self.block_pool)
        self.num_groups = kv_cache_config.num_groups
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        """Tokens found cached, on the device or in the host tier."""
        self.host_cache_hits = 0
        """Of those, tokens found in the host tier (loaded back, not recomputed)."""
        self.host_pool: HostBlockPool | None = None
        if num_host_blocks:
            check_host_tier(kv_cache_config, enable_caching)
            pool = self.block_pool
            self.host_pool = pool.host = HostBlockPool(num_host_blocks, pool.emit if enable_events else None)

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
        """The longest cached prefix of the request's full blocks valid for every group.

        Returns:
            The hit blocks, group-major (not yet referenced; pass them to ``allocate_slots``), and
            the number of tokens they cover.
        """
        if not self.enable_caching or not request.block_hashes:
            return [], 0
        # NOTE: the last token is always recomputed, even on a full hit: the model must run on
        # at least one token to produce the logits of the next one.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits, num_hit_blocks = self.coordinator.find_longest_cache_hit(request.block_hashes, max_hit_blocks)
        num_hit_tokens = num_hit_blocks * self.block_size
        if self.log_stats:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        return [b for hit in hits for b in hit], num_hit_tokens

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's prompt the device cache holds now (what :meth:`get_computed_blocks`
        would hit), without counting a query or touching a block."""
        if not self.enable_caching or not request.block_hashes:
            return 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        _, num_hit_blocks = self.coordinator.find_longest_cache_hit(request.block_hashes, max_hit_blocks)
        return num_hit_blocks * self.block_size

    def get_host_blocks(self, request: Request, num_computed_tokens: int) -> list[KVCacheBlock]:
        """The host-tier blocks that continue a device hit of ``num_computed_tokens`` tokens (none
        without a host tier), up to the first block the tier lacks. Counted as cache hits."""
        host = self.host_pool
        if host is None or not request.block_hashes:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size  # the last token is computed
        blocks = host.find_run(request.block_hashes, num_computed_tokens // self.block_size, max_hit_blocks)
        if blocks and self.log_stats:
            n = len(blocks) * self.block_size
            self.prefix_cache_hits += n
            self.host_cache_hits += n
        return blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        host_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Gives the request slots for ``num_new_tokens`` more tokens.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens already have slots.
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: tokens covered by ``new_computed_blocks`` and ``host_blocks``
                (a cache hit).
            new_computed_blocks: hit blocks from ``get_computed_blocks``, on first admission only.
            num_lookahead_tokens: extra slots (speculative tokens); never cached.
            host_blocks: host-tier blocks continuing the hit (``get_host_blocks``), on first
                admission only: each gets a new device block and a load into it this step.

        Returns:
            The newly allocated blocks (group-major), or None when the pool has too few free
            blocks; then no refcount and no free-queue position has changed, except that
            sliding-window blocks out of the window were freed.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        hits = self._split_groups(new_computed_blocks or [])
        coordinator = self.coordinator
        req_id = request.request_id
        # NOTE: sliding-window blocks behind the window of the first token to compute are freed
        # first, even when the allocation then fails: no future token reads them.
        coordinator.remove_skipped_blocks(req_id, request.num_computed_tokens)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if coordinator.get_num_blocks_to_allocate(req_id, num_tokens, hits) > self.block_pool.get_num_free_blocks():
            return None

        if new_computed_blocks:
            assert self.enable_caching, "cache hits with caching disabled"
            coordinator.add_computed_blocks(req_id, hits)
        if host_blocks:
            # NOTE: the host blocks are held before the allocation evicts device blocks into the
            # host tier, so no store of this step can take them. The request's table holds its
            # device hit, so the first new blocks sit at the positions the host blocks continue.
            assert self.host_pool is not None and request.num_computed_tokens == 0
            self.host_pool.hold(host_blocks)
            new_blocks = coordinator.allocate_new_blocks(req_id, num_tokens)
            self.host_pool.load(host_blocks, [b.block_id for b in new_blocks[0][:len(host_blocks)]])
        else:
            new_blocks = coordinator.allocate_new_blocks(req_id, num_tokens)

        if self.enable_caching:
            # NOTE: blocks are cached when scheduled, before the model fills them: a request
            # admitted later in the same step may hit them. That is sound because every layer
            # writes the whole batch's KV before any attention of that layer reads it.
            coordinator.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return [b for group in new_blocks for b in group]

    def _split_groups(self, blocks: list[KVCacheBlock]) -> list[list[KVCacheBlock]]:
        """A group-major hit list -> one list per group."""
        n, rest = divmod(len(blocks), self.num_groups)
        assert rest == 0, "a hit has the same number of entries in every group"
        return [blocks[g * n : (g + 1) * n] for g in range(self.num_groups)]

    def take_transfers(self) -> KVTransfers | None:
        """The copies between the tiers the allocations since the last call need (None: none); the
        scheduler hands them to the runner with the step (``SchedulerOutput.kv_transfers``)."""
        return self.host_pool.take_transfers() if self.host_pool is not None else None

    def free(self, request: Request) -> None:
        """Releases every block of the request; unknown requests are ignored."""
        self.coordinator.free(request.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, group-major (a single group: its block table)."""
        return [i for table in self.coordinator.get_block_ids(request_id) for i in table]

    def num_request_blocks(self, request_id: str) -> int:
        """Length of the request's block table (the same in every group); 0 for an unknown request."""
        return len(self.coordinator.managers[0].req_to_blocks.get(request_id, ()))

    def live_blocks(self, request_id: str) -> list[list[KVCacheBlock]]:
        """Per group, the request's own block list: not a copy, so O(1) per request.

        Read-only for the caller. While the request runs, a full-attention group's list only grows
        (blocks appended at the end); a sliding-window group's may also turn entries into the null
        block in place. Preemption or the end of the request replaces the list (a re-admitted
        request gets a new one): a caller may cache what it read of a list by its identity.
        """
        return [m.req_to_blocks.get(request_id) or [] for m in self.coordinator.managers]

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of every group (null block 0 where a window dropped a block)."""
        return self.coordinator.get_block_ids(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self, all_groups: bool = False) -> list[KVCacheEvent]:
        """Block events since the last call: group 0's (what the worker publishes), or all.

        NOTE: kv_service indexes hashes per worker without a group, so a worker publishes one
        group: group 0, a full-attention group whenever the model has one (it bounds the hit), else
        the sliding-window group of a model windowed in every layer (docs/engine.md, Hybrid KV
        allocator). Replayed into a set, the published events give ``cached_block_hashes()``.
        """
        events = self.block_pool.take_events()
        if all_groups or self.num_groups == 1:
            return events
        return [e for e in events if isinstance(e, AllBlocksCleared) or e.group_id == 0]

    def host_block_hashes(self) -> set[bytes]:
        """Every hash the host tier holds (empty without one)."""
        return set(self.host_pool.cached) if self.host_pool is not None else set()

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host tier (0: none)."""
        return self.host_pool.num_blocks if self.host_pool is not None else 0

    def cached_block_hashes(self) -> set[bytes]:
        """Every hash in group 0's cached-block map: the worker's snapshot for a kv_service resync."""
        return set(self.block_pool.cached_block_hash_to_block)

    def max_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks (all groups) one request of ``max_model_len`` tokens may hold at once."""
        return self.kv_cache_config.max_blocks_per_request(max_model_len, max_num_batched_tokens)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def check_host_tier(kv_cache_config: KVCacheConfig, enable_caching: bool) -> None:
    """Raises ValueError unless a host tier can serve this KV cache: it keeps and loads back
    hashed blocks of one full-attention group."""
    if not enable_caching:
        raise ValueError("a host KV tier needs prefix caching: without it no block is kept to offload "
                         "(drop --no-prefix-caching or the host tier)")
    groups = kv_cache_config.groups
    if len(groups) != 1 or not isinstance(groups[0].spec, FullAttentionSpec):
        raise ValueError(f"a host KV tier needs a model with full attention in every layer; this one has "
                         f"{len(groups)} KV cache group(s) with sliding windows (hybrid models: a later phase)")
