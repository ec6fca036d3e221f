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

Skipped, and counted by reason: blocks that are not full-attention blocks in GPU memory (other
media, sliding-window groups), chains kvmesh cannot hash (multimodal inputs, prompt embeddings),
blocks whose parent the mirror never saw (lost or older than the bridge) and removals of blocks it
does not hold. This module imports neither zmq nor grpc.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.bridge.engine_events import EngineCleared, EngineEvent, EngineHash, EngineRemoved, EngineStored
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

FULL_ATTENTION = "full_attention"
DEVICE_MEDIA = frozenset({None, "GPU", "gpu", "cuda"})
"""Media that mean "in the engine's accelerator memory" (vLLM says "GPU" on its CPU build too)."""


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
    refs: int = 1


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
        self._kv_refs: dict[bytes, int] = {}
        self._roots: set[bytes] = set()
        """Root hashes of the chains seen (a block right after one has no parent block)."""
        self.skipped: Counter[str] = Counter()
        """Blocks (or events) not mirrored, by reason."""
        self.duplicates = 0
        """Stores of an engine block already held (counted up, forwarded once)."""
        self.degraded = False
        """Events were lost and could not be replayed: the mirror may miss or keep blocks wrongly
        until the engine clears its cache or restarts."""

    def __len__(self) -> int:
        """kvmesh blocks held."""
        return len(self._kv_refs)

    @property
    def engine_blocks(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forgets everything (the engine restarted); no event is forwarded."""
        self._entries.clear()
        self._kv_refs.clear()
        self.degraded = False

    def snapshot(self) -> list[bytes]:
        """Every kvmesh hash held, oldest first."""
        return list(self._kv_refs)

    def holds(self, engine_hash: EngineHash, group: int = 0) -> bool:
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

    def _stored(self, ev: EngineStored) -> list[KVCacheEvent]:
        n = len(ev.block_hashes)
        if ev.medium not in DEVICE_MEDIA:
            self.skipped["medium"] += n
            return []
        if (ev.spec_kind not in (None, FULL_ATTENTION)) or ev.sliding_window:
            self.skipped["not_full_attention"] += n
            return []
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
            parent = self._entries.get((ev.parent_block_hash, ev.group_idx))
            # NOTE: an unknown parent matters only to a block not held yet (a duplicate is counted
            # up without it), and then to every block after it in the event.
            state = (parent.tail, parent.pending) if parent is not None else None
        new: list[bytes] = []
        first_parent: bytes | None = None
        ebs = ev.block_size
        for i, h in enumerate(ev.block_hashes):
            key = (h, ev.group_idx)
            entry = self._entries.get(key)
            if entry is not None:
                entry.refs += 1
                self.duplicates += 1
            elif state is None:
                self.skipped["orphan"] += n - i
                break
            else:
                tail, pending = state
                tokens = pending + ev.token_ids[i * ebs:(i + 1) * ebs]
                full = len(tokens) // bs * bs
                owned = tuple(hasher.hash_prompt(tokens[:full], parent=tail)) if full else ()
                entry = _Entry(owned[-1] if owned else tail, tokens[full:], owned)
                self._entries[key] = entry
                prev = tail
                for k in owned:
                    c = self._kv_refs.get(k, 0)
                    self._kv_refs[k] = c + 1
                    if not c:
                        if not new:
                            first_parent = None if prev in self._roots else prev
                        new.append(k)
                    prev = k
            state = (entry.tail, entry.pending)
        out: list[KVCacheEvent] = [BlockStored(new, first_parent)] if new else []
        if len(self._entries) > self.max_entries:
            out += self._overflow()
        return out

    def _drop(self, entry: _Entry, gone: list[bytes]) -> None:
        for k in entry.owned:
            c = self._kv_refs.get(k, 0)
            if c <= 1:
                self._kv_refs.pop(k, None)
                gone.append(k)
            else:
                self._kv_refs[k] = c - 1

    def _removed(self, ev: EngineRemoved) -> list[KVCacheEvent]:
        if ev.medium not in DEVICE_MEDIA:
            self.skipped["medium"] += len(ev.block_hashes)
            return []
        gone: list[bytes] = []
        for h in ev.block_hashes:
            key = (h, ev.group_idx)
            entry = self._entries.get(key)
            if entry is None:
                self.skipped["unknown_removed"] += 1
                continue
            entry.refs -= 1
            if entry.refs <= 0:
                del self._entries[key]
                self._drop(entry, gone)
        return [BlockRemoved(gone)] if gone else []

    def _overflow(self) -> list[KVCacheEvent]:
        gone: list[bytes] = []
        while len(self._entries) > self.max_entries:
            key = next(iter(self._entries))
            self._drop(self._entries.pop(key), gone)
            self.skipped["overflow"] += 1
        return [BlockRemoved(gone)] if gone else []
