"""The oracle: prompts in arrival order through one LRU prefix cache as large as the whole fleet.

No routing policy beats its hit rate with the same total capacity (one shared cache, no duplicates,
no pinned blocks). The simulator's runs report it (kvmesh/sim/run.py) and its work bound builds on
each prompt's oracle hit (kvmesh/sim/work_bound.py); kvmesh/bench/oracle.py reads a trace into it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


def lru_hit_rate(prompts: Iterable[tuple[int, Sequence[Hashable]]], capacity_blocks: int, block_size: int) -> float:
    """Cached / prompt tokens of ``(prompt length, full blocks in prompt order)`` in arrival order
    through one LRU cache of ``capacity_blocks`` blocks: only leading hits count and the prompt's
    last token is always computed (as in the engine). kvmesh/bench/oracle.py calls it on a trace."""
    lengths: list[int] = []

    def counted() -> Iterable[tuple[int, Sequence[Hashable]]]:
        for prompt_len, blocks in prompts:
            lengths.append(prompt_len)
            yield prompt_len, blocks

    hits = lru_hits(counted(), capacity_blocks, block_size)
    total = sum(lengths)
    return sum(hits) / total if total else 0.0


def lru_hits(prompts: Iterable[tuple[int, Sequence[Hashable]]], capacity_blocks: int, block_size: int) -> list[int]:
    """Each prompt's cached tokens through one LRU cache of ``capacity_blocks`` blocks (the rule of
    :func:`lru_hit_rate`), in arrival order."""
    cache: OrderedDict[Hashable, None] = OrderedDict()
    out: list[int] = []
    for prompt_len, blocks in prompts:
        hits = 0
        for b in blocks[: (prompt_len - 1) // block_size]:
            if b not in cache:
                break
            hits += 1
        out.append(hits * block_size)
        # NOTE: touched tail first, so the head is the most recent: the cache drops a chain's
        # tail before its head, as the worker's free queue does (kv_cache_manager.free).
        for b in reversed(blocks):
            cache[b] = None
            cache.move_to_end(b)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return out
