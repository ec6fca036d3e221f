"""Block lifecycle events a worker publishes to kv_service (1:1 with kvmesh.v1.KVEvent).

Replayed in order into a set, they give exactly the hashes the worker holds. Two blocks may hold
the same hash (the pool does not de-duplicate): each is announced by a BlockStored, and the hash
is removed only when its last block is evicted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]
    """Newly cached full blocks, in chain order."""
    parent_block_hash: bytes | None
    """Hash of the block before the first one here; None when the chain starts at the root."""
    group_id: int = 0
    """KV cache group (hybrid allocators); 0 for full attention."""


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    """Hashes this worker no longer holds."""
    group_id: int = 0
    """KV cache group (hybrid allocators); 0 for full attention."""


@dataclass(slots=True)
class AllBlocksCleared:
    """The worker dropped its whole prefix cache."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
