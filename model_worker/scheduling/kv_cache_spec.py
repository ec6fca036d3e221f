"""What KV each layer keeps (its spec) and how layers are grouped over one block pool.

A model's layers are either full attention (every token keeps its KV) or sliding window ``W``
(a query at position ``p`` reads keys ``p - W + 1 .. p``). Layers of one type are split into
KV cache groups of equal size; the layers of a group share one block table per request, and
every group draws its blocks from the same pool. The page of a block is the same for every
layer of the Llama family (same KV heads and head dim), so one block id names one page in each of
``layers_per_group`` tensors: the memory of a block is ``layers_per_group`` pages, whatever the
number of groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """Every token keeps its KV for the life of the request."""

    block_size: int

    def max_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of ``max_model_len`` tokens holds at its peak."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    """Only the last ``sliding_window`` tokens (the query's own included) are attended to."""

    block_size: int
    sliding_window: int

    @property
    def window_blocks(self) -> int:
        """Cached blocks a prefix hit needs before its end: the ``W - 1`` keys the next token reads."""
        return cdiv(self.sliding_window - 1, self.block_size)

    def max_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request holds at its peak: the window behind a step's first token plus the
        step's tokens (a prefill chunk of up to ``max_num_batched_tokens``), plus one block the
        window may straddle."""
        tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return min(cdiv(tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share one block table per request."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]
    """Model layers of this group, ascending; empty when the manager is built without a model."""


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """The groups of one model over one pool.

    NOTE: groups are ordered full attention first, so group 0 is a full-attention group whenever
    the model has one; group 0 is the group whose blocks a worker publishes (kv_events.py).
    """

    block_size: int
    groups: tuple[KVCacheGroup, ...]

    @property
    def full_attention_only(self) -> bool:
        """No sliding window: a running request's block tables only grow, and change only when a
        block is needed or completed (what the scheduler and the decode graphs rely on)."""
        return all(isinstance(g.spec, FullAttentionSpec) for g in self.groups)

    @classmethod
    def full_attention(cls, block_size: int, num_layers: int = 0) -> KVCacheConfig:
        """One full-attention group: the layout of a model without windows."""
        return cls(block_size, (KVCacheGroup(FullAttentionSpec(block_size), tuple(range(num_layers))),))

    @classmethod
    def from_sliding_windows(cls, sliding_windows: list[int | None], block_size: int) -> KVCacheConfig:
        """Groups a model's layers by type (per layer: its window, None = full attention).

        Every type's layer count is split into groups of ``gcd`` of the counts, so all groups have
        the same number of layers and no group is padded (Gemma-2: 2 groups of L/2; Qwen2 with 2
        of 4 layers windowed: 2 groups of 2; Mistral: 1 sliding-window group of every layer).
        """
        if not sliding_windows:
            raise ValueError("a model needs at least one layer")
        by_type: dict[int | None, list[int]] = {}
        for layer, window in enumerate(sliding_windows):
            by_type.setdefault(window, []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_type.values()))
        types = sorted(by_type, key=lambda w: (w is not None, w or 0))
        groups: list[KVCacheGroup] = []
        for window in types:
            spec: KVCacheSpec = (
                FullAttentionSpec(block_size) if window is None else SlidingWindowSpec(block_size, window)
            )
            layers = by_type[window]
            for i in range(0, len(layers), size):
                groups.append(KVCacheGroup(spec, tuple(layers[i : i + size])))
        return cls(block_size, tuple(groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layer_ids)

    def max_blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks (over all groups) one request of ``max_model_len`` tokens may hold at once."""
        return sum(
            g.spec.max_blocks_per_request(max_model_len, max_num_batched_tokens) for g in self.groups
        )
