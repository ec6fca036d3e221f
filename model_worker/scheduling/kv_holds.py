"""Prefill/decode disaggregation in the block pool: the blocks a prefill worker holds for a decode
worker, and the blocks a decode worker takes in from one.

- **Holds** (the prefill side). When a prefill leg ends, its prompt's full blocks are still cached
  (freed a moment ago, nothing allocated since: the engine holds them in the same step). A hold
  takes a reference on each, so no allocation can evict them while a decode worker reads them; the
  reference goes when the decode worker says it has them (``ReleaseKV``, or the end of its
  ``PullKV`` stream) or when the hold's time is up. Released blocks stay cached: the prefill worker
  keeps its copy until its pool needs the room, as after any request. A hold being read (a
  ``PullKV`` stream copying its bytes) keeps its references past a release until the read ends, so a
  block is never handed out while its bytes are on their way.
- **Imports** (the decode side). The blocks that arrived are given pool blocks, their bytes written
  there (the runner's ``kv_blocks``), and cached under their hashes, parented on the block before
  them, so the prefix cache serves them to the request, the block events announce them to the index
  as stored here, and a later request with the same prefix hits them too. The import keeps a
  reference on them until the request is admitted (its hit then holds them) or leaves.

Only blocks the decode worker lacks travel: it pulls from the end of the prefix it holds. Both sides
run on the engine's step thread (the pool is not thread-safe); this module imports neither torch nor grpc.

NOTE: one KV cache group only (full attention in every layer): a sliding-window group's blocks are
not all kept, so a hold could not promise them (the worker refuses a role other than "both" there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.model_worker.scheduling.block_pool import BlockPool, KVCacheBlock


@dataclass(slots=True)
class Hold:
    """One request's blocks, held for a decode worker."""

    block_hashes: tuple[bytes, ...]
    """The leading run of the prompt's full blocks that was still cached, in chain order."""
    block_ids: tuple[int, ...]
    blocks: list[KVCacheBlock]
    expires_at: float
    readers: int = 0
    """Transfers reading its blocks now (:meth:`KVHolds.read`)."""
    released: bool = False
    """Released while read: its references go when the last reader is done."""


class KVHolds:
    """The prefill side's holds and the decode side's imports, over one block pool.

    Args:
        pool: the worker's block pool (one KV cache group).
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.holds: dict[str, Hold] = {}
        self.imports: dict[str, list[KVCacheBlock]] = {}
        """Per request, the imported blocks referenced until it is admitted."""
        self.num_held_blocks = 0
        self.num_imported_blocks = 0
        """Blocks taken in so far (the decode side)."""

    # -- the prefill side -----------------------------------------------------------------------
    def hold(self, request_id: str, block_hashes: Sequence[bytes], expires_at: float) -> Hold:
        """References the cached blocks of ``block_hashes`` from the first on, up to the first one no
        longer cached, and keeps them under ``request_id`` until :meth:`release` or expiry."""
        self.release(request_id)
        blocks: list[KVCacheBlock] = []
        for h in block_hashes:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            blocks.append(b)
        self.pool.touch(blocks)
        hold = Hold(tuple(block_hashes[:len(blocks)]), tuple(b.block_id for b in blocks), blocks, expires_at)
        self.holds[request_id] = hold
        self.num_held_blocks += len(blocks)
        return hold

    def release(self, request_id: str) -> bool:
        """Drops a hold's references (its blocks stay cached); False when there is none."""
        hold = self.holds.pop(request_id, None)
        if hold is None:
            return False
        if hold.readers:
            hold.released = True  # NOTE: freed by the last reader's done_reading()
        else:
            self._free(hold)
        return True

    def read(self, request_id: str) -> Hold | None:
        """The hold of ``request_id``, its blocks kept until :meth:`done_reading` even if it is released
        meanwhile; None when there is none."""
        hold = self.holds.get(request_id)
        if hold is not None:
            hold.readers += 1
        return hold

    def done_reading(self, hold: Hold) -> None:
        """A reader of ``hold`` is done; a hold released while it was read is freed now."""
        hold.readers -= 1
        if not hold.readers and hold.released:
            self._free(hold)

    def _free(self, hold: Hold) -> None:
        self.num_held_blocks -= len(hold.blocks)
        # NOTE: in reverse, as a request frees its blocks: the prompt's tail is evicted before its head.
        self.pool.free_blocks(reversed(hold.blocks))

    def expire(self, now: float) -> list[str]:
        """Releases every hold whose time is up; their request ids."""
        gone = [rid for rid, h in self.holds.items() if h.expires_at <= now]
        for rid in gone:
            self.release(rid)
        return gone

    # -- the decode side ------------------------------------------------------------------------
    def leading_cached(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the pool holds now."""
        n = 0
        for h in block_hashes:
            if self.pool.get_cached_block(h) is None:
                break
            n += 1
        return n

    def take_in(self, request_id: str, block_hashes: Sequence[bytes], start: int) -> tuple[int, list[int]]:
        """Gives pool blocks to the arrived blocks ``block_hashes[start:]`` and caches them under their
        hashes; returns (the first arrived block that got one, their block ids), which the caller
        fills with the bytes before the next step.

        Arrived blocks that the pool holds meanwhile are skipped, and so is everything past a gap
        before ``start`` (blocks evicted since the pull was planned): a hash cached after a hole
        in its chain would never be hit. The pool must have the free blocks (None-safe: fewer are
        taken in when it has not).
        """
        have = self.leading_cached(block_hashes)
        if have < start:
            return start, []  # NOTE: the prefix the pull continued was evicted meanwhile: nothing fits
        first = max(start, have)
        n = min(len(block_hashes) - first, self.pool.get_num_free_blocks())
        if n <= 0:
            return first, []
        blocks = self.pool.get_new_blocks(n)
        self.pool.cache_imported(blocks, block_hashes[first:first + n], block_hashes[first - 1] if first else None)
        self.imports.setdefault(request_id, []).extend(blocks)
        self.num_imported_blocks += n
        return first, [b.block_id for b in blocks]

    def admitted(self, request_id: str) -> None:
        """The request no longer waits (admitted, aborted or gone): its import references go."""
        blocks = self.imports.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    @property
    def num_held(self) -> int:
        return len(self.holds)
