"""The CPU attention path: the reference semantics on torch's fused attention kernel.

kernels/reference.py is the semantics, written to be read: a Python loop over sequences, each
materialising its float32 ``[Hq, q_len, kv_len]`` score matrix, scaling, masking and soft-maxing it
in separate passes. Profiled on a 64 x 1024-token prefill that was ~70 % of the engine's time
(docs/engine.md, "CPU profile"). Here the same contract runs on ``scaled_dot_product_attention``,
whose CPU flash kernel tiles the keys with an online softmax (no score matrix, one pass):

* prefill chunks (several queries): one call per sequence over its K/V, read in place when its
  blocks are consecutive in the cache (a fresh pool hands them out so), gathered otherwise;
  causal via ``is_causal`` when the chunk is the whole sequence, else an additive mask aligned to
  the bottom right (a chunk after cached or earlier tokens), made once per shape and reused by
  every layer of the step;
* decodes (one query each): all in one call over their K/V gathered to ``[S, Hkv, L, D]``, with
  a mask for each row's length (and window);
* ``softcap`` (no fused equivalent; no model served here uses it): decodes batched with einsum,
  prefill chunks through the reference.

GQA is the kernel's (``enable_gqa``): K/V heads are not repeated. Same arguments, same results
as the reference to float32 rounding (tests/kernels/test_torch_attention.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvmesh.kernels.reference import ragged_paged_attention_ref


def _einsum_decode(
    q: torch.Tensor,  # [S, Hq, D], one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Decodes with a softcap: batched gather + einsum (the fused kernel has no softcap)."""
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


@functools.lru_cache(maxsize=8)
def _chunk_mask(
    q_len: int, kv_len: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive ``[q_len, kv_len]`` mask of a chunk whose queries are the last ``q_len`` positions.

    Cached: every layer of a step (and the next steps of equal shape) asks for the same one.
    NOTE: small on purpose: a 2048 x 4096 float32 mask is 32 MiB.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))


def _sequence_kv(cache: torch.Tensor, blocks: list[int], kv_len: int) -> torch.Tensor:
    """One sequence's ``[kv_len, Hkv, D]``: a view when its blocks are consecutive, else a gather."""
    first, n = blocks[0], len(blocks)
    if blocks[-1] - first == n - 1 and blocks == list(range(first, first + n)):
        kv = cache[first : first + n]
    else:
        kv = cache.index_select(0, torch.tensor(blocks, device=cache.device))
    return kv.flatten(0, 1)[:kv_len]


