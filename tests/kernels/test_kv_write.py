"""Triton reshape-and-cache (write_kv_cache) vs the torch reference: exact equality."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.reference import write_kv_cache_ref
from tests.support.kernels import import_kernel_module

HAS_CUDA = torch.cuda.is_available()
NEEDS_GPU = "needs an NVIDIA GPU with CUDA"


triton_kv_write = import_kernel_module("kvmesh.kernels.triton_kv_write", "_write_kv_cache_kernel")


pytestmark = pytest.mark.usefixtures("interpreter_env")


DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only where CUDA is absent"),
        id="interpreter",
    ),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_GPU)]),
]


def run_both(key, value, k_cache, v_cache, slot_mapping):
    """Writes with the kernel and the reference into copies of the caches; returns both results."""
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(key, value, k_ref, v_ref, slot_mapping)
    triton_kv_write.write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    return (k_cache, v_cache), (k_ref, v_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(2, 32, 16), (3, 80, 8), (1, 128, 32)])
def test_matches_reference_with_padding_slots(device, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks = 6
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:10].to(torch.int32)
    slots[[2, 7]] = -1  # padding tokens
    key = torch.randn(10, num_kv_heads, head_dim, generator=gen).to(device)
    value = torch.randn(10, num_kv_heads, head_dim, generator=gen).to(device)
    (k, v), (k_ref, v_ref) = run_both(key, value, k_cache, v_cache, slots.to(device))
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    # exact expectations: slot -> (block, offset), padding tokens written nowhere
    block, offset = divmod(int(slots[0]), block_size)
    assert torch.equal(k[block, offset], key[0]) and torch.equal(v[block, offset], value[0])
    assert int((k.abs().sum(dim=(2, 3)) != 0).sum()) == 8


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_cast_to_cache_dtype(device):
    """K/V as views of a fused QKV output (non-contiguous), fp32 written into an fp16 cache."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_q_heads, num_kv_heads, head_dim = 7, 4, 2, 32
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(device)
    key = qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    value = qkv[:, num_q_heads + num_kv_heads :]
    assert not key.is_contiguous()
    k_cache = torch.zeros(4, 8, num_kv_heads, head_dim, dtype=torch.float16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 4, 5, 16, 17, -1, 31], dtype=torch.int32, device=device)
    (k, v), (k_ref, v_ref) = run_both(key, value, k_cache, v_cache, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(v[3, 7], value[6].half())


@pytest.mark.parametrize("device", DEVICES)
def test_no_tokens_and_all_padding(device):
    k_cache = torch.zeros(2, 8, 2, 32, device=device)
    v_cache = torch.zeros_like(k_cache)
    empty = torch.empty(0, 2, 32, device=device)
    triton_kv_write.write_kv_cache_triton(
        empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int32, device=device)
    )
    ones = torch.ones(3, 2, 32, device=device)
    triton_kv_write.write_kv_cache_triton(
        ones, ones, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int32, device=device)
    )
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_mismatched_shapes(device):
    k_cache = torch.zeros(2, 8, 2, 32, device=device)
    key = torch.zeros(3, 2, 16, device=device)
    with pytest.raises(ValueError, match="do not match"):
        triton_kv_write.write_kv_cache_triton(
            key, key, k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.int32, device=device)
        )


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_GPU)
def test_cuda_int32_offset_overflow():
    """Slots in the last blocks of a > 2**31-element cache (element offsets beyond int32)."""
    num_blocks, block_size, num_kv_heads, head_dim = 140_000, 16, 8, 128
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor(
        [num_blocks * block_size - 1, (num_blocks - 1000) * block_size + 3, -1],
        dtype=torch.int64,
        device="cuda",
    )
    key = torch.randn(3, num_kv_heads, head_dim, dtype=torch.float16, device="cuda")
    value = torch.randn_like(key)
    triton_kv_write.write_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[-1, -1], key[0]) and torch.equal(v_cache[num_blocks - 1000, 3], value[1])
    assert int(k_cache.view(-1, num_kv_heads * head_dim).any(dim=1).sum()) == 2
