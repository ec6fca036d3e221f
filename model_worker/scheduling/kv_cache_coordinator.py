"""Drives one single-type manager per KV cache group over the shared block pool.

The hit of a request is the longest prefix valid for every group, found as a fixed point: each
group shortens the candidate length to its own longest hit within it, until no group shortens
it. Allocation is all-or-nothing over the groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.model_worker.scheduling.block_pool import BlockPool, KVCacheBlock
from kvmesh.model_worker.scheduling.kv_cache_spec import FullAttentionSpec, KVCacheConfig
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.scheduling.single_type_managers import SingleTypeKVCacheManager, make_manager


class KVCacheCoordinator:
    """The groups' managers; every per-group argument and result is indexed by group id.

    Args:
        kv_cache_config: the groups (kv_cache_spec.py).
        block_pool: the pool all groups share; it has one cached-block map per group.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, block_pool: BlockPool) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.block_pool = block_pool
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(group.spec, block_pool, i) for i, group in enumerate(kv_cache_config.groups)
        ]
        # NOTE: full-attention groups first: their hits are prefix-closed, so they cut the
        # candidate down once and the sliding-window searches start from the shortest length.
        self._search_order = sorted(
            range(len(self.managers)), key=lambda g: not isinstance(self.managers[g].spec, FullAttentionSpec)
        )

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_num_blocks: int
    ) -> tuple[list[list[KVCacheBlock]], int]:
        """The hit blocks of every group (equal lengths) and the hit length in blocks."""
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        length = max_num_blocks
        changed = True
        while changed:
            changed = False
            for g in self._search_order:
                # NOTE: a sliding-window hit of a shorter length is not a cut of a longer one
                # (its window moves), so each group searches again within the new length.
                hits[g] = self.managers[g].find_longest_cache_hit(block_hashes, length)
                if len(hits[g]) < length:
                    length = len(hits[g])
                    changed = True
            if len(self.managers) == 1:
                break
        return [hit[:length] for hit in hits], length

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[Sequence[KVCacheBlock]]
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(request_id, num_tokens, hit)
            for m, hit in zip(self.managers, new_computed_blocks, strict=True)
        )

    def add_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[Sequence[KVCacheBlock]]) -> None:
        for m, hit in zip(self.managers, new_computed_blocks, strict=True):
            m.add_computed_blocks(request_id, hit)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[list[KVCacheBlock]]:
        return [m.allocate_new_blocks(request_id, num_tokens) for m in self.managers]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.managers[0].req_to_blocks

    def free(self, request_id: str) -> None:
        """Releases every group's blocks of the request, the chain's tail first.

        NOTE: the groups' blocks of one position are freed together (position by position from
        the tail, group 0 first), so the LRU queue evicts a prefix position in every group at about
        the same time and no group's hit outlives another's by much.
        """
        tables = [m.pop_blocks(request_id) for m in self.managers]
        if len(tables) == 1:
            self.block_pool.free_blocks(reversed(tables[0]))
            return
        n = max(len(t) for t in tables)
        self.block_pool.free_blocks(t[i] for i in range(n - 1, -1, -1) for t in tables if i < len(t))

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        out: list[list[int]] = []
        for m in self.managers:
            blocks = m.req_to_blocks.get(request_id)
            out.append([b.block_id for b in blocks] if blocks else [])
        return out
