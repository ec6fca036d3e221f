"""Prefill/decode disaggregation at a worker: the prefill leg's hold and its answer, the decode leg's
pull, and the ``PullKV`` / ``ReleaseKV`` RPCs (docs/architecture.md, "Prefill/decode disaggregation").

- **Prefill leg** (``kv_transfer.do_remote_decode``, max_tokens 1): the engine holds the prompt's full
  blocks when the leg ends (model_worker/scheduling/kv_holds.py); the last message carries the
  :class:`KVSource` (where, which blocks, NIXL's description when it loaded); the hold ends when the
  decode worker has the blocks, or ``--kv-hold-ttl`` later.
- **Decode leg** (``kv_transfer.source``): checked before any KV moves (this worker's role, the
  layout, that the blocks are this prompt's); then only the blocks past the prefix this worker holds
  are pulled: NIXL READ where both sides loaded it, else the prefill worker's ``PullKV`` stream.
  A pull that fails (worker killed, connection cut, time up) is logged and counted, the hold is
  released if the prefill worker still answers, and the request prefills here: it still completes.

This is the transfer side of the split (vLLM v1's worker-side connector): it moves bytes and talks to other
workers. The engine's side (model_worker/engine/kv_connector.py) owns the pool and the holds on the step
thread; this side asks it through the engine's inbox (``EngineLoop.call``: a future it awaits) and hands it
legs with their requests (model_worker/engine/kv_legs.py). It never reads the engine's P/D state itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from kvmesh.contract.convert import kv_layout_from_pb, kv_layout_to_pb
from kvmesh.contract.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvmesh.contract.kv_transfer import GRPC, NIXL, KVSource, TransferStats, serves_decode, serves_prefill
from kvmesh.contract.limits import excerpt
from kvmesh.model_worker.engine.engine_loop import EngineLoop
from kvmesh.model_worker.engine.kv_legs import HeldKV, KVImport
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.serving.metrics import WorkerMetrics
from kvmesh.model_worker.transfer.nixl_transport import NixlError, NixlTransport
from kvmesh.transport.channels import dial_aio
from kvmesh.transport.security import call_metadata
from kvmesh.v1 import worker_pb2 as pb
from kvmesh.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.worker.kv_transfer")

T = TypeVar("T")

CHUNK_BYTES = 1 << 20
"""Bytes of block data per PullKV message at most (whole blocks; at least one)."""


@dataclass(slots=True)
class Pulled:
    """What a decode leg's pull gave: the import for the engine (None: nothing came) and how."""

    kv_import: KVImport | None
    transport: str
    """nixl, grpc, or local (nothing pulled: the worker prefills the prompt itself)."""
    blocks: int = 0
    bytes: int = 0
    skipped: int = 0
    """Offered blocks this worker held already (not sent)."""
    cause: str = ""
    """Why nothing came, when nothing did."""
    seconds: float = 0.0
    """How long the pull took (a failed one too)."""


