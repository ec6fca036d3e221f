"""Paged attention over packed ragged batches: the one place the model calls the kernels.

The KV write and the attention run as one opaque custom op, ``torch.ops.kvmesh.paged_attention``
(``torch.library``): under ``torch.compile`` inductor fuses the work around it (norms, rotary,
residuals, activation) and calls the op as it is, so the Triton kernels stay ours. Its inputs are
q, k, v and the layer's index; the caches and the step's metadata come from the forward context
(forward_context.py), as vLLM's ``unified_attention`` takes them.
"""

from __future__ import annotations

import torch
from torch import nn

from kvmesh.kernels import ragged_paged_attention, write_kv_cache
from kvmesh.model_worker.execution.forward_context import AttentionMetadata, current_forward_context


class PagedAttention(nn.Module):
    """Writes the new K/V into this layer's cache, then attends over the cached prefix + new tokens.

    ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, Hkv, D]`` and ``kv_group`` (whose metadata
    this layer reads) are bound by the model runner.
    """

    def __init__(
        self, layer: int, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.kv_group = 0
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
        if torch.compiler.is_compiling():
            return torch.ops.kvmesh.paged_attention(q, k, v, self.layer)
        # NOTE: eager calls skip the op's dispatch (tens of microseconds a layer on a CPU decode step).
        return self.attend(q, k, v, current_forward_context().metas[self.kv_group])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
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


@torch.library.custom_op("kvmesh::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer`` of the current forward context: KV write, then ragged paged attention.

    NOTE: it writes the layer's KV cache, which is not an argument: the cache is no graph input, so
    functionalization never copies it, and the op's output is used, so it is never dropped.
    """
    ctx = current_forward_context()
    attn = ctx.layers[layer]
    # NOTE: compiled code lays out what follows by the fake's (contiguous) strides.
    return attn.attend(q, k, v, ctx.metas[attn.kv_group]).contiguous()


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
