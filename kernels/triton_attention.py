"""Triton ragged paged attention (flash-attention 2 style) over a paged KV cache.

Semantics are those of ``kernels.reference.ragged_paged_attention_ref``; docs/kernels.md describes
the design. In short:

* One program owns one query tile of one sequence and one KV head. The tile packs ``BLOCK_Q``
  tokens times all ``GROUP`` query heads that read that KV head (GQA/MQA packing), so every K/V
  tile loaded from the cache is reused by the whole group. The ``BLOCK_Q * GROUP`` rows are padded
  once, to ``BLOCK_M`` (a power of two), not per token: a group of 7 fills 63 of 64 rows.
* The grid's first axis enumerates query tiles without a host sync: sequence s owns tile ids
  ``[cu_q_lens[s] // BLOCK_Q + s, cu_q_lens[s + 1] // BLOCK_Q + s + 1)``, enough for
  ``cdiv(q_len, BLOCK_Q)`` tiles; a program finds its sequence by binary search.
* Keys are visited in three ranges: masked tiles at the window's start, unmasked tiles in the
  middle, masked tiles at the causal edge. Tiles past the causal edge or before the window are
  never loaded.
* Split-KV: for decode-heavy batches whose grid is too small to fill the GPU, the key range is
  cut into ``num_splits`` parts that write partial (acc, max, sum) to a workspace, and a second
  kernel combines them (all splits of a (token, head) in one vector load).
* Block-table loads: one per page of a key tile (one per tile when a page holds the tile), not
  one per key.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvmesh.kernels.attention_configs import (
    AttentionConfig,
    SplitKVPolicy,
    attention_config,
    check_head_shape,
    default_attention_config,
    head_dim_pad,
    split_kv_policy,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(cu_q_lens_ptr, tile_id, num_seqs, search_steps, BLOCK_Q: tl.constexpr):
    """Largest s with ``cu_q_lens[s] // BLOCK_Q + s <= tile_id`` (binary search)."""
    lo = tile_id * 0
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_q_lens_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= tile_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _attend_kv_range(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    kv_start,
    kv_end,
    kv_len,
    sliding_window,
    softcap,
    scale_log2,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) with keys ``[kv_start, kv_end)``.

    Scores live in the log2 domain (``exp2``). With ``MASKED`` false the caller guarantees every
    key in the range is visible to every row (causal, window and ``kv_len``), so no mask is built.
    """
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_len
        in_page = (pos % PAGE_SIZE).to(tl.int64)
        # NOTE: physical block ids go to int64 before the multiply; num_blocks * stride_kb
        # overflows int32 for caches of a few GiB. Tiles start at multiples of BLOCK_N (every
        # range does), so a tile covers whole pages, or lies inside one.
        if PAGE_SIZE % BLOCK_N == 0:
            # one page holds the tile: one table load (n0 < kv_len in every range)
            page = tl.load(block_table_row_ptr + n0 // PAGE_SIZE).to(tl.int64)
            k_offs = page * stride_kb + in_page * stride_ks + kv_head * stride_kh
            v_offs = page * stride_vb + in_page * stride_vs + kv_head * stride_vh
        elif BLOCK_N % PAGE_SIZE == 0 and (PAGE_SIZE & (PAGE_SIZE - 1)) == 0:
            # one table load per page, its base offset broadcast over the page's keys
            NUM_PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
            page_idx = n0 // PAGE_SIZE + tl.arange(0, NUM_PAGES)
            if MASKED:
                pages = tl.load(block_table_row_ptr + page_idx, mask=page_idx * PAGE_SIZE < kv_len, other=0)
            else:
                pages = tl.load(block_table_row_ptr + page_idx)
            pages = pages.to(tl.int64)
            k_base = tl.reshape(tl.broadcast_to((pages * stride_kb)[:, None], (NUM_PAGES, PAGE_SIZE)), (BLOCK_N,))
            v_base = tl.reshape(tl.broadcast_to((pages * stride_vb)[:, None], (NUM_PAGES, PAGE_SIZE)), (BLOCK_N,))
            k_offs = k_base + in_page * stride_ks + kv_head * stride_kh
            v_offs = v_base + in_page * stride_vs + kv_head * stride_vh
        else:  # a page size that is not a power of two: a table load per key
            if MASKED:
                page = tl.load(block_table_row_ptr + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
            else:
                page = tl.load(block_table_row_ptr + pos // PAGE_SIZE).to(tl.int64)
            k_offs = page * stride_kb + in_page * stride_ks + kv_head * stride_kh
            v_offs = page * stride_vb + in_page * stride_vs + kv_head * stride_vh
        if MASKED or HEAD_DIM != HEAD_DIM_PAD:
            k = tl.load(
                k_cache_ptr + k_offs[None, :] + dims[:, None] * stride_kd,
                mask=pos_ok[None, :] & dim_ok[:, None],
                other=0.0,
            )
            v = tl.load(
                v_cache_ptr + v_offs[:, None] + dims[None, :] * stride_vd,
                mask=pos_ok[:, None] & dim_ok[None, :],
                other=0.0,
            )
        else:
            k = tl.load(k_cache_ptr + k_offs[None, :] + dims[:, None] * stride_kd)
            v = tl.load(v_cache_ptr + v_offs[:, None] + dims[None, :] * stride_vd)
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], fp32
        if USE_SOFTCAP:
            # cap * tanh(x / cap) with tanh(y) = 1 - 2 / (exp(2y) + 1): saturates to +-1, no NaN.
            y = s * (scale_log2 / 1.4426950408889634) / softcap
            s = softcap * (1.0 - 2.0 / (tl.exp2(y * 2.8853900817779268) + 1.0)) * 1.4426950408889634
        else:
            s = s * scale_log2
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            if USE_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NOTE: a row can see no key of a masked tile (window start); keep exp2 away from
        # (-inf) - (-inf) so such rows contribute exactly zero instead of NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# NOTE: the integer arguments that vary from batch to batch are not specialised (Triton would compile
# a variant per value class: == 1, divisible by 16, other). The variants left are the tile and
# split-KV constexprs, which the worker's warm-up runs (model_worker/execution/warmup.py).
_PER_BATCH = ["num_seqs", "search_steps", "num_splits", "num_tokens", "stride_bt"]


@triton.jit(do_not_specialize=_PER_BATCH)
def _ragged_paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    cu_q_lens_ptr,
    kv_lens_ptr,
    block_tables_ptr,
    num_seqs,
    search_steps,
    num_splits,
    num_tokens,
    num_q_heads,
    scale_log2,
    softcap,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(cu_q_lens_ptr, tile_id, num_seqs, search_steps, BLOCK_Q)
    q_start = tl.load(cu_q_lens_ptr + seq)
    q_len = tl.load(cu_q_lens_ptr + seq + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return  # spare tile id (or a sequence with no queries)
    kv_len = tl.load(kv_lens_ptr + seq)
    ctx_len = kv_len - q_len

    # Row r of the tile is token r // GROUP, query head kv_head * GROUP + r % GROUP; rows from
    # BLOCK_Q * GROUP to BLOCK_M are padding (masked).
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP
    q_head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok
    token = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Key ranges: [kv_lo, full_lo) masked (window start), [full_lo, full_hi) unmasked,
    # [full_hi, kv_hi) masked (causal edge). Positions outside [kv_lo, kv_hi) are never loaded.
    first_pos = ctx_len + q_tile * BLOCK_Q
    kv_hi = tl.minimum(first_pos + BLOCK_Q, kv_len)  # last visible key + 1 (last row's position + 1)
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
        # keys >= (last row's position) - window + 1 are inside every row's window
        full_lo = tl.maximum(tl.cdiv(kv_hi - sliding_window, BLOCK_N) * BLOCK_N, 0)
    else:
        kv_lo = kv_len * 0
        full_lo = kv_lo
    full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys < this are <= every row's position
    if SPLIT_KV:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, BLOCK_N), num_splits)
        kv_lo = kv_lo + split * tiles_per_split * BLOCK_N
        kv_hi = tl.minimum(kv_lo + tiles_per_split * BLOCK_N, kv_hi)
        kv_lo = tl.minimum(kv_lo, kv_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, kv_lo), kv_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), kv_hi)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, kv_lo, full_lo, kv_len, sliding_window, softcap, scale_log2,
        k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        BLOCK_N, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, full_lo, full_hi, kv_len, sliding_window, softcap, scale_log2,
        k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        BLOCK_N, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD, False, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, full_hi, kv_hi, kv_len, sliding_window, softcap, scale_log2,
        k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd,
        BLOCK_N, PAGE_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
    )  # fmt: skip

    store_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT_KV:
        # Workspace: acc [splits, T, Hq, D_PAD] and (max, sum) [splits, T, Hq, 2], all fp32.
        part_row = (split * num_tokens + token) * num_q_heads + q_head
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=store_mask)
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_ok)
    else:
        # NOTE: every valid row sees at least its own key, so l_i > 0 there; padded rows are
        # guarded only to keep the division quiet.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + dims[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "num_tokens"])
def _combine_kv_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    cu_q_lens_ptr,
    num_seqs,
    num_splits,
    num_tokens,
    num_q_heads,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Merges the split partials of one (token, query head) into the final output: every split's
    (max, sum) and accumulator in one masked vector load each, one pass."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(cu_q_lens_ptr + num_seqs):
        return  # padding token past the last sequence: never written by the attention kernel
    dims = tl.arange(0, HEAD_DIM_PAD)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    row = (splits * num_tokens + token).to(tl.int64) * num_q_heads + head
    m = tl.load(part_ml_ptr + row * 2, mask=split_ok, other=float("-inf"))
    l_j = tl.load(part_ml_ptr + row * 2 + 1, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + dims[None, :], mask=split_ok[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    # NOTE: a split that saw no key has m = -inf and weight 0; every valid row sees its own key in
    # some split, so m_all is finite.
    w = tl.where(split_ok, tl.exp2(m - m_all), 0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(w * l_j, axis=0)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_kv_splits(decode_heavy: bool, programs: int, max_kv: int, block_n: int, sms: int,
                         policy: SplitKVPolicy) -> int:
    """Split-KV count of a batch, from shapes only (no host sync): 1 unless a decode-heavy grid has
    fewer than ``policy.programs_per_sm`` programs per SM; then enough splits to fill them, each
    keeping ``min_tiles_per_split`` key tiles of the table's width, a power of two (a batch shape
    gives one count), at most ``max_splits``."""
    target = policy.programs_per_sm * sms
    if not decode_heavy or programs >= target:
        return 1
    want = min(policy.max_splits, triton.cdiv(target, programs), max(1, max_kv // (policy.min_tiles_per_split * block_n)))
    return 1 << (want.bit_length() - 1)


def ragged_paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    num_kv_splits: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    config: AttentionConfig | None = None,
    split_policy: SplitKVPolicy | None = None,
) -> torch.Tensor:
    """Triton ragged paged attention; same contract as ``ragged_paged_attention_ref``.

    Args:
        num_kv_splits: force the split-KV path with this many splits (1 disables it); by default
            it is chosen from the batch shape without a host sync (see docs/kernels.md).
        block_q: query tokens per program (tests / tuning); the tile has ``block_q * group`` rows,
            padded to a power of two.
        block_n: keys per inner-loop tile (tests / tuning).
        config: the launch (tests / tuning); by default the committed table's entry for this head
            shape, phase and dtype (attention_configs.py; under the interpreter 16 x 16 tiles, so
            small tests cross tile boundaries).
        split_policy: when to split (tuning); by default the committed table's.

    Returns:
        ``[T, Hq, D]`` in q's dtype. Rows of padding tokens past ``cu_q_lens[-1]`` are undefined.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_seqs = kv_lens.shape[0]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if cache_head_dim != head_dim:
        raise ValueError(f"q head size {head_dim} != cache head size {cache_head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if cu_q_lens.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError("cu_q_lens must be [S+1] and block_tables [S, max_blocks] for S = len(kv_lens)")
    for name, t in (("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (a query always sees itself), got {sliding_window}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    cu_q_lens, kv_lens = cu_q_lens.contiguous(), kv_lens.contiguous()

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    interpret = not q.is_cuda
    group = num_q_heads // num_kv_heads
    d_pad = head_dim_pad(head_dim)
    decode_heavy = num_tokens <= 2 * num_seqs  # mean query length <= 2, known without a sync
    if config is None:
        config = AttentionConfig(16, 16) if interpret else attention_config(decode_heavy, q.dtype, head_dim, group)
    block_q = block_q or max(1, config.block_m // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))  # tl.dot needs 16 rows
    block_n = block_n or config.block_n
    num_q_tiles = num_tokens // block_q + num_seqs  # upper bound, see the module docstring

    policy = split_policy or split_kv_policy()
    if num_kv_splits is None:
        num_kv_splits = 1
        if not interpret:
            sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
            num_kv_splits = choose_num_kv_splits(decode_heavy, num_q_tiles * num_kv_heads,
                                                 block_tables.shape[1] * page_size, block_n, sms, policy)
    split_kv = num_kv_splits > 1
    if split_kv:
        part_acc = torch.empty((num_kv_splits, num_tokens, num_q_heads, d_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_kv_splits, num_tokens, num_q_heads, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused

    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 only matters for fp32 inputs
    launch = {} if interpret else {"num_warps": config.num_warps, "num_stages": config.num_stages}
    _ragged_paged_attention_kernel[(num_q_tiles, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, cu_q_lens, kv_lens, block_tables,
        num_seqs, num_seqs.bit_length(), num_kv_splits, num_tokens, num_q_heads,
        scale * _LOG2E, float(softcap or 1.0), int(sliding_window or 0),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), block_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=bool(softcap),
        SPLIT_KV=split_kv, DOT_PRECISION=precision,
        **launch,
    )  # fmt: skip
    if split_kv:
        # NOTE: one variant for every split count up to the policy's bound (the warm-up compiles it).
        splits_pad = triton.next_power_of_2(max(num_kv_splits, policy.max_splits))
        _combine_kv_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_ml, cu_q_lens, num_seqs, num_kv_splits, num_tokens, num_q_heads,
            *out.stride(), HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, SPLITS_PAD=splits_pad,
            **({} if interpret else {"num_warps": 2 if d_pad * splits_pad >= 2048 else 1}),
        )  # fmt: skip
    return out


__all__ = [
    "AttentionConfig",
    "SplitKVPolicy",
    "attention_config",
    "check_head_shape",
    "choose_num_kv_splits",
    "default_attention_config",
    "ragged_paged_attention_triton",
]
