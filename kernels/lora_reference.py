"""Batched LoRA, the torch reference: ``y += scale[s] * (x @ A[s]^T) @ B[s]^T`` per token, s its slot.

Punica's idea (SGMV / BGMV): the adapters of a batch sit stacked in fixed slots, ``A`` ``[L, R, in]``
and ``B`` ``[L, out, R]`` (a slot's rank below ``R`` is zero-padded), and each token names its slot,
``token_slots`` ``[T]`` (-1 = the base model: nothing added). The work is a *shrink* to rank ``R``
(``x @ A^T``) and an *expand* back (``@ B^T``, scaled), each over the tokens of one slot at a time.

This is the CPU path and the oracle of the Triton kernel (kernels/triton_lora.py): per slot, its
tokens are gathered (or, when one slot holds every token, taken as they are), shrunk, expanded and
added back; ``lora_groups`` finds the slots' tokens once per step, shared by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LoRAGroups = Sequence[tuple[int, torch.Tensor | slice]]
"""Per slot used in a batch: the slot and its tokens (an index tensor, or ``slice(None)`` for all)."""


def lora_groups(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor | slice]]:
    """The slots ``token_slots`` uses (-1 left out) and each one's tokens, ascending by slot."""
    slots = token_slots.tolist()
    used = sorted({s for s in slots if s >= 0})
    if len(used) == 1 and len(slots) == slots.count(used[0]):
        return [(used[0], slice(None))]
    return [(s, (token_slots == s).nonzero().flatten()) for s in used]


def add_lora_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    token_slots: torch.Tensor,
    groups: LoRAGroups | None = None,
) -> None:
    """Adds each token's LoRA delta to ``y`` in place.

    Args:
        y: ``[T, out]`` the base layer's output.
        x: ``[T, in]`` the layer's input.
        lora_a: ``[L, R, in]`` shrink weights per slot.
        lora_b: ``[L, out, R]`` expand weights per slot.
        scales: ``[L]`` float32, each slot's ``lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA).
        token_slots: ``[T]`` integer slot of each token, -1 = none.
        groups: ``lora_groups(token_slots)`` when the caller computed it already (once per step).
    """
    if groups is None:
        groups = lora_groups(token_slots)
    for slot, rows in groups:
        xs = x[rows]
        # NOTE: the scale multiplies the expanded delta, as peft does (B(A(x)) * scaling).
        delta = (xs @ lora_a[slot].t()) @ lora_b[slot].t()
        delta.mul_(float(scales[slot]))
        if isinstance(rows, slice):
            y.add_(delta)
        else:
            y.index_add_(0, rows, delta)


__all__ = ["LoRAGroups", "add_lora_ref", "lora_groups"]
