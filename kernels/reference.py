"""Torch reference of the ragged paged attention and KV-write kernels.

One source of truth for the semantics that the Triton kernels (kernels/triton_attention.py)
implement and that the CPU engine runs:

* ``q`` ``[T, Hq, D]`` packs the new tokens of S sequences back to back; ``cu_q_lens`` ``[S+1]``
  (int32) delimits them. ``kv_lens`` ``[S]`` is each sequence's total KV length *including* the
  new tokens, whose K/V are already written to the cache.
* ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, Hkv, D]``; ``block_tables`` ``[S, max_blocks]``
  (int32) maps a sequence's logical block j to a physical block.
* Query i of sequence s sits at position ``kv_lens[s] - q_len_s + i`` and attends to keys at
  positions <= it, and > it - sliding_window when a window is given.
* Scores are ``q·k * scale``; with ``softcap`` they become ``softcap * tanh(score / softcap)``.
* GQA: query head h reads KV head ``h // (Hq // Hkv)``. Sequences with zero queries are allowed.
"""

from __future__ import annotations

import torch


def ragged_paged_attention_ref(
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
    """Attention of packed queries over paged KV; returns ``[T, Hq, D]`` in q's dtype."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = cu_q_lens.tolist()
    lens = kv_lens.tolist()
    for s in range(len(lens)):
        q_start, q_end = cu[s], cu[s + 1]
        q_len, kv_len = q_end - q_start, lens[s]
        if q_len == 0:
            continue
        n_blocks = (kv_len + block_size - 1) // block_size
        blocks = block_tables[s, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        qs = q[q_start:q_end].float()  # [q_len, Hq, D]
        k = k.float().repeat_interleave(group, dim=1)  # [kv_len, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes ``key``/``value`` ``[T, Hkv, D]`` into the caches at flat slots (block * block_size + offset).

    A negative slot (padding) is skipped.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)