def _flash_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out, logsumexp)`` of the CPU flash kernel (``[B, H, L, D]`` inputs, equal head counts),
    or None where that kernel is not there (another device, another torch)."""
    global _flash_lse_ok
    if not _flash_lse_ok or q.device.type != "cpu":
        return None
    try:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, scale=scale
        )
    except (AttributeError, RuntimeError, TypeError):
        # NOTE: a private aten op (the one SDPA itself calls on CPU); without it the mask path
        # gives the same result, ~1.6x slower on long chunks.
        _flash_lse_ok = False
        return None
    return out, lse


_flash_lse_ok = True


def _prefix_then_causal(
    q: torch.Tensor,  # [q_len, Hq, D]
    k: torch.Tensor,  # [kv_len, Hkv, D], kv_len > q_len
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """A chunk after ``P = kv_len - q_len`` earlier tokens, without a mask: every query sees all of
    the prefix (one unmasked pass) and the chunk's own keys causally (one causal pass); the two
    softmaxes are merged by their log-sum-exps. Same result as the masked pass, without computing
    the masked-out quarter or reading a mask. None where the kernel that gives the log-sum-exp is
    not available."""
    q_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    prefix = k.shape[0] - q_len
    qh = q.transpose(0, 1)  # [Hq, q_len, D]
    # NOTE: unmasked, the queries of one KV head's group are independent rows: stacked along the
    # sequence they share the KV head's keys (GQA without repeating K/V).
    stacked = qh.reshape(num_kv_heads, group * q_len, head_dim)[None]
    first = _flash_with_lse(stacked, k[:prefix].transpose(0, 1)[None], v[:prefix].transpose(0, 1)[None],
                            scale, causal=False)
    if first is None:
        return None
    o1, lse1 = first[0].reshape(num_q_heads, q_len, head_dim), first[1].reshape(num_q_heads, q_len)
    k_new = k[prefix:].transpose(0, 1).repeat_interleave(group, 0)[None]
    v_new = v[prefix:].transpose(0, 1).repeat_interleave(group, 0)[None]
    second = _flash_with_lse(qh[None], k_new, v_new, scale, causal=True)
    if second is None:
        return None
    o2, lse2 = second[0][0], second[1][0]
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp_(), (lse2 - top).exp_()
    out = (o1 * w1[..., None]).add_(o2 * w2[..., None]).div_((w1 + w2)[..., None])
    return out.transpose(0, 1)


def _sdpa_prefill(
    q: torch.Tensor,  # [q_len, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: list[int],
    kv_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    q_len = q.shape[0]
    k = _sequence_kv(k_cache, blocks, kv_len)
    v = _sequence_kv(v_cache, blocks, kv_len)
    windowed = sliding_window is not None and sliding_window < kv_len
    causal = q_len == kv_len and not windowed
    if not causal and not windowed:
        out = _prefix_then_causal(q, k, v, scale)
        if out is not None:
            return out
    mask = None if causal else _chunk_mask(q_len, kv_len, sliding_window, q.dtype, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, Hq, q_len, D]
        k.transpose(0, 1)[None],  # [1, Hkv, kv_len, D]
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)  # [q_len, Hq, D]


def _sdpa_decode(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_lens: list[int],
    tables: torch.Tensor,  # [S, >= max blocks]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = max(kv_lens)
    n_blocks = (max_len + block_size - 1) // block_size
    flat = tables[:, :n_blocks].reshape(-1).to(device=k_cache.device, dtype=torch.long)
    # [S, Hkv, L, D] views of the gathered [S, L, Hkv, D]
    k = k_cache.index_select(0, flat).view(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)
    v = v_cache.index_select(0, flat).view(num_seqs, n_blocks * block_size, num_kv_heads, head_dim)
    pos = torch.arange(n_blocks * block_size, device=q.device)[None, :]
    last = torch.tensor(kv_lens, device=q.device)[:, None] - 1  # each query's own position
    keep = pos <= last
    if sliding_window is not None:
        keep &= pos > last - sliding_window
    mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
    # NOTE: a KV head's group of query heads stacked as its "sequence" of G queries: one small
    # matrix product per (sequence, KV head) instead of G vector products (~1.5x faster).
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    return out.reshape(num_seqs, num_q_heads, head_dim)


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
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[2]})")
    if softcap:
        return _softcap_attention(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, scale,
                                  sliding_window, softcap)
    # NOTE: the host reads the (small) metadata once; every branch below is then plain Python.
    cu = cu_q_lens.tolist()
    lens = kv_lens.tolist()
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    decode = [s for s in range(len(lens)) if cu[s + 1] - cu[s] == 1]
    if decode:
        rows = [cu[s] for s in decode]
        if len(decode) == len(lens):  # an all-decode batch: rows are 0..S-1 in order
            out = _sdpa_decode(q, k_cache, v_cache, lens, block_tables, scale, sliding_window)
        else:
            idx = torch.tensor(rows, device=q.device)
            out[idx] = _sdpa_decode(q.index_select(0, idx), k_cache, v_cache, [lens[s] for s in decode],
                                    block_tables[decode], scale, sliding_window)
    tables: list[list[int]] | None = None
    for s in range(len(lens)):
        q_start, q_end = cu[s], cu[s + 1]
        if q_end - q_start <= 1:
            continue  # a decode (done above) or no queries
        if tables is None:
            tables = block_tables.tolist()
        kv_len = lens[s]
        n_blocks = (kv_len + block_size - 1) // block_size
        out[q_start:q_end] = _sdpa_prefill(q[q_start:q_end], k_cache, v_cache, tables[s][:n_blocks], kv_len,
                                           scale, sliding_window)
    return out


def _softcap_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float,
) -> torch.Tensor:
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    decode = q_lens == 1
    n_decode = int(decode.sum())
    if n_decode < 2:
        return ragged_paged_attention_ref(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables, scale,
                                          sliding_window, softcap)
    out = torch.empty_like(q)
    starts = cu_q_lens[:-1].long()
    rows = starts[decode]
    out[rows] = _einsum_decode(q[rows], k_cache, v_cache, kv_lens[decode], block_tables[decode], scale,
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
