"""Mooncake FAST'25 traces: load, and synthesize token ids so equal hash ids share their tokens.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``,
one hash id per 512-token block; equal ids mean a shareable prefix. Block ``h``'s tokens are a
pseudo-random block drawn from ``(seed, h)``; a prompt is its blocks' tokens cut to
``input_length`` (the last block partial). Cache salt: none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmesh.bench.datasets import BenchRequest, TokenRange

TRACE_BLOCK_TOKENS = 512


@dataclass(slots=True, frozen=True)
class TraceRecord:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, max_requests: int | None = None) -> list[TraceRecord]:
    """The first ``max_requests`` lines of a Mooncake JSONL trace (all when None)."""
    out: list[TraceRecord] = []
    with open(path) as f:
        for line in f:
            if max_requests is not None and len(out) >= max_requests:
                break
            if not line.strip():
                continue
            d = json.loads(line)
            out.append(TraceRecord(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                   tuple(d["hash_ids"])))
    return out


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
        need = -(-rec.input_length // self.block_tokens)
        ids = list(rec.hash_ids[:need])
        # NOTE: negative ids never occur in traces: padding blocks cannot collide with real ones.
        ids += [-(index * 1_000_003 + k + 1) for k in range(need - len(ids))]
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
