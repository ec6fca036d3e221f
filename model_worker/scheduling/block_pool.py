"""The pool of KV cache blocks: the blocks, the LRU free queue and the (hash, group) -> block map.

The pool knows nothing about requests' policy (how many blocks a request gets, which prefix it
may reuse); kv_cache_manager.py and single_type_managers.py decide that and call in here. Every
KV cache group (kv_cache_spec.py) draws from this one pool and its one free queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from kvmesh.model_worker.scheduling.request import Request


class HostTier(Protocol):
    """What the pool needs of the tier its evicted blocks go to (host_block_pool.py's HostBlockPool,
    which builds on this module: so the pool names the shape, not the class)."""

    def offload(self, evicted: Sequence[tuple[bytes, int]]) -> None: ...

    def reset(self) -> bool: ...


class KVCacheBlock:
    """One block of ``block_size`` KV slots."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # NOTE: set only while the block is in the cached-block map (full and hashed), together
        # with the group whose map holds it.
        self.block_hash: bytes | None = None
        self.group_id = 0
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Free blocks in eviction order: head = evicted first, tail = evicted last.

    A doubly linked list threaded through the blocks themselves, with two sentinels, so that a
    cache hit can take a block out of the middle in O(1).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} free")
        # NOTE: one walk that unlinks the head run, instead of n popleft() calls (a long prompt
        # allocates hundreds of blocks at once).
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None and block is not self._tail
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail; O(n), for tests and snapshots."""
        out = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """Owns every block, the free queue and the map of cached full blocks.

    Args:
        num_blocks: blocks in the KV cache, including the null block 0.
        enable_caching: keep freed full blocks in the map for prefix reuse.
        enable_events: record stored / removed / cleared events for ``take_events``.
        num_groups: KV cache groups drawing from the pool; each has its own cached-block map.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, enable_events: bool = True, num_groups: int = 1
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # NOTE: block 0 is never handed out nor freed: padded slots of a batch point at it.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # NOTE: no de-duplication: two blocks may hold the same hash (two requests that computed
        # the same prefix concurrently); lookups return the first inserted. Every group's blocks
        # of one prefix share the token-block hash, so the maps are per group: the key is in
        # effect (hash, group).
        self.cached_blocks_by_group: list[dict[bytes, dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)
        ]
        self._events: list[KVCacheEvent] = []
        self.host: HostTier | None = None
        """The host tier evicted blocks go to (host_block_pool.py); None = evicted blocks are gone.
        Set by the KV cache manager, for a pool of one group."""

    def emit(self, event: KVCacheEvent) -> None:
        """Appends an event of another tier to this pool's stream (in order with its own)."""
        self._events.append(event)

    @property
    def cached_block_hash_to_block(self) -> dict[bytes, dict[int, KVCacheBlock]]:
        """Group 0's map: the only one of a full-attention-only model."""
        return self.cached_blocks_by_group[0]

    def get_cached_block(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        blocks = self.cached_blocks_by_group[group_id].get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Hashes ``blocks[num_cached_blocks:num_full_blocks]`` with the request's block hashes
        into ``group_id``'s map.

        Emits one BlockStored for the run, parented on the block before it.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        stored: list[bytes] = []
        cached = self.cached_blocks_by_group[group_id]
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            assert block.block_hash is None, f"{block} is already cached"
            block_hash = request.block_hashes[i]
            block.block_hash = block_hash
            block.group_id = group_id
            cached.setdefault(block_hash, {})[block.block_id] = block
            stored.append(block_hash)
        if self.enable_events and stored:
            parent = request.block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            self._events.append(BlockStored(block_hashes=stored, parent_block_hash=parent, group_id=group_id,
                                            adapter=request.lora_name or ""))

    def cache_imported(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                       parent: bytes | None) -> None:
        """Caches blocks whose KV arrived from another worker (kv_holds.py) under ``block_hashes``, one
        chain run parented on ``parent``: one BlockStored, as a request's own run would give."""
        cached = self.cached_blocks_by_group[0]
        for block, h in zip(blocks, block_hashes, strict=True):
            assert block.block_hash is None, f"{block} is already cached"
            block.block_hash = h
            block.group_id = 0
            cached.setdefault(h, {})[block.block_id] = block
        if self.enable_events and blocks:
            self._events.append(BlockStored(block_hashes=list(block_hashes), parent_block_hash=parent, group_id=0))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes blocks from the head of the free queue (least recently freed first), ref 1 each."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, {self.free_block_queue.num_free_blocks} free")
        new_blocks = self.free_block_queue.popleft_n(num_blocks)
        # group -> evicted hashes; one BlockRemoved per group, in the order groups first evict
        removed: dict[int, list[bytes]] = {}
        offload: list[tuple[bytes, int]] | None = [] if self.host is not None else None
        for block in new_blocks:
            assert block.ref_cnt == 0
            # NOTE: eviction is lazy: a freed block keeps its hash (and stays reusable by a
            # cache hit) until it is handed out again here.
            if block.block_hash is not None and self._evict_cached_block(block):
                removed.setdefault(block.group_id, []).append(block.block_hash)
                if offload is not None:
                    offload.append((block.block_hash, block.block_id))
            block.block_hash = None
            block.group_id = 0
            block.ref_cnt = 1
        if self.enable_events:
            for group_id, hashes in removed.items():
                self._events.append(BlockRemoved(block_hashes=hashes, group_id=group_id))
        if offload:
            # NOTE: after the device's removal, so the stream says removed (device), stored (host).
            assert self.host is not None
            self.host.offload(offload)
        return new_blocks

    def _evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drops ``block`` from the map; True when no other block still holds its hash."""
        assert block.block_hash is not None
        cached = self.cached_blocks_by_group[block.group_id]
        holders = cached.get(block.block_hash)
        if holders is None or holders.pop(block.block_id, None) is None:
            return False
        if holders:
            # NOTE: a duplicate still holds the hash, so the worker still has it: no event.
            return False
        del cached[block.block_hash]
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on cache-hit blocks, pulling free ones off the free queue.

        The null block (a sliding-window hit's entry for a block out of the window) is skipped.
        """
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops a reference on each; those reaching 0 join the queue tail in the given order."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than taken"
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        if self.host is not None and not self.host.reset():
            return False
        for cached in self.cached_blocks_by_group:
            cached.clear()
        for block in self.blocks:
            block.block_hash = None
            block.group_id = 0
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (the null block excluded) that requests hold."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
