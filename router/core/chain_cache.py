"""The block chains of recent long prompts, so a prompt that shares full blocks with one of them is hashed
only from where the two part (a shared 100k-token prefix is 6,250 SHA-256 blocks: ~10 ms a request).

Exact by construction: a chain's hash ``i`` depends only on the root (model, algorithm, salt) and the
first ``i + 1`` blocks of ids, so the blocks two prompts share, compared id by id, have the same hashes;
the rest is hashed from the last shared block's hash (``BlockHasher.hash_prompt(parent=...)``).

Entries are found by their first block (a prompt shares no block with one whose first block differs) and
kept in LRU order within ``max_bytes`` (ids as 4-byte words plus 16 bytes a hash). Thread-safe: the live
router hashes long prompts on its tokenizer pool.

No grpc, no redis.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.contract.block_hash import HASH_LEN, BlockHasher, tokens_to_bytes

MIN_BLOCKS = 64
"""Prompts shorter than this many blocks are hashed whole (a 64-block chain takes ~0.1 ms)."""
MAX_BYTES = 64 << 20
PER_FIRST_BLOCK = 8
"""Entries kept per first block (the most recent), bounding the comparisons of one prompt."""


@dataclass(slots=True, eq=False)
class _Entry:
    """NOTE: compared by identity (a kept entry is found again by ``is``, never by its arrays)."""

    ids: np.ndarray
    chain: list[bytes]

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes + len(self.chain) * HASH_LEN


class ChainCache:
    """Args:
    max_bytes: what the entries may hold at most.
    min_blocks: shorter prompts are neither looked up nor kept.
    """

    def __init__(self, max_bytes: int = MAX_BYTES, min_blocks: int = MIN_BLOCKS) -> None:
        self.max_bytes = max_bytes
        self.min_blocks = min_blocks
        self._entries: OrderedDict[tuple, list[_Entry]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hashed_blocks = 0
        """Blocks hashed (the rest came from an entry): what the cache saved is the difference."""
        self.reused_blocks = 0

    def chain(self, hasher: BlockHasher, token_ids: Sequence[int], cache_salt: str = "") -> list[bytes]:
        """``hasher.hash_prompt(token_ids, cache_salt)``, from the longest shared prefix of a kept prompt.
        Raises ValueError as hash_prompt does on ids that cannot be hashed."""
        bs = hasher.block_size
        n_full = len(token_ids) // bs
        if n_full < self.min_blocks:
            return hasher.hash_prompt(token_ids, cache_salt)
        ids = np.frombuffer(tokens_to_bytes(token_ids), dtype="<u4")[: n_full * bs]
        key = (hasher.model_id, hasher.algorithm, bs, hasher.extra_keys, cache_salt, ids[:bs].tobytes())
        with self._lock:
            kept = list(self._entries.get(key, ()))
        best, shared = None, 0
        for e in kept:
            n = min(len(e.ids), len(ids))
            differ = np.flatnonzero(e.ids[:n] != ids[:n])
            blocks = (int(differ[0]) if differ.size else n) // bs
            if blocks > shared:
                best, shared = e, blocks
        if best is None:
            chain = hasher.hash_prompt(ids, cache_salt)
        else:
            chain = best.chain[:shared] + hasher.hash_prompt(ids[shared * bs:], cache_salt, parent=best.chain[shared - 1])
        self._keep(key, _Entry(ids.copy(), chain), best if best is not None and shared == len(best.chain) else None)
        with self._lock:
            self.hashed_blocks += n_full - shared
            self.reused_blocks += shared
        return chain

    def _keep(self, key: tuple, entry: _Entry, subsumed: _Entry | None) -> None:
        """Keeps ``entry`` first in its list (dropping ``subsumed``: a kept prompt the new one extends)."""
        with self._lock:
            entries = self._entries.setdefault(key, [])
            if subsumed is not None and subsumed in entries:
                entries.remove(subsumed)
                self._bytes -= subsumed.nbytes
            entries.insert(0, entry)
            self._bytes += entry.nbytes
            while len(entries) > PER_FIRST_BLOCK:
                self._bytes -= entries.pop().nbytes
            self._entries.move_to_end(key)
            while self._bytes > self.max_bytes and self._entries:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= sum(e.nbytes for e in gone)
