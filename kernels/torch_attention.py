"""The CPU attention path: the reference semantics, with decode rows batched.

kernels/reference.py loops over sequences in Python, which dominates a CPU engine step once a
batch holds dozens of decodes. Here every sequence with exactly one query (a decode) is handled
in one batched gather + einsum; sequences with several queries (prefill chunks) go through the
reference. Same arguments, same results (tests/kernels/test_torch_attention.py).
"""

from __future__ import annotations

import torch

from kvmesh.kernels.reference import ragged_paged_attention_ref


def _batched_decode(
    q: torch.Tensor,  # [S, Hq, D], one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_len = int(kv_lens.max())
    n_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :n_blocks].long()
    # [S, n_blocks * block_size, Hkv, D]; positions past a sequence's length are masked below.
    k = k_cache[tables].reshape(num_seqs, -1, num_kv_heads, head_dim).float()
    v = v_cache[tables].reshape(num_seqs, -1, num_kv_heads, head_dim).float()
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("shgd,slhd->shgl", qg, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(k.shape[1], device=q.device)[None, :]
    last = (kv_lens.to(q.device).long() - 1)[:, None]  # the query's own position
    mask = pos <= last
    if sliding_window is not None:
        mask &= pos > last - sliding_window
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shgl,slhd->shgd", probs, v)
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)


def ragged_paged_attention_torch(
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
    """Same contract as ``ragged_paged_attention_ref``."""
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    decode = q_lens == 1
    n_decode = int(decode.sum())
    if n_decode < 2:
        return ragged_paged_attention_ref(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, scale,
                                          sliding_window, softcap)
    out = torch.empty_like(q)
    starts = cu_q_lens[:-1].long()
    rows = starts[decode]
    out[rows] = _batched_decode(q[rows], k_cache, v_cache, kv_lens[decode], block_tables[decode], scale,
                                sliding_window, softcap)
    rest = ~decode & (q_lens > 0)
    if bool(rest.any()):
        # Prefill chunks: the reference, on the sub-batch of those sequences.
        idx = rest.nonzero().flatten()
        spans = [torch.arange(int(cu_q_lens[i]), int(cu_q_lens[i + 1])) for i in idx.tolist()]
        token_rows = torch.cat(spans).to(q.device)
        sub_cu = torch.zeros(len(spans) + 1, dtype=cu_q_lens.dtype, device=cu_q_lens.device)
        sub_cu[1:] = torch.cumsum(q_lens[idx], 0)
        out[token_rows] = ragged_paged_attention_ref(q[token_rows], k_cache, v_cache, sub_cu, kv_lens[idx],
                                                     block_tables[idx], scale, sliding_window, softcap)
    return out
