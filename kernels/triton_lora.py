"""Batched LoRA in Triton: the semantics of ``kernels.lora_reference.add_lora_ref``.

Two kernels, Punica's BGMV shape (one program per token and output tile, each reading its token's
slot): *shrink* ``h[t] = A[slot_t] @ x[t]`` (rank ``R``, float32) and *expand*
``y[t] += scale[slot_t] * B[slot_t] @ h[t]``. A token of slot -1 (the base model) does nothing. Every
input is a device tensor and no size depends on which slots a batch uses, so a CUDA graph captured
with one batch's ``token_slots`` buffer replays for any other (graph_runner.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    h_ptr,
    in_features,
    rank,
    stride_xt,
    stride_al,
    stride_ar,
    stride_ht,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < in_features, other=0.0).to(tl.float32)
            a = tl.load(
                a_ptr + slot * stride_al + offs_r[:, None] * stride_ar + offs_k[None, :],
                mask=(offs_r[:, None] < rank) & (offs_k[None, :] < in_features),
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        tl.store(h_ptr + t * stride_ht + offs_r, acc, mask=offs_r < rank)


@triton.jit
def _lora_expand_kernel(
    h_ptr,
    b_ptr,
    scales_ptr,
    slots_ptr,
    y_ptr,
    out_features,
    rank,
    stride_ht,
    stride_bl,
    stride_bn,
    stride_yt,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.load(h_ptr + t * stride_ht + offs_r, mask=offs_r < rank, other=0.0)
        b = tl.load(
            b_ptr + slot * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :],
            mask=(offs_n[:, None] < out_features) & (offs_r[None, :] < rank),
            other=0.0,
        ).to(tl.float32)
        scale = tl.load(scales_ptr + slot)
        delta = tl.sum(b * h[None, :], axis=1) * scale
        y_ptrs = y_ptr + t * stride_yt + offs_n
        mask_n = offs_n < out_features
        y = tl.load(y_ptrs, mask=mask_n, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_n)


def add_lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """``add_lora_ref``'s contract: ``y`` ``[T, out]`` += each token's scaled LoRA delta, in place."""
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return
    _, rank, in_features = lora_a.shape
    out_features = lora_b.shape[1]
    # NOTE: the kernels index the last dimension with stride 1.
    x = x.contiguous()
    assert lora_a.stride(2) == 1 and lora_b.stride(2) == 1 and y.stride(1) == 1
    h = torch.empty((num_tokens, rank), dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    _lora_shrink_kernel[(num_tokens,)](
        x, lora_a, token_slots, h, in_features, rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), h.stride(0),
        BLOCK_R=block_r, BLOCK_K=64,
    )
    block_n = 64
    _lora_expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        h, lora_b, scales, token_slots, y, out_features, rank,
        h.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_R=block_r, BLOCK_N=block_n,
    )


__all__ = ["add_lora_triton"]
