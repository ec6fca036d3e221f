"""Triton reshape-and-cache: scatter new tokens' K/V ``[T, Hkv, D]`` into the paged caches.

Semantics are those of ``kernels.reference.write_kv_cache_ref``: token t goes to flat slot
``slot_mapping[t] = block * block_size + offset``; a negative slot (padding) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    # NOTE: int64 offsets: block * stride_kcb overflows int32 for caches of a few GiB.
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(
        key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask
    )
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
    tl.store(k_dst + dims[None, :] * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + dims[None, :] * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``key``/``value`` ``[T, Hkv, D]`` into the caches in place; same contract as the reference.

    The inputs may be strided views (e.g. slices of a fused QKV projection); values are cast to
    the cache dtype. Slots must be unique among non-negative entries (one writer per slot).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match key heads/head size "
            f"({num_kv_heads}, {head_dim})"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    # ~4K elements per program: all heads of a token for typical shapes (8 x 128 = 1024)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    launch = {"num_warps": 4} if key.is_cuda else {}
    _write_kv_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, num_kv_heads,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        PAGE_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        **launch,
    )  # fmt: skip


__all__ = ["write_kv_cache_triton"]