class KVTransfers:
    """The transfer side of one worker's prefill/decode disaggregation (on the gRPC server's event loop).

    Args:
        loop: the engine's step thread; the engine's side of P/D is asked through it, and only through it.
        worker_id: this worker's id (named in errors, logs and pulls).
        address: where other workers reach this one (a prefill leg's answer).
        metrics: the worker's metrics.
        role: prefill, decode or both.
        transport: auto (NIXL when it loads, else gRPC), nixl or grpc.
        hold_ttl_s: how long a prefill leg's blocks are held when nobody pulls them.
        pull_timeout_s: a decode leg's pull, at most; past it the worker prefills itself.
    """

    def __init__(self, loop: EngineLoop, worker_id: str, address: str, metrics: WorkerMetrics, role: str,
                 transport: str = "auto", hold_ttl_s: float = 30.0, pull_timeout_s: float = 10.0) -> None:
        engine = loop.engine
        self.loop = loop
        self.worker_id = worker_id
        self.address = address
        self.metrics = metrics
        self.role = role
        self.hold_ttl_s = hold_ttl_s
        self.pull_timeout_s = pull_timeout_s
        self.stats = TransferStats()
        # NOTE: the engine's parts that never change: the KV cache's bytes (read for a PullKV stream, filled
        # into a staging buffer by a pull) and the block hash spec.
        self.kv_blocks = engine.kv_blocks
        self.block_hasher = engine.block_hasher
        self.layout = engine.kv_blocks.layout if engine.kv_blocks is not None else None
        self._offered: dict[str, None] = {}
        """Holds whose NIXL description went out and that no release or ttl ended yet (this side's own record)."""
        self.nixl: NixlTransport | None = None
        if role != "both" and transport in ("auto", NIXL) and engine.kv_blocks is not None:
            from kvmesh.model_worker.transfer import nixl_transport

            # NOTE: NIXL's progress thread reads this side's record, never the engine's holds.
            offered = self._offered
            self.nixl, why = nixl_transport.load(worker_id, engine.kv_blocks, lambda: bool(offered))
            if self.nixl is None:
                if transport == NIXL:
                    raise ValueError(f"--kv-transport nixl: {why}")
                log.warning("KV transport: gRPC streaming (NIXL unavailable: %s)", why)
        if self.nixl is not None:
            log.info("KV transport: NIXL (UCX), gRPC streaming as the fallback")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._labels = {"model_name": engine.model_id}

    @property
    def transports(self) -> tuple[str, ...]:
        return (NIXL, GRPC) if self.nixl is not None else (GRPC,)

    async def _ask(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)``'s result, run on the step thread (model_worker/engine/kv_connector.py's methods)."""
        return await asyncio.wrap_future(self.loop.call(fn))

    def _count(self, side: str, transport: str, outcome: str) -> None:
        self.metrics.kv_transfers.labels(side=side, transport=transport, outcome=outcome, **self._labels).inc()

    # -- the prefill side -----------------------------------------------------------------------
    def check_prefill_leg(self, max_tokens: int | None) -> None:
        """Raises before anything runs: a prefill leg here, and of one token."""
        if not serves_prefill(self.role):
            raise FailedPrecondition(f"worker {self.worker_id} is a {self.role} worker: it takes no prefill leg "
                                     "(kv_transfer.do_remote_decode); send it to a prefill worker")
        if self.layout is None:
            raise FailedPrecondition(f"worker {self.worker_id} has no KV cache to hand over (a simulated worker)")
        if max_tokens != 1:
            raise InvalidArgument(f"a prefill leg (kv_transfer.do_remote_decode) computes the prompt and one token: "
                                  f"max_tokens must be 1, got {max_tokens}", param="max_tokens")

    def source_for(self, request_id: str, held: HeldKV | None, first_token: int | None) -> KVSource:
        """The prefill leg's answer: where its held blocks are (``held``: what the engine's side held when
        the leg ended, PrefillLeg.held)."""
        hashes, ids = (held.block_hashes, held.block_ids) if held is not None else ((), ())
        assert self.layout is not None
        meta = self.nixl.describe(ids) if self.nixl is not None and ids else b""
        if meta:
            self._offered[request_id] = None
        if held is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(self.hold_ttl_s + 0.05, self._expire, request_id)
        return KVSource(request_id, self.worker_id, self.address, self.layout, hashes, self.transports, meta,
                        int(self.hold_ttl_s * 1000), first_token)

    def _expire(self, request_id: str) -> None:
        # NOTE: the engine releases expired holds at every step; an idle engine is woken for it.
        self._offered.pop(request_id, None)
        self.loop.call(lambda e: e.kv_connector.expire(time.monotonic()))

    async def release(self, request_id: str) -> bool:
        """Ends the hold of ``request_id`` (ReleaseKV); False when there was none."""
        self._offered.pop(request_id, None)
        return await self._ask(lambda e: e.kv_connector.release(request_id))

    async def serve_pull(self, request: pb.PullKVRequest) -> AsyncIterator[pb.KVBlockChunk]:
        """The PullKV stream: the held blocks from ``start_block`` on; the hold is released once all went."""
        rid = request.request_id
        reading = await self._ask(lambda e: e.kv_connector.begin_read(rid))
        if reading is None:
            raise NotFound(f"no KV is held under request id {excerpt(rid)} on worker "
                           f"{self.worker_id} (released, expired, or never prefilled here)")
        # NOTE: until end_read the engine's side keeps the hold's blocks, released or not: no block is handed
        # out and overwritten while its bytes are read here.
        read_id, held = reading
        done = False
        try:
            assert self.layout is not None and self.kv_blocks is not None
            if not request.HasField("layout"):
                raise InvalidArgument("PullKV needs the puller's layout")
            self.layout.check_compatible(kv_layout_from_pb(request.layout))
            kv = self.kv_blocks
            ids = list(held.block_ids[request.start_block:])
            per = max(1, CHUNK_BYTES // self.layout.bytes_per_block)
            loop = asyncio.get_running_loop()
            sent = 0
            for i in range(0, len(ids), per):
                part = ids[i:i + per]
                data = await loop.run_in_executor(None, lambda p=part: kv.read(p).numpy().tobytes())
                yield pb.KVBlockChunk(start_block=request.start_block + i, num_blocks=len(part), data=data)
                sent += len(part)
            done = True
        finally:
            if done:
                self._offered.pop(rid, None)
            self.loop.call(lambda e: e.kv_connector.end_read(read_id, rid, release=done))
        self.stats.served_blocks += sent
        self.stats.served_bytes += sent * self.layout.bytes_per_block
        self.metrics.kv_transfer_blocks.labels(side="prefill", **self._labels).inc(sent)
        self.metrics.kv_transfer_bytes.labels(side="prefill", **self._labels).inc(sent * self.layout.bytes_per_block)
        self._count("prefill", GRPC, "ok")
        log.info("request %s: %d KV blocks sent to %s over gRPC", rid, sent, excerpt(request.worker_id) or "?")

    # -- the decode side ------------------------------------------------------------------------
    def check_decode_leg(self, request_id: str, prompt: Sequence[int], cache_salt: str, source: KVSource) -> None:
        """Raises before any KV moves: this worker takes decode legs, the blocks fit its cache and are
        this prompt's, the request id is not in flight here."""
        if not serves_decode(self.role):
            raise FailedPrecondition(f"worker {self.worker_id} is a {self.role} worker: it takes no decode leg "
                                     "(kv_transfer.source); send it to a decode worker")
        if self.layout is None:
            raise FailedPrecondition(f"worker {self.worker_id} has no KV cache to take blocks into (a simulated worker)")
        self.layout.check_compatible(source.layout)
        if self.loop.in_flight(request_id):
            raise AlreadyExists(f"request id {excerpt(request_id)} is already in flight on this worker; give every "
                                "request its own id")
        bs = self.layout.block_size
        usable = max(0, (len(prompt) - 1) // bs)
        if len(source.block_hashes) > usable:
            raise InvalidArgument(f"kv_transfer.source offers {len(source.block_hashes)} blocks, but a prompt of "
                                  f"{len(prompt)} tokens has {usable} reusable full blocks", param="kv_transfer")
        if source.block_hashes:
            mine = self.block_hasher.hash_prompt(list(prompt[:len(source.block_hashes) * bs]), cache_salt)
            if tuple(mine) != tuple(source.block_hashes):
                raise FailedPrecondition("kv_transfer.source's blocks are not this prompt's (another prompt, model, "
                                         "cache_salt or hash spec): send the decode leg the prefill leg's own prompt "
                                         "and cache_salt")

    async def pull(self, request_id: str, source: KVSource) -> Pulled:
        """The blocks of ``source`` this worker lacks. Never raises for a failed transfer: the request
        then prefills here (``Pulled.transport`` "local", ``cause`` says why)."""
        hashes = list(source.block_hashes)
        start = await self._ask(lambda e: e.kv_connector.leading_cached(hashes))
        n = len(hashes) - start
        if n <= 0:
            self._count("decode", "local", "held")
            self._release_remote(source)
            return Pulled(None, "local", skipped=start, cause="every offered block is held here already")
        t0 = time.perf_counter()
        transport = NIXL if self.nixl is not None and NIXL in source.transports and source.nixl_metadata else GRPC
        try:
            return await self._pull(request_id, source, hashes, start, n, transport, t0)
        except asyncio.CancelledError:
            # NOTE: the decode leg's caller went away mid-pull: the prefill worker frees its hold now.
            self._release_remote(source)
            raise

    async def _pull(self, request_id: str, source: KVSource, hashes: list[bytes], start: int, n: int, transport: str,
                    t0: float) -> Pulled:
        try:
            if transport == NIXL:
                assert self.nixl is not None
                blocks = await asyncio.get_running_loop().run_in_executor(
                    None, self.nixl.read, source.nixl_metadata, start, n, self.pull_timeout_s)
                self._release_remote(source)
            else:
                blocks = await asyncio.wait_for(self._pull_grpc(source, start, n), self.pull_timeout_s)
        except (NixlError, grpc.aio.AioRpcError, asyncio.TimeoutError, ValueError) as exc:  # noqa: UP041
            cause = (f"{type(exc).__name__}: {exc.code().name} {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                     else f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            if self.nixl is not None and transport == NIXL:
                self.nixl.forget(source.worker_id)
            self.stats.failed[transport] = self.stats.failed.get(transport, 0) + 1
            self._count("decode", transport, "failed")
            log.warning("request %s: KV pull from %s over %s failed (%s); prefilling it here", request_id,
                        source.worker_id, transport, cause)
            self._release_remote(source)
            return Pulled(None, "local", cause=cause, skipped=start, seconds=time.perf_counter() - t0)
        size = n * self.layout.bytes_per_block if self.layout is not None else 0
        self.stats.pulled[transport] = self.stats.pulled.get(transport, 0) + 1
        self.stats.pulled_blocks += n
        self.stats.pulled_bytes += size
        self.stats.skipped_blocks += start
        m = self.metrics
        m.kv_transfer_blocks.labels(side="decode", **self._labels).inc(n)
        m.kv_transfer_bytes.labels(side="decode", **self._labels).inc(size)
        seconds = time.perf_counter() - t0
        m.kv_transfer_seconds.labels(transport=transport, **self._labels).observe(seconds)
        self._count("decode", transport, "ok")
        log.info("request %s: %d KV blocks (%d bytes) pulled from %s over %s, %d held here already", request_id, n,
                 size, source.worker_id, transport, start)
        return Pulled(KVImport(hashes, start, blocks), transport, n, size, start, seconds=seconds)

    async def _pull_grpc(self, source: KVSource, start: int, n: int):
        assert self.layout is not None and self.kv_blocks is not None
        kv = self.kv_blocks
        out = kv.empty(n)
        got = 0
        stub = pb_grpc.WorkerStub(self._channel(source.address))
        call = stub.PullKV(pb.PullKVRequest(request_id=source.request_id, start_block=start,
                                            layout=kv_layout_to_pb(self.layout), worker_id=self.worker_id),
                           timeout=self.pull_timeout_s, metadata=call_metadata())
        async for chunk in call:
            i = chunk.start_block - start
            if i != got or chunk.num_blocks < 1 or got + chunk.num_blocks > n:
                raise ValueError(f"PullKV sent blocks {chunk.start_block}+{chunk.num_blocks}, expected {start + got}")
            out[i:i + chunk.num_blocks] = kv.from_bytes(chunk.data, chunk.num_blocks)
            got += chunk.num_blocks
        if got != n:
            raise ValueError(f"PullKV ended after {got} of {n} blocks")
        return out

    def _release_remote(self, source: KVSource) -> None:
        """Tells the prefill worker to free its hold (best effort: its ttl frees it otherwise)."""
        async def go() -> None:
            try:
                await pb_grpc.WorkerStub(self._channel(source.address)).ReleaseKV(
                    pb.ReleaseKVRequest(request_id=source.request_id), timeout=2.0, metadata=call_metadata())
            except grpc.aio.AioRpcError as exc:
                log.debug("ReleaseKV at %s: %s", source.address, exc.code().name)

        asyncio.get_running_loop().create_task(go())

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = dial_aio(address)
        return ch

    async def close(self) -> None:
        if self.nixl is not None:
            self.nixl.close()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
