"""Token ids for Mooncake FAST'25 trace lines (read by kvmesh/replay/trace.py), so equal hash ids share
their tokens.

Block ``h``'s tokens are a pseudo-random block drawn from ``(seed, h)``; a prompt is its blocks'
tokens (:meth:`TraceRecord.block_ids`) cut to ``input_length`` (the last block partial). Cache salt: none.
"""

from __future__ import annotations

import numpy as np

from kvmesh.bench.datasets import BenchRequest, TokenRange
from kvmesh.replay.trace import TRACE_BLOCK_TOKENS, TraceRecord


class TraceSynthesizer:
    """Token ids for trace blocks; one cached numpy block per hash id.

    Args:
        seed: the same seed gives the same tokens for the same hash id, across processes.
        tokens: the id range drawn from.
        block_tokens: tokens per trace block (512 for Mooncake).
    """

    def __init__(self, seed: int = 0, tokens: TokenRange | None = None,
                 block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        self.seed = seed
        self.tokens = tokens or TokenRange()
        self.block_tokens = block_tokens
        self._blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        b = self._blocks.get(hash_id)
        if b is None:
            rng = np.random.default_rng([self.seed, int(hash_id < 0), abs(hash_id)])
            b = self._blocks[hash_id] = rng.integers(self.tokens.low, self.tokens.high, self.block_tokens,
                                                     dtype=np.int32)
        return b

    def prompt(self, rec: TraceRecord, index: int = 0) -> list[int]:
        """The request's ``input_length`` tokens. A trace line with fewer hash ids than its length
        needs is padded with blocks private to this request (keyed by ``index``)."""
        return self.prompt_array(rec, index).tolist()

    def prompt_array(self, rec: TraceRecord, index: int = 0) -> np.ndarray:
        """:meth:`prompt` as an int32 array (a 1,500-request replay holds ~20M tokens)."""
        ids = rec.block_ids(index, self.block_tokens)
        if not ids:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate([self.block(h) for h in ids])[: rec.input_length]

    def requests(self, records: list[TraceRecord], speedup: float = 1.0) -> list[BenchRequest]:
        """Bench requests sent at ``timestamp / speedup`` (relative to the first record)."""
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        t0 = records[0].timestamp_ms if records else 0
        return [BenchRequest(self.prompt_array(r, i), max(1, r.output_length), (r.timestamp_ms - t0) / 1000.0 / speedup)
                for i, r in enumerate(records)]
