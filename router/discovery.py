"""gRPC side of the router's upstreams: the kv_service (Lookup, ListWorkers) and the workers.

Implements router/upstream.py's AsyncPrefixIndex and WorkerPool over ``grpc.aio`` channels, on the
router's event loop; discovery is a task on that loop. This is the one module of the router
that reads gRPC status codes of upstream calls; it turns them into ``Failure`` kinds for the
request path and ``IndexUnavailable`` for the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from kvmesh.contract.block_hash import algorithm_name
from kvmesh.contract.convert import PB_TO_ALGO, PB_TO_FINISH, load_from_pb, sampling_to_pb, usage_from_pb
from kvmesh.contract.errors import Unavailable
from kvmesh.contract.types import ModelSpec
from kvmesh.router.config import RouterConfig
from kvmesh.router.upstream import (
    Failure,
    IndexMatch,
    IndexUnavailable,
    WorkerChunk,
    WorkerEndpoint,
    WorkerError,
    WorkerRequest,
)
from kvmesh.transport.rpc import dial_aio
from kvmesh.transport.security import call_metadata
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc
from kvmesh.v1 import worker_pb2 as w_pb
from kvmesh.v1 import worker_pb2_grpc as w_grpc

log = logging.getLogger("kvmesh.router.discovery")

FAILURE_OF: dict[grpc.StatusCode, Failure] = {
    grpc.StatusCode.INVALID_ARGUMENT: Failure.INVALID,
    grpc.StatusCode.UNAVAILABLE: Failure.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Failure.BUSY,
    grpc.StatusCode.DEADLINE_EXCEEDED: Failure.TIMEOUT,
    grpc.StatusCode.CANCELLED: Failure.CANCELLED,
}
CHANNEL_IDLE_S = 900.0
"""A worker channel unused and out of the worker set this long is closed."""
EMPTY_GRACE_S = 5.0
"""How long an index that suddenly lists none of the model's workers is doubted (the last set kept)."""


