"""The engine's side of prefill/decode disaggregation: which blocks a prefill leg holds, which blocks a
decode leg takes in, and the transfer side's questions about them.

As vLLM v1 splits a KV connector into the scheduler's side and the worker's side
(vllm/distributed/kv_transfer/kv_connector/v1/base.py), a kvmesh worker splits P/D in two: this side runs
on the engine's step thread and alone touches the block pool and the holds (model_worker/scheduling/
kv_holds.py); the transfer side (model_worker/serving/kv_transfer.py, on the gRPC server's event loop)
moves bytes between workers. The transfer side asks through the engine's inbox
(``LLMEngine.call_on_step_thread``: a future it awaits) and hands legs over with their requests
(kv_legs.py); it never reads this side's state.

Every method here runs on the step thread. No torch, no grpc.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvmesh.model_worker.engine.kv_legs import DecodeLeg, HeldKV, KVImport, KVLeg, PrefillLeg
from kvmesh.model_worker.scheduling.block_pool import BlockPool
from kvmesh.model_worker.scheduling.kv_holds import Hold, KVHolds
from kvmesh.model_worker.scheduling.output import RequestOutput
from kvmesh.model_worker.scheduling.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvmesh.model_worker.execution.kv_blocks import KVBlocks


class KVConnector:
    """One engine's holds and imports, and the requests that will make them.

    Args:
        pool: the engine's block pool (one KV cache group: kv_holds.py).
        kv_blocks: the KV cache as blocks of bytes, where imported blocks are written; None for a runner
            without a KV cache (the simulated one: its imports carry no bytes).
        block_size: tokens per block.
    """

    def __init__(self, pool: BlockPool, kv_blocks: KVBlocks | None, block_size: int) -> None:
        self.holds = KVHolds(pool)
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self._prefill_legs: dict[str, tuple[Request, PrefillLeg]] = {}
        """Prefill legs not ended yet, with their requests (their prompts' hashes are held at the end)."""
        self._reads: dict[int, Hold] = {}
        """Holds being read by a transfer, by read id."""
        self._next_read = 0

    # -- requests (LLMEngine's inbox and step) ------------------------------------------------------------
    def add(self, request: Request, leg: KVLeg) -> None:
        """A leg joins, right before its request joins the scheduler: a decode leg's blocks go into the pool."""
        if isinstance(leg, DecodeLeg):
            self._take_in(request.request_id, leg.kv_import)
        else:
            self._prefill_legs[request.request_id] = (request, leg)

    def aborted(self, request_id: str) -> None:
        """A request was aborted before it ended: a prefill leg holds nothing."""
        entry = self._prefill_legs.pop(request_id, None)
        if entry is not None:
            entry[1].resolve(None)

    def scheduled(self, requests: Mapping[str, Request], now: float) -> None:
        """After a schedule: imports of requests no longer waiting drop their references (the request's hit
        holds the blocks now), expired holds are released."""
        holds = self.holds
        if holds.imports:
            for rid in list(holds.imports):
                r = requests.get(rid)
                if r is None or r.status != RequestStatus.WAITING:
                    holds.admitted(rid)
        if holds.holds:
            self.expire(now)

    @property
    def has_prefill_legs(self) -> bool:
        return bool(self._prefill_legs)

    def finished(self, outputs: Sequence[RequestOutput], now: float) -> None:
        """Prefill legs that just ended hold their prompt's full blocks (still cached: freed this step,
        nothing allocated since) for a decode worker, and their futures get the hold."""
        bs = self.block_size
        for o in outputs:
            if not o.finished:
                continue
            entry = self._prefill_legs.pop(o.request_id, None)
            if entry is None:
                continue
            request, leg = entry
            if o.finish_reason == "abort":
                leg.resolve(None)
                continue
            # NOTE: the decode worker recomputes the prompt's last token (every engine does), so the
            # blocks it can use are those before it.
            hold = self.holds.hold(o.request_id, request.block_hashes[:(request.num_prompt_tokens - 1) // bs],
                                   now + leg.hold_s)
            leg.resolve(HeldKV(hold.block_hashes, hold.block_ids))

    def _take_in(self, request_id: str, kv: KVImport) -> None:
        """A decode leg's arrived blocks into the pool (kv_holds.py) and their bytes into the KV cache."""
        n = len(kv.blocks) if kv.blocks is not None else kv.num_blocks
        first, ids = self.holds.take_in(request_id, kv.block_hashes[:kv.start + n], kv.start)
        if ids and kv.blocks is not None:
            assert self.kv_blocks is not None, "KV blocks arrived at a runner without a KV cache"
            self.kv_blocks.write(ids, kv.blocks[first - kv.start:first - kv.start + len(ids)])
        kv.taken = len(ids)

    @property
    def num_held(self) -> int:
        return self.holds.num_held

    # -- the transfer side's questions (through the engine's inbox) ----------------------------------------
    def leading_cached(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the pool holds now (a decode leg pulls the rest)."""
        return self.holds.leading_cached(block_hashes)

    def release(self, request_id: str) -> bool:
        """Ends a prefill leg's hold (its blocks stay cached); False when there is none."""
        return self.holds.release(request_id)

    def expire(self, now: float) -> list[str]:
        """Releases the holds whose time is up; their request ids."""
        return self.holds.expire(now)

    def begin_read(self, request_id: str) -> tuple[int, HeldKV] | None:
        """Starts reading a hold's bytes: (a read id for :meth:`end_read`, the hold); None when there is
        none. Until the read ends the hold's blocks stay referenced, even if it is released meanwhile."""
        hold = self.holds.read(request_id)
        if hold is None:
            return None
        self._next_read += 1
        self._reads[self._next_read] = hold
        return self._next_read, HeldKV(hold.block_hashes, hold.block_ids)

    def end_read(self, read_id: int, request_id: str, release: bool) -> None:
        """Ends a read; ``release``: the reader has every block, so the hold it read ends too (not a newer
        hold of the same request id)."""
        hold = self._reads.pop(read_id)
        if release and self.holds.holds.get(request_id) is hold:
            self.holds.release(request_id)
        self.holds.done_reading(hold)
