"""The oracle hit rate: the trace through one LRU prefix cache as large as all workers together.

The LRU itself is the simulator's (kvmesh/sim/oracle.py); this reads a trace into it. It is the hit
rate no routing policy can beat with the same total capacity (one shared cache, no
duplicates, no pinned blocks). Blocks are kvmesh blocks (``block_size`` tokens): trace block ``h``
of ``k`` tokens holds sub-blocks ``(h, 0) .. (h, k // block_size - 1)``. As in the engine, only
leading hits count and the prompt's last token is always computed.
"""

from __future__ import annotations

from kvmesh.replay.trace import TRACE_BLOCK_TOKENS, TraceRecord
from kvmesh.sim.oracle import lru_hit_rate


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
