"""The CPU path (fused attention; decodes batched) equals the reference on every shape class it handles."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.reference import ragged_paged_attention_ref
from kvmesh.kernels.torch_attention import ragged_paged_attention_torch


def make_batch(lens, *, hq=8, hkv=2, d=32, bs=8, seed=0, consecutive=False):
    """lens: (q_len, kv_len) per sequence; shuffled physical blocks, or each sequence's blocks
    consecutive in the cache (read in place instead of gathered)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [(kv + bs - 1) // bs for _, kv in lens]
    total = sum(blocks_per) + 3
    k_cache = torch.randn(total, bs, hkv, d, generator=g)
    v_cache = torch.randn(total, bs, hkv, d, generator=g)
    perm = torch.arange(total) if consecutive else torch.randperm(total, generator=g)
    width = max(blocks_per) + 2
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per):
        tables[s, :n] = perm[used:used + n].int()
        used += n
    q_lens = torch.tensor([q for q, _ in lens], dtype=torch.int32)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q_lens, 0)
    q = torch.randn(int(cu[-1]), hq, d, generator=g)
    kv_lens = torch.tensor([kv for _, kv in lens], dtype=torch.int32)
    return q, k_cache, v_cache, cu, kv_lens, tables


@pytest.mark.parametrize("lens", [
    [(1, 77), (1, 18), (1, 29), (1, 1)],            # decode only
    [(1, 77), (5, 18), (29, 29), (1, 40), (0, 9)],  # mixed, with an empty-query sequence
    [(1, 5), (3, 3)],                                # one decode and one whole-prompt prefill
    [(64, 200), (17, 17), (1, 130), (2, 9)],         # long chunk after a prefix, two-query chunk
])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (7, None), (None, 5.0), (16, 3.0)])
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("consecutive", [False, True])
def test_matches_reference(lens, window, softcap, hq, hkv, consecutive):
    q, kc, vc, cu, kv, bt = make_batch(lens, hq=hq, hkv=hkv, consecutive=consecutive)
    want = ragged_paged_attention_ref(q, kc, vc, cu, kv, bt, 0.125, window, softcap)
    got = ragged_paged_attention_torch(q, kc, vc, cu, kv, bt, 0.125, window, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
