"""What one engine's prefix cache holds, in the engine's hashes and in kvmesh's.

An engine's block hash cannot be reproduced outside it (vLLM's covers a seed, tagged extra keys and
its own serialisation), so a ``BlockStored`` is re-hashed with kvmesh's spec from the token ids it
carries, continuing the kvmesh chain of its parent block (docs/block-hashing.md). The mirror keeps,
per engine block, the kvmesh blocks it completed, and forwards a kvmesh hash to the index only when
its count goes 0 -> 1 and its removal only on 1 -> 0: engines do not de-duplicate (vLLM stores and
removes one hash twice when two requests computed the same block), and two engine hashes can map to
one kvmesh hash (an engine key kvmesh does not hash, such as vLLM's seed).

Block sizes: one must divide the other. An engine block of 32 tokens over kvmesh blocks of 16
completes two kvmesh blocks; SGLang's pages of 1 token complete a kvmesh block every 16th page
(the partial tail rides along the chain until then).

Tiers: an engine's ``medium`` says where a block is (vLLM: "GPU", and "CPU" / "STORAGE" for its
offloading connectors; SGLang: "CPU_PINNED", "DISK"); it becomes the kvmesh tier of the forwarded
events (:data:`MEDIUM_TIERS`). An engine block is one entry whatever the tiers holding it, with a
refcount per tier, and a kvmesh block is forwarded per tier on its 0 -> 1 and 1 -> 0 in that tier: a
block vLLM offloads to CPU is ``BlockStored(HOST)``, its removal from CPU ``BlockRemoved(HOST)``, and
its GPU copy's events stay the device's. A store without token ids (vLLM's OffloadingConnector
without ``self_describing_kv_events`` names only the block's hash) is resolved through the entry of
that hash, which the engine's GPU store created.

Skipped, and counted by reason: blocks in a medium with no kvmesh tier (``medium``), blocks that are
not full-attention blocks (sliding-window groups), chains kvmesh cannot hash (multimodal inputs,
prompt embeddings), blocks whose parent the mirror never saw (lost or older than the bridge),
token-less stores of blocks it does not hold (``unknown_block``) and removals of blocks it does not
hold in that tier. This module imports neither zmq nor grpc.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.bridge.engine_events import EngineCleared, EngineEvent, EngineHash, EngineRemoved, EngineStored
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, Tier

FULL_ATTENTION = "full_attention"
MEDIUM_TIERS: dict[str | None, Tier] = {
    None: Tier.DEVICE, "GPU": Tier.DEVICE, "gpu": Tier.DEVICE, "cuda": Tier.DEVICE,
    "CPU": Tier.HOST, "cpu": Tier.HOST, "CPU_PINNED": Tier.HOST,
    "DISK": Tier.DISK, "STORAGE": Tier.DISK,
}
"""An engine's ``medium`` -> kvmesh's tier. vLLM 0.32 (vllm/distributed/kv_events.py: MEDIUM_GPU "GPU",
MEDIUM_CPU "CPU", MEDIUM_STORAGE "STORAGE") says "GPU" on its CPU build too; SGLang 0.5 says
"CPU_PINNED" and "DISK" for its HiCache tiers. Anything else (SGLang's "EXTERNAL": another machine's
memory) is skipped as ``medium``."""
_TIERS = len(Tier)


def check_block_sizes(engine_block_size: int, block_size: int) -> None:
    """Raises ValueError unless one block size divides the other."""
    if engine_block_size < 1 or (engine_block_size % block_size and block_size % engine_block_size):
        raise ValueError(
            f"the engine's block size {engine_block_size} and kvmesh's {block_size} do not divide each other: "
            f"start the engine with --block-size a multiple of {block_size} (vLLM: a multiple of 32 on CPU, 16 "
            "on GPU) or give the bridge --block-size that divides the engine's")


@dataclass(slots=True)
class _Entry:
    """One engine block: where its kvmesh chain stands and what kvmesh blocks it completed."""

    tail: bytes
    """kvmesh hash of the last full kvmesh block at or before this block's end (or the root)."""
    pending: tuple[int, ...]
    """Tokens after ``tail`` that do not fill a kvmesh block yet."""
    owned: tuple[bytes, ...]
    """kvmesh blocks this engine block completed."""
    before: bytes | None
    """The kvmesh block the first of ``owned`` continues; None at a chain's root."""
    refs: list[int]
    """Per tier (``Tier`` value), the engine's stores of this block there not yet removed."""


