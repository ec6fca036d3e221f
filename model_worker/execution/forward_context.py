"""What one forward pass reads besides its token ids and positions: the attention metadata (and, with
LoRA adapters, each token's adapter slot).

The runner sets it around each call of the model (``with forward_context(ctx): model(ids, pos)``);
the paged-attention op reads it. As in vLLM (``vllm/forward_context.py``), the metadata and the KV
caches never enter the model's signature, so ``torch.compile`` sees only ``[T]`` ids and positions
(one dynamic size) and the attention op stays opaque: its inputs are q, k, v and a layer index.
A CUDA graph captured inside a context replays with the buffers that context named.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from kvmesh.kernels.lora_reference import LoRAGroups, lora_groups


@dataclass(slots=True)
class AttentionMetadata:
    """Where the packed tokens of one step live in the paged KV cache.

    ``T`` new tokens of ``S`` sequences, packed back to back (see kernels/reference.py).
    """

    slot_mapping: torch.Tensor
    """``[T]`` int64: flat cache slot (block * block_size + offset) of each new token; -1 = write nothing."""
    cu_q_lens: torch.Tensor
    """``[S+1]`` int32: sequence s owns tokens ``cu_q_lens[s]:cu_q_lens[s+1]``."""
    kv_lens: torch.Tensor
    """``[S]`` int32: KV length of each sequence including its new tokens."""
    block_tables: torch.Tensor
    """``[S, max_blocks]`` int32, padded with the null block 0."""


@dataclass(slots=True)
class LoRAMetadata:
    """Which LoRA adapter slot each packed token runs under (models/lora.py); absent without --enable-lora."""

    token_slots: torch.Tensor
    """``[T]`` int: the slot of each new token's adapter, -1 = the base model (an input buffer like the
    positions: a CUDA graph replays with the buffer it was captured with)."""
    groups: LoRAGroups | None = None
    """Per slot used, its tokens (kernels.lora_groups), computed once per step for the torch path; None =
    derived by the kernel where it needs them."""

    def select(self, rows: torch.Tensor) -> LoRAMetadata:
        """The rows ``rows`` of a one-token-per-row batch (a window's requests still running)."""
        slots = self.token_slots[rows]
        return LoRAMetadata(slots, lora_groups(slots) if self.groups is not None else None)


class AttentionLayer(Protocol):
    """What the attention op reads of a layer (models/attention.py's PagedAttention, which reads this
    module's context: so the context names the shape, not the class)."""

    kv_group: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


@dataclass(slots=True)
class ForwardContext:
    layers: Sequence[AttentionLayer]
    """The model's attention layers by layer index (each knows its KV cache group)."""
    metas: Sequence[AttentionMetadata]
    """One metadata per KV cache group."""
    lora: LoRAMetadata | None = None
    """The tokens' LoRA adapter slots (--enable-lora), else None."""


_local = threading.local()
"""Per thread: several engines may step in one process (tests, the simulator's live peers)."""


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Makes ``ctx`` the current context of this thread while the block runs (nests)."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = previous


def current_forward_context() -> ForwardContext:
    """The context the runner set; a model called outside one raises RuntimeError."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("the model ran outside forward_context(...): the runner sets the attention metadata")
    return ctx
