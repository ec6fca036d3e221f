"""The host tier: blocks evicted from the device pool, kept in host memory and loaded back.

A second pool of KV blocks (``--host-kv-blocks`` / ``--kv-offloading-size``) below the device pool
(block_pool.py), vLLM's native CPU offloading in shape (vllm/v1/kv_offload/: an LRU manager with
refcounts, stores and loads as the scheduler's output) but filled at eviction, not at compute:

- **Offload.** A device block that the pool hands out again while it holds a hash, and that was
  the last device block holding it, is offered here (``offload``). Its KV is copied device -> host
  before anything writes the device block (the runner runs the step's offloads before its loads
  and its forward pass; model_worker/execution/kv_offload.py). A hash already here only moves to
  the most recently used end: nothing is copied.
- **LRU with refcounts.** Unreferenced host blocks sit in one LRU queue (the device pool's
  ``FreeBlockQueue``), least recently used at its head; a new store takes the head, evicting its
  hash. A block being loaded is referenced and out of the queue until the step's transfers are
  handed to the runner (``take_transfers``), so no store can overwrite it first.
- **Load back.** A request whose device hit is continued by host blocks (``find_run``) gets device
  blocks for them in its allocation and a load per block (host -> device, before the forward
  pass); the host copy stays, most recently used.

Events (the device pool's event list, block_pool.py): a store here is ``BlockStored(HOST)`` after
the device's ``BlockRemoved(DEVICE)``; an eviction here is ``BlockRemoved(HOST)``; a load back is
the device's ``BlockStored(DEVICE)`` of the requesting allocation. One offload batch (one device
allocation) gives at most one host removal and one host store, in that order.

This module imports neither torch nor grpc: the copies are the runner's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.contract.types import BlockRemoved, BlockStored, KVCacheEvent, Tier
from kvmesh.model_worker.scheduling.block_pool import FreeBlockQueue, KVCacheBlock

GIB = 1 << 30


def host_blocks_for(num_blocks: int | None, size_gib: float | None, bytes_per_block: int) -> int:
    """The host tier's block count: ``num_blocks`` as given, or ``size_gib`` GiB of blocks of
    ``bytes_per_block`` (0: no tier). Raises ValueError when the size holds no block."""
    if num_blocks:
        return num_blocks
    if not size_gib:
        return 0
    n = int(size_gib * GIB) // bytes_per_block
    if n < 1:
        raise ValueError(f"--kv-offloading-size {size_gib:g} GiB holds no KV block of {bytes_per_block} bytes; "
                         "give it more, or --host-kv-blocks N")
    return n


@dataclass(slots=True)
class KVTransfers:
    """The copies one step needs before its forward pass.

    NOTE: the runner runs every offload before any load. That order is always right: an offload
    reads a device block evicted this step (its KV is from earlier steps) and may fill the host
    block a later load of this step reads; a load writes a device block that no offload of this
    step reads (a block handed out this step is referenced until the step ends), and reads a host
    block that is referenced until the transfers are taken, so no offload overwrites it.
    """

    offloads: list[tuple[int, int]] = field(default_factory=list)
    """(device block id, host block id): an evicted block's KV, device -> host. At most one per
    host block (the last store into it this step)."""
    loads: list[tuple[int, int]] = field(default_factory=list)
    """(host block id, device block id): a prefix continued from the host tier, host -> device."""

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)


class HostBlockPool:
    """The host tier's blocks, its LRU queue and its hash -> block map.

    Args:
        num_blocks: host blocks (every one usable: there is no null block here).
        emit: where events go (the device pool's event list), or None for no events.
    """

    def __init__(self, num_blocks: int, emit: Callable[[KVCacheEvent], None] | None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # NOTE: every unreferenced block, least recently used first; empty blocks start at the head.
        self.lru = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self._emit = emit
        self._offloads: dict[int, int] = {}
        """host block id -> device block id of this step's offloads (a later store into the same
        host block replaces an earlier one: only the last content is ever read)."""
        self._loads: list[tuple[KVCacheBlock, int]] = []
        self.num_stored = 0
        """Blocks copied device -> host so far."""
        self.num_loaded = 0
        """Blocks copied host -> device so far."""

    def __len__(self) -> int:
        """Hashes held."""
        return len(self.cached)

    def find_run(self, block_hashes: Sequence[bytes], start: int, stop: int) -> list[KVCacheBlock]:
        """The host blocks of ``block_hashes[start:stop]``, from ``start`` up to the first miss."""
        out: list[KVCacheBlock] = []
        cached = self.cached
        for i in range(start, min(stop, len(block_hashes))):
            block = cached.get(block_hashes[i])
            if block is None:
                break
            out.append(block)
        return out

    def offload(self, evicted: Sequence[tuple[bytes, int]]) -> None:
        """Keeps the device blocks the pool just evicted: (hash, device block id), oldest first.

        They join the LRU's recent end in that order: a hash already here only moves there (no
        copy); a new one takes the LRU head block, evicting its hash. When more are offered than
        there are unreferenced host blocks, only the most recent fit (the rest would be the next
        evicted anyway, and are never copied).
        """
        batch: list[tuple[bytes, int, KVCacheBlock | None]] = []
        for h, device_id in evicted:
            held = self.cached.get(h)
            if held is not None and held.ref_cnt > 0:
                continue  # NOTE: being loaded: it rejoins the recent end when the step's transfers go
            batch.append((h, device_id, held))
        room = self.lru.num_free_blocks
        if len(batch) > room:
            batch = batch[len(batch) - room:]
        if not batch:
            return
        for _, _, held in batch:
            if held is not None:
                self.lru.remove(held)
        num_new = sum(1 for _, _, held in batch if held is None)
        slots = self.lru.popleft_n(num_new) if num_new else []
        gone = [b.block_hash for b in slots if b.block_hash is not None]
        for slot in slots:
            if slot.block_hash is not None:
                del self.cached[slot.block_hash]
        new_slots = iter(slots)
        stored: list[bytes] = []
        for h, device_id, held in batch:
            if held is None:
                held = next(new_slots)
                held.block_hash = h
                self.cached[h] = held
                self._offloads[held.block_id] = device_id
                stored.append(h)
            self.lru.append(held)
        self.num_stored += len(stored)
        if self._emit is not None:
            if gone:
                self._emit(BlockRemoved(gone, tier=Tier.HOST))
            if stored:
                self._emit(BlockStored(stored, tier=Tier.HOST))

    def hold(self, blocks: Sequence[KVCacheBlock]) -> None:
        """References blocks about to be loaded, taking them out of the LRU queue; call before the
        device allocation that may offload into this tier, then :meth:`load`."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.lru.remove(block)
            block.ref_cnt += 1

    def load(self, blocks: Sequence[KVCacheBlock], device_ids: Sequence[int]) -> None:
        """Records loads of held ``blocks`` into ``device_ids``; the blocks stay held until the
        transfers are taken."""
        for block, device_id in zip(blocks, device_ids, strict=True):
            assert block.ref_cnt > 0 and block.block_hash is not None, f"{block} is not held"
            self._loads.append((block, device_id))
        self.num_loaded += len(blocks)

    def take_transfers(self) -> KVTransfers | None:
        """This step's copies (None: none), releasing the loaded blocks to the LRU's recent end.

        NOTE: released here, when the scheduler hands the step to the runner: the runner issues
        these copies before the next step's (in order on one copy stream on CUDA), so a later
        store into a released block cannot overtake the load that reads it.
        """
        if not self._offloads and not self._loads:
            return None
        out = KVTransfers([(d, h) for h, d in self._offloads.items()],
                          [(b.block_id, d) for b, d in self._loads])
        for block, _ in self._loads:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.lru.append(block)
        self._offloads = {}
        self._loads = []
        return out

    def reset(self) -> bool:
        """Forgets every hash (no event: the device pool's AllBlocksCleared covers every tier);
        refused (False) while a load holds a block."""
        if self._loads:
            return False
        self.cached.clear()
        self._offloads.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    @property
    def usage(self) -> float:
        """Share of host blocks holding a hash."""
        return len(self.cached) / self.num_blocks
