"""The oracle hit rate: the trace through one LRU prefix cache as large as all workers together.

It is the hit rate no routing policy can beat with the same total capacity (one shared cache, no
duplicates, no pinned blocks). Blocks are kvmesh blocks (``block_size`` tokens): trace block ``h``
of ``k`` tokens holds sub-blocks ``(h, 0) .. (h, k // block_size - 1)``. As in the engine, only
leading hits count and the prompt's last token is always computed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from kvmesh.bench.trace import TRACE_BLOCK_TOKENS, TraceRecord


def request_blocks(rec: TraceRecord, block_size: int, trace_block: int = TRACE_BLOCK_TOKENS) -> list[tuple[int, int]]:
    """The request's full kvmesh blocks, as (trace hash id, sub-block index), in prompt order."""
    out: list[tuple[int, int]] = []
    per = trace_block // block_size
    n_full = rec.input_length // block_size
    for i in range(n_full):
        j, k = divmod(i, per)
        if j >= len(rec.hash_ids):
            break  # beyond the trace's ids: private padding, never shared
        out.append((rec.hash_ids[j], k))
    return out


def oracle_hit_rate(records: list[TraceRecord], capacity_blocks: int, block_size: int = 16,
                    trace_block: int = TRACE_BLOCK_TOKENS) -> float:
    """Cached prompt tokens / prompt tokens for ``records`` in order through one LRU cache.

    Args:
        records: the trace, in arrival order.
        capacity_blocks: blocks the cache holds (the sum of the workers' usable blocks).
        block_size: tokens per block.
    """
    if trace_block % block_size:
        raise ValueError(f"trace block {trace_block} is not a multiple of block_size {block_size}")
    return lru_hit_rate(((rec.input_length, request_blocks(rec, block_size, trace_block)) for rec in records),
                        capacity_blocks, block_size)


def lru_hit_rate(prompts: Iterable[tuple[int, Sequence[Hashable]]], capacity_blocks: int, block_size: int) -> float:
    """Cached / prompt tokens of ``(prompt length, full blocks in prompt order)`` in arrival order
    through one LRU cache of ``capacity_blocks`` blocks: only leading hits count and the prompt's
    last token is always computed (as in the engine). The simulator's oracle calls it too."""
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
