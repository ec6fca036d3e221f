"""Paged attention over packed ragged batches: the one place the model calls the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvmesh.kernels import ragged_paged_attention, write_kv_cache


@dataclass(slots=True)
class AttentionMetadata:
    """Where the packed tokens of one step live in the paged KV cache.

    ``T`` new tokens of ``S`` sequences, packed back to back (see kernels/reference.py).
    """

    slot_mapping: torch.Tensor
    """``[T]`` int64: flat cache slot (block * block_size + offset) of each new token."""
    cu_q_lens: torch.Tensor
    """``[S+1]`` int32: sequence s owns tokens ``cu_q_lens[s]:cu_q_lens[s+1]``."""
    kv_lens: torch.Tensor
    """``[S]`` int32: KV length of each sequence including its new tokens."""
    block_tables: torch.Tensor
    """``[S, max_blocks]`` int32, padded with the null block 0."""


class PagedAttention(nn.Module):
    """Writes the new K/V into this layer's cache, then attends over the cached prefix + new tokens.

    ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, Hkv, D]`` are bound by the model runner.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
        # NOTE: the write comes first: kv_lens count the new tokens, so they must be in the cache.
        write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return ragged_paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.cu_q_lens,
            meta.kv_lens,
            meta.block_tables,
            self.scale,
            self.sliding_window,
        )