class KVServiceClient:
    """Lookup with a short deadline; a failure raises IndexUnavailable (router/core.py's breaker then
    skips the index for a while). Build it on the loop that uses it.

    NOTE: a Lookup answer names every live worker with its load; reading 64 nested load messages
    field by field cost ~0.3 ms a request. An answer's entry (worker, address, matched blocks,
    load) repeats until the worker's next heartbeat or a different prompt, so each entry's
    IndexMatch is cached by its wire bytes (~0.4 us to get, against ~5 us to build).
    """

    MAX_CACHED = 16_384

    def __init__(self, target: str, lookup_timeout_s: float = 0.05, rpc_timeout_s: float = 2.0) -> None:
        self.target = target
        self.lookup_timeout_s = lookup_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = dial_aio(target)
        self._stub = kv_grpc.KVServiceStub(self._channel)
        self._md = call_metadata()
        self._matches: dict[bytes, IndexMatch] = {}

    def _match(self, m: kv_pb.WorkerMatch) -> IndexMatch:
        key = m.SerializeToString()
        found = self._matches.get(key)
        if found is None:
            if len(self._matches) >= self.MAX_CACHED:
                self._matches.clear()
            found = self._matches[key] = IndexMatch(m.worker_id, m.address, m.matched_blocks, load_from_pb(m.load))
        return found

    async def lookup(self, model_id: str, block_hashes: Sequence[bytes]) -> list[IndexMatch]:
        try:
            answer = await self._stub.Lookup(kv_pb.LookupRequest(model_id=model_id, block_hashes=block_hashes),
                                             timeout=self.lookup_timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            # NOTE: INVALID_ARGUMENT is about this Lookup, not the index being down: the breaker
            # must not open for every client because of one request (router/core.py).
            cause = "lookup_invalid" if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else "lookup_failed"
            raise IndexUnavailable(f"kv_service at {self.target}: {exc.code().name}: {exc.details()}", cause) from None
        return [self._match(m) for m in answer.workers]

    async def list_workers(self) -> list[kv_pb.WorkerInfo]:
        """Live workers of every model; raises grpc.aio.AioRpcError."""
        resp = await self._stub.ListWorkers(kv_pb.ListWorkersRequest(), timeout=self.rpc_timeout_s, metadata=self._md)
        return list(resp.workers)

    async def close(self) -> None:
        await self._channel.close()


class GrpcWorkerCall:
    """A Worker.Generate stream; iteration yields WorkerChunks and raises WorkerError."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, endpoint: WorkerEndpoint) -> None:
        self._call = call
        self._endpoint = endpoint

    async def __aiter__(self) -> AsyncIterator[WorkerChunk]:
        try:
            async for m in self._call:
                yield WorkerChunk(
                    list(m.token_ids),
                    PB_TO_FINISH.get(m.finish_reason) if m.finish_reason else None,
                    usage_from_pb(m.usage) if m.HasField("usage") else None,
                    m.worker_id,
                )
        except grpc.aio.AioRpcError as exc:
            failure = FAILURE_OF.get(exc.code(), Failure.OTHER)
            if failure is Failure.CANCELLED:
                # NOTE: this router cancels a call only when it stops reading it (its task was
                # cancelled); a CANCELLED status read here came from the worker (e.g. shutting down).
                failure = Failure.UNAVAILABLE
            raise WorkerError(failure, f"{exc.code().name}: {exc.details()}", exc.details() or "") from None

    def cancel(self) -> None:
        self._call.cancel()


class GrpcWorkerPool:
    """The workers of the served model: from kv_service's ListWorkers, or a static address list.

    A task on the router's loop refreshes the set every ``discovery_interval_s``; when the source
    fails the last good set stays. Channels are cached per address.
    """

    def __init__(self, config: RouterConfig, kv: KVServiceClient | None,
                 on_change: Callable[[bool], Awaitable[None]] | None = None) -> None:
        self.config = config
        self.kv = kv
        self.discovers_from_index = not config.workers
        self.problem = ""
        """Why the worker set is empty or stale (shown in UNAVAILABLE messages: no addresses)."""
        self.max_model_len = 0
        """The smallest max_model_len the static workers report (0 = unknown; kv_service discovery
        does not carry it)."""
        self._on_change = on_change
        self._endpoints: list[WorkerEndpoint] = []
        self._spec: ModelSpec | None = None
        self._model_id = config.model_id
        self._unhealthy: dict[str, float] = {}
        self._empty_since: float | None = None
        self._channels: dict[str, tuple[grpc.aio.Channel, w_grpc.WorkerStub, float]] = {}
        self._md = call_metadata()
        self._task: asyncio.Task | None = None

    # -- WorkerPool -------------------------------------------------------------------------
    def endpoints(self) -> list[WorkerEndpoint]:
        return self._endpoints

    def model_spec(self) -> ModelSpec:
        spec = self._spec
        if spec is not None:
            return spec
        if self._model_id:  # no worker seen yet: hash with the flags
            return ModelSpec(self._model_id, self.config.block_size, algorithm_name(self.config.hash_algorithm))
        raise Unavailable(f"the model id is not known yet ({self.problem or 'no worker registered'}): "
                          "start the router with --model DIR or --model-id ID")

    def healthy(self, worker_id: str) -> bool:
        until = self._unhealthy.get(worker_id)
        return until is None or time.monotonic() >= until

    def mark_unhealthy(self, worker_id: str) -> None:
        self._unhealthy[worker_id] = time.monotonic() + self.config.unhealthy_s

    def generate(self, endpoint: WorkerEndpoint, request: WorkerRequest, timeout_s: float) -> GrpcWorkerCall:
        call = self._stub(endpoint.address).Generate(
            w_pb.WorkerGenerateRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                                       sampling=sampling_to_pb(request.sampling), cache_salt=request.cache_salt),
            timeout=timeout_s, metadata=self._md)
        return GrpcWorkerCall(call, endpoint)

    # -- discovery ---------------------------------------------------------------------------
    async def start(self) -> GrpcWorkerPool:
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        channels, self._channels = self._channels, {}
        for channel, _, _ in channels.values():
            await channel.close()
        if self.kv is not None:
            await self.kv.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep polling; log and keep the last good set
                log.exception("worker discovery failed")

    async def refresh(self) -> None:
        """One poll of the worker source."""
        if self.config.workers:
            await self._refresh_static()
        else:
            await self._refresh_from_kv()
        await self._prune_channels()
        if self._on_change is not None:
            await self._on_change(bool(self._endpoints))

    async def _refresh_from_kv(self) -> None:
        assert self.kv is not None
        try:
            infos = [w for w in await self.kv.list_workers() if w.live]
        except grpc.aio.AioRpcError as exc:
            # NOTE: problem is shown to clients (UNAVAILABLE messages): no address in it.
            problem = f"the kv_service is unreachable ({exc.code().name})"
            if problem != self.problem:  # once per outage, not once per poll
                log.warning("kv_service at %s unreachable: %s; keeping the last %d worker(s)", self.kv.target,
                            exc.code().name, len(self._endpoints))
            self.problem = problem
            return
        if not self._model_id:
            models = sorted({w.model_id for w in infos})
            if len(models) > 1:
                self.problem = f"kv_service has several models ({', '.join(models)}): pass --model-id"
            elif models:
                self._model_id = models[0]
                log.info("serving model %r (the one model registered in kv_service)", self._model_id)
        mine = [w for w in infos if w.model_id == self._model_id]
        if mine:
            algo = PB_TO_ALGO.get(mine[0].hash_algorithm, self.config.hash_algorithm)
            self._spec = ModelSpec(self._model_id, mine[0].block_size, algo)
            self.problem = ""
        elif self._model_id:
            others = sorted({w.model_id for w in infos})
            self.problem = (f"no live worker of model {self._model_id!r} in kv_service"
                            + (f" (it has: {', '.join(others)})" if others else ""))
        if not mine and self._endpoints:
            # NOTE: a Redis that restarted empty lists no worker until each one's next heartbeat
            # gets NOT_FOUND and it registers again (a third of a lease). Dropping every worker at
            # once would fail every request in that window; a worker that really died fails its
            # requests as UNAVAILABLE (retried elsewhere) either way.
            now = time.monotonic()
            self._empty_since = self._empty_since or now
            if now - self._empty_since < EMPTY_GRACE_S:
                return
        self._empty_since = None
        # NOTE: replaced, never mutated: a request that read the list keeps a consistent one.
        self._endpoints = [WorkerEndpoint(w.worker_id, w.address, load_from_pb(w.load)) for w in mine]

    async def _refresh_static(self) -> None:
        found: list[WorkerEndpoint] = []
        problems = []
        lens: list[int] = []
        for address in self.config.workers:
            try:
                r = await self._stub(address).GetLoad(w_pb.GetLoadRequest(), timeout=self.config.rpc_timeout_s,
                                                       metadata=self._md)
            except grpc.aio.AioRpcError as exc:
                problems.append(f"{address}: {exc.code().name}")
                continue
            if not self._model_id:
                self._model_id = r.model_id
            if r.model_id != self._model_id:
                problems.append(f"{address} serves model {r.model_id!r}, not {self._model_id!r}")
                continue
            if self._spec is None or self._spec.block_size != r.block_size:
                self._spec = ModelSpec(self._model_id, r.block_size, algorithm_name(self.config.hash_algorithm))
            found.append(WorkerEndpoint(r.worker_id, address, load_from_pb(r.load)))
            lens.append(r.max_model_len)
        problem = f"{len(problems)} of {len(self.config.workers)} static workers unreachable or mismatched" \
            if problems else ""
        if problems and problem != self.problem:
            log.warning("static workers: %s", "; ".join(problems))
        self.problem = problem
        self.max_model_len = min((n for n in lens if n), default=0)
        self._endpoints = found

    def _stub(self, address: str) -> w_grpc.WorkerStub:
        entry = self._channels.get(address)
        if entry is None:
            channel = dial_aio(address)
            entry = (channel, w_grpc.WorkerStub(channel), time.monotonic())
        else:
            entry = (entry[0], entry[1], time.monotonic())
        self._channels[address] = entry
        return entry[1]

    async def _prune_channels(self) -> None:
        now = time.monotonic()
        live = {e.address for e in self._endpoints} | set(self.config.workers)
        stale = [a for a, (_, _, used) in self._channels.items() if a not in live and now - used > CHANNEL_IDLE_S]
        for address in stale:
            await self._channels.pop(address)[0].close()
