"""Batched LoRA: the Triton kernel against the torch reference, and the reference against a plain
per-token loop (so a wrong slot, scale or rank in both would still fail)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.lora_reference import add_lora_ref, lora_groups
from tests.support.kernels import import_kernel_module

HAS_CUDA = torch.cuda.is_available()
NEEDS_GPU = "needs an NVIDIA GPU with CUDA"

triton_lora = import_kernel_module("kvmesh.kernels.triton_lora", "_lora_shrink_kernel")

pytestmark = pytest.mark.usefixtures("interpreter_env")

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only where CUDA is absent"),
        id="interpreter",
    ),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_GPU)]),
]


def make_case(num_slots: int, rank: int, d_in: int, d_out: int, slots: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), d_in, generator=g)
    y = torch.randn(len(slots), d_out, generator=g)
    a = torch.randn(num_slots, rank, d_in, generator=g)
    b = torch.randn(num_slots, d_out, rank, generator=g)
    scales = torch.rand(num_slots, generator=g) + 0.5
    return y, x, a, b, scales, torch.tensor(slots, dtype=torch.int32)


def per_token(y, x, a, b, scales, slots):
    """The definition, one token at a time."""
    out = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += scales[s] * (b[s] @ (a[s] @ x[t]))
    return out


def test_reference_is_the_per_token_definition():
    y, x, a, b, scales, slots = make_case(4, 8, 24, 40, [2, -1, 0, 2, 3, -1, 1, 0])
    got = y.clone()
    add_lora_ref(got, x, a, b, scales, slots)
    torch.testing.assert_close(got, per_token(y, x, a, b, scales, slots))
    # base tokens are untouched, bit for bit
    assert torch.equal(got[1], y[1]) and torch.equal(got[5], y[5])


def test_reference_one_slot_for_all_and_none():
    y, x, a, b, scales, slots = make_case(3, 4, 16, 8, [1, 1, 1])
    assert lora_groups(slots) == [(1, slice(None))]
    got = y.clone()
    add_lora_ref(got, x, a, b, scales, slots)
    torch.testing.assert_close(got, per_token(y, x, a, b, scales, slots))
    none = torch.full((3,), -1, dtype=torch.int32)
    same = y.clone()
    add_lora_ref(same, x, a, b, scales, none)
    assert torch.equal(same, y)


def test_wrong_slot_or_scale_is_caught():
    """The comparison the engine tests rely on is sharp: a swapped slot or a missing scale differs."""
    y, x, a, b, scales, slots = make_case(2, 4, 16, 8, [0, 1])
    want = per_token(y, x, a, b, scales, slots)
    swapped = y.clone()
    add_lora_ref(swapped, x, a, b, scales, torch.tensor([1, 0], dtype=torch.int32))
    assert not torch.allclose(swapped, want)
    unscaled = y.clone()
    add_lora_ref(unscaled, x, a, b, torch.ones(2), slots)
    assert not torch.allclose(unscaled, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("num_slots", "rank", "d_in", "d_out", "slots"),
    [
        (4, 16, 64, 96, [0, 1, 2, 3, -1, 0, 0, 3, 2, -1]),  # mixed, padding tokens, several tiles
        (2, 5, 70, 33, [1, 1, 1, 1, 1]),  # rank and widths not powers of two
        (3, 48, 32, 130, [-1, -1, 2]),  # a fused module's rank (3 x 16)
    ],
)
def test_triton_matches_reference(device, num_slots, rank, d_in, d_out, slots):
    y, x, a, b, scales, token_slots = make_case(num_slots, rank, d_in, d_out, slots, seed=rank)
    want = y.clone()
    add_lora_ref(want, x, a, b, scales, token_slots)
    got = y.to(device)
    triton_lora.add_lora_triton(got, x.to(device), a.to(device), b.to(device), scales.to(device),
                                token_slots.to(device))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    base = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(got.cpu()[base], y[base])
