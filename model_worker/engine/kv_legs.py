"""What a request brings and takes when it is one leg of a prefill/decode split (docs/architecture.md,
"Prefill/decode disaggregation"): the types the transfer side and the engine's side hand each other.

A leg's options travel with the request into the engine's inbox (LLMEngine.add_request, EngineLoop.submit_async);
what the engine answers comes back through a future, resolved on the engine's step thread. None of these types
holds pool state: the transfer side may keep and read them on any thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class KVImport:
    """KV blocks that arrived from a prefill worker for one request (prefill/decode disaggregation):
    taken into the pool on the step thread right before the request joins the scheduler."""

    block_hashes: list[bytes]
    """The prompt's full blocks as the prefill worker held them, from the root."""
    start: int
    """``blocks[0]`` is ``block_hashes[start]``'s."""
    blocks: Any
    """A tensor ``[n, *KVBlocks.block_shape]`` in wire layout; None on a simulated worker (no bytes)."""
    num_blocks: int = -1
    """Blocks that arrived when ``blocks`` is None (the simulator's transfers)."""
    taken: int = -1
    """Set on the step thread: blocks the pool took in (-1 until then)."""


@dataclass(frozen=True, slots=True)
class HeldKV:
    """A copy of one hold's identity (model_worker/scheduling/kv_holds.py), safe on any thread: what the
    prefill leg answers (the blocks' hashes) and where their bytes are (the block ids a transfer reads)."""

    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(slots=True)
class PrefillLeg:
    """A prefill leg: when the request ends, its prompt's full blocks are held for a decode worker.

    Args:
        hold_s: the hold's time to live, in seconds (a release ends it sooner).
        held: resolved on the step thread when the request ends: the hold, or None when nothing was held
            (the request was aborted). None: nobody waits for it (the simulator reads the holds itself).
    """

    hold_s: float
    held: Future[HeldKV | None] | None = None

    def resolve(self, held: HeldKV | None) -> None:
        if self.held is not None and not self.held.done():
            self.held.set_result(held)


@dataclass(slots=True)
class DecodeLeg:
    """A decode leg: the blocks pulled from the prefill worker go into the pool first (right before the
    request joins the scheduler, so no step can admit it in between)."""

    kv_import: KVImport


KVLeg = PrefillLeg | DecodeLeg
"""A request's part in a prefill/decode split; a whole request has none."""