class EngineMirror:
    """The mirror of one engine server (one data-parallel rank).

    Args:
        model_id, block_size, algorithm: kvmesh's hash spec for the model (as the router hashes).
        max_entries: bound on engine blocks held (a stream that never removes cannot grow it past
            this; the oldest go first, their removals forwarded).
    """

    def __init__(self, model_id: str, block_size: int, algorithm: str, max_entries: int = 1 << 21) -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self._hashers: dict[str | None, BlockHasher] = {None: BlockHasher(model_id, block_size, algorithm)}
        self._model_id, self._algorithm = model_id, algorithm
        self._entries: dict[tuple[EngineHash, int], _Entry] = {}
        self._kv_refs: list[dict[bytes, int]] = [{} for _ in range(_TIERS)]
        """Per tier, kvmesh hash -> engine blocks in that tier that completed it."""
        self._roots: set[bytes] = set()
        """Root hashes of the chains seen (a block right after one has no parent block)."""
        self.skipped: Counter[str] = Counter()
        """Blocks (or events) not mirrored, by reason."""
        self.duplicates = 0
        """Stores of an engine block already held in that tier (counted up, forwarded once)."""
        self.degraded = False
        """Events were lost and could not be replayed: the mirror may miss or keep blocks wrongly
        until the engine clears its cache or restarts."""

    def __len__(self) -> int:
        """kvmesh blocks held on the device."""
        return len(self._kv_refs[Tier.DEVICE])

    def held(self, tier: Tier) -> int:
        """kvmesh blocks held in ``tier``."""
        return len(self._kv_refs[tier])

    @property
    def engine_blocks(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forgets everything (the engine restarted); no event is forwarded."""
        self._entries.clear()
        for refs in self._kv_refs:
            refs.clear()
        self.degraded = False

    def snapshot(self, tier: Tier = Tier.DEVICE) -> list[bytes]:
        """Every kvmesh hash held in ``tier``, oldest first (the device's: a resync's snapshot)."""
        return list(self._kv_refs[tier])

    def holds(self, engine_hash: EngineHash, group: int = 0) -> bool:
        """Whether the engine holds this block in any tier."""
        return (engine_hash, group) in self._entries

    # -- events -------------------------------------------------------------------------------
    def apply(self, event: EngineEvent) -> list[KVCacheEvent]:
        """One engine event; returns the kvmesh events to publish (maybe none)."""
        if isinstance(event, EngineStored):
            return self._stored(event)
        if isinstance(event, EngineRemoved):
            return self._removed(event)
        if isinstance(event, EngineCleared):
            self.clear()
            return [AllBlocksCleared()]
        raise TypeError(f"not an engine event: {type(event).__name__}")

    def apply_all(self, events: Iterable[EngineEvent]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for e in events:
            out += self.apply(e)
        return out

    def _hasher(self, lora: str | None) -> BlockHasher:
        h = self._hashers.get(lora)
        if h is None:
            h = self._hashers[lora] = BlockHasher(self._model_id, self.block_size, self._algorithm, (lora,))
        return h

    def _salt(self, ev: EngineStored) -> str | None:
        """The cache salt of a chain's root block, "" for none; None when kvmesh cannot hash the
        event's extra keys (multimodal ids, prompt-embedding digests, unknown keys)."""
        if not ev.extra_keys:
            return ev.cache_salt or ""
        salt = ev.cache_salt or ""
        for i, keys in enumerate(ev.extra_keys):
            if keys is None:
                continue
            items = keys if isinstance(keys, tuple) else (keys,)
            for k in items:
                if ev.lora_name is not None and k == ev.lora_name:
                    continue  # NOTE: vLLM lists the LoRA name first; it enters every kvmesh block
                if isinstance(k, str) and i == 0 and ev.parent_block_hash is None and not salt:
                    salt = k  # vLLM puts the request's cache_salt in its first block's keys only
                    continue
                return None
        return salt

    def _take(self, entry: _Entry, tier: Tier, new: list[bytes], parent: list[bytes | None]) -> None:
        """Counts one store of ``entry`` in ``tier``; its kvmesh blocks new to the tier join ``new``
        (``parent[0]``: the block the first of them continues)."""
        entry.refs[tier] += 1
        if entry.refs[tier] > 1:
            self.duplicates += 1
            return
        refs = self._kv_refs[tier]
        prev = entry.before
        for k in entry.owned:
            c = refs.get(k, 0)
            refs[k] = c + 1
            if not c:
                if not new:
                    parent[0] = prev
                new.append(k)
            prev = k

    def _stored(self, ev: EngineStored) -> list[KVCacheEvent]:
        n = len(ev.block_hashes)
        tier = MEDIUM_TIERS.get(ev.medium)
        if tier is None:
            self.skipped["medium"] += n
            return []
        if (ev.spec_kind not in (None, FULL_ATTENTION)) or ev.sliding_window:
            self.skipped["not_full_attention"] += n
            return []
        new: list[bytes] = []
        parent: list[bytes | None] = [None]
        if not ev.token_ids:
            # NOTE: a store that names its blocks only (vLLM's offloading connector by default):
            # the blocks' chains are those of the engine's earlier stores of the same hashes.
            for h in ev.block_hashes:
                entry = self._entries.get((h, ev.group_idx))
                if entry is None:
                    self.skipped["unknown_block"] += 1
                else:
                    self._take(entry, tier, new, parent)
            return self._stored_out(new, parent[0], tier, ev.lora_name or "")
        bs = self.block_size
        if ev.block_size % bs and bs % ev.block_size:
            self.skipped["block_size"] += n
            return []
        salt = self._salt(ev)
        if salt is None:
            self.skipped["unhashable"] += n
            return []
        hasher = self._hasher(ev.lora_name)
        if ev.parent_block_hash is None:
            state: tuple[bytes, tuple[int, ...]] | None = (hasher.root(salt), ())
            if len(self._roots) >= 4096:  # one per (salt, LoRA): bounded like the hasher's memo
                self._roots.clear()
            self._roots.add(state[0])
        else:
            held = self._entries.get((ev.parent_block_hash, ev.group_idx))
            # NOTE: an unknown parent matters only to a block not held yet (a duplicate is counted
            # up without it), and then to every block after it in the event.
            state = (held.tail, held.pending) if held is not None else None
        ebs = ev.block_size
        for i, h in enumerate(ev.block_hashes):
            key = (h, ev.group_idx)
            entry = self._entries.get(key)
            if entry is None:
                if state is None:
                    self.skipped["orphan"] += n - i
                    break
                tail, pending = state
                tokens = pending + ev.token_ids[i * ebs:(i + 1) * ebs]
                full = len(tokens) // bs * bs
                owned = tuple(hasher.hash_prompt(tokens[:full], parent=tail)) if full else ()
                before = None if tail in self._roots else tail
                entry = _Entry(owned[-1] if owned else tail, tokens[full:], owned, before, [0] * _TIERS)
                self._entries[key] = entry
            self._take(entry, tier, new, parent)
            state = (entry.tail, entry.pending)
        out = self._stored_out(new, parent[0], tier, ev.lora_name or "")
        if len(self._entries) > self.max_entries:
            out += self._overflow()
        return out

    @staticmethod
    def _stored_out(new: list[bytes], parent: bytes | None, tier: Tier, adapter: str = "") -> list[KVCacheEvent]:
        if not new:
            return []
        # NOTE: off the device a store carries no parent (the contract: blocks reach those tiers one by one)
        return [BlockStored(new, parent if tier == Tier.DEVICE else None, tier=tier, adapter=adapter)]

    def _drop(self, entry: _Entry, tier: Tier, gone: list[bytes]) -> None:
        refs = self._kv_refs[tier]
        for k in entry.owned:
            c = refs.get(k, 0)
            if c <= 1:
                refs.pop(k, None)
                gone.append(k)
            else:
                refs[k] = c - 1

    def _removed(self, ev: EngineRemoved) -> list[KVCacheEvent]:
        tier = MEDIUM_TIERS.get(ev.medium)
        if tier is None:
            self.skipped["medium"] += len(ev.block_hashes)
            return []
        gone: list[bytes] = []
        for h in ev.block_hashes:
            key = (h, ev.group_idx)
            entry = self._entries.get(key)
            if entry is None or entry.refs[tier] <= 0:
                self.skipped["unknown_removed"] += 1
                continue
            entry.refs[tier] -= 1
            if entry.refs[tier] == 0:
                self._drop(entry, tier, gone)
                if not any(entry.refs):
                    del self._entries[key]
        return [BlockRemoved(gone, tier=tier)] if gone else []

    def _overflow(self) -> list[KVCacheEvent]:
        gone: list[list[bytes]] = [[] for _ in range(_TIERS)]
        while len(self._entries) > self.max_entries:
            key = next(iter(self._entries))
            entry = self._entries.pop(key)
            for tier in Tier:
                if entry.refs[tier]:
                    self._drop(entry, tier, gone[tier])
            self.skipped["overflow"] += 1
        return [BlockRemoved(g, tier=t) for t, g in zip(Tier, gone, strict=True) if g]
