"""What one forward pass reads besides its token ids and positions: the attention metadata.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.model_worker.execution.models.attention import AttentionMetadata, PagedAttention


@dataclass(slots=True)
class ForwardContext:
    layers: Sequence[PagedAttention]
    """The model's attention layers by layer index (each knows its KV cache group)."""
    metas: Sequence[AttentionMetadata]
    """One metadata per KV cache group."""


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
