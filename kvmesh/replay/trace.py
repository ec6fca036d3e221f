"""Mooncake FAST'25 traces: the one reader, for the live bench and the simulator.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``,
one hash id per 512-token block; equal ids mean a shareable prefix. What a block's tokens are is the
replayer's choice (the live bench draws token ids per id, kvmesh/bench/trace.py; the simulator makes
segments, kvmesh/sim/workload.py); which blocks a prompt is made of is :meth:`TraceRecord.block_ids`,
the same for both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


@dataclass(slots=True, frozen=True)
class TraceRecord:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_ids(self, index: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
        """The ids of the blocks its prompt is made of: as many as ``input_length`` needs (the last
        one cut), a line with too few padded with blocks private to request ``index``."""
        need = -(-self.input_length // block_tokens)
        ids = list(self.hash_ids[:need])
        # NOTE: negative ids never occur in traces: padding blocks cannot collide with real ones.
        return ids + [-(index * 1_000_003 + k + 1) for k in range(need - len(ids))]


def load_trace(path: str | Path, max_requests: int | None = None, skip: int = 0) -> list[TraceRecord]:
    """The lines of a Mooncake JSONL trace: ``max_requests`` of them (all when None) after the first
    ``skip`` (a later segment of the trace)."""
    out: list[TraceRecord] = []
    seen = 0
    with open(path) as f:
        for line in f:
            if max_requests is not None and len(out) >= max_requests:
                break
            if not line.strip():
                continue
            seen += 1
            if seen <= skip:
                continue
            d = json.loads(line)
            out.append(TraceRecord(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                   tuple(d["hash_ids"])))
    return out
