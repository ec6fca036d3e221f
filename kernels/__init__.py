"""Attention and LoRA kernels: torch references (always available) and Triton kernels (CUDA / interpreter).

The engine calls ``ragged_paged_attention``, ``write_kv_cache`` and ``add_lora`` from here. Each call picks its
implementation from the device of its inputs via ``kernels.dispatch.attention_backend`` (the one
place that decides; ``KVMESH_ATTENTION_BACKEND=auto|triton|torch`` overrides). Triton is imported
only when the Triton backend is first used, so CPU-only processes never import it.
"""

from __future__ import annotations

import torch

from kvmesh.kernels.dispatch import attention_backend
from kvmesh.kernels.lora_reference import LoRAGroups, add_lora_ref, lora_groups
from kvmesh.kernels.reference import ragged_paged_attention_ref, write_kv_cache_ref
from kvmesh.kernels.torch_attention import ragged_paged_attention_torch


def ragged_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of packed queries ``[T, Hq, D]`` over a paged KV cache; see kernels/reference.py."""
    if attention_backend(q.device) == "triton":
        from kvmesh.kernels.triton_attention import ragged_paged_attention_triton

        return ragged_paged_attention_triton(
            q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, scale, sliding_window, softcap
        )
    return ragged_paged_attention_torch(
        q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, scale, sliding_window, softcap
    )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``key``/``value`` ``[T, Hkv, D]`` into the caches at flat slots; negative slots skip."""
    if attention_backend(key.device) == "triton":
        from kvmesh.kernels.triton_kv_write import write_kv_cache_triton

        write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    write_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    groups: LoRAGroups | None = None,
) -> None:
    """Adds each token's LoRA delta to ``y`` ``[T, out]`` in place; see kernels/lora_reference.py.
    ``groups`` (the reference's per-slot tokens, computed once per step) is unused by Triton."""
    if attention_backend(x.device) == "triton":
        from kvmesh.kernels.triton_lora import add_lora_triton

        add_lora_triton(y, x, lora_a, lora_b, scales, token_slots)
        return
    add_lora_ref(y, x, lora_a, lora_b, scales, token_slots, groups)


__all__ = [
    "add_lora",
    "add_lora_ref",
    "lora_groups",
    "ragged_paged_attention",
    "ragged_paged_attention_ref",
    "ragged_paged_attention_torch",
    "write_kv_cache",
    "write_kv_cache_ref",
]
