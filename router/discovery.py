"""gRPC side of the router's upstreams: the kv_service (Lookup, ListWorkers) and the workers.

Implements router/upstream.py's AsyncPrefixIndex and WorkerPool (one per model) over ``grpc.aio``
channels, on the router's event loop; discovery is one task on that loop that polls every model's
workers at once and hands each model's to its pool. This is the one module of the router
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
from kvmesh.contract.types import ModelSpec
from kvmesh.router.config import RouterConfig
from kvmesh.router.openai_worker import OpenAIWorkerCall, is_http, new_session
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


class WorkerChannels:
    """One aio channel per worker address, and one HTTP session for the workers served over the
    OpenAI API (router/openai_worker.py), shared by every model's pool; build it on the router's loop."""

    def __init__(self) -> None:
        self._channels: dict[str, tuple[grpc.aio.Channel, w_grpc.WorkerStub, float]] = {}
        self._http = None

    def http(self):
        """The aiohttp session (made on first use, on the router's loop)."""
        if self._http is None:
            self._http = new_session()
        return self._http

    def stub(self, address: str) -> w_grpc.WorkerStub:
        entry = self._channels.get(address)
        if entry is None:
            channel = dial_aio(address)
            entry = (channel, w_grpc.WorkerStub(channel), time.monotonic())
        else:
            entry = (entry[0], entry[1], time.monotonic())
        self._channels[address] = entry
        return entry[1]

    async def prune(self, live: set[str]) -> None:
        """Closes channels out of ``live`` and unused for CHANNEL_IDLE_S."""
        now = time.monotonic()
        stale = [a for a, (_, _, used) in self._channels.items() if a not in live and now - used > CHANNEL_IDLE_S]
        for address in stale:
            await self._channels.pop(address)[0].close()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel, _, _ in channels.values():
            await channel.close()
        if self._http is not None:
            await self._http.close()
            self._http = None


class GrpcWorkerPool:
    """The workers of one model, as :class:`WorkerDiscovery` last saw them, and calls to them.

    Args:
        model_id: the model.
        config: the router's flags (block size / hash algorithm until a worker reports them).
        channels: the router's worker channels.
        discovers_from_index: the set comes from kv_service (a Lookup may name newer workers).
    """

    def __init__(self, model_id: str, config: RouterConfig, channels: WorkerChannels,
                 discovers_from_index: bool = True) -> None:
        self.model_id = model_id
        self.config = config
        self.discovers_from_index = discovers_from_index
        self.problem = ""
        """Why the worker set is empty or stale (shown in UNAVAILABLE messages: no addresses)."""
        self.max_model_len = 0
        """The smallest max_model_len the static workers report (0 = unknown; kv_service discovery
        does not carry it)."""
        self._channels = channels
        self._endpoints: list[WorkerEndpoint] = []
        self._spec: ModelSpec | None = None
        self._unhealthy: dict[str, float] = {}
        self._empty_since: float | None = None
        self._md = call_metadata()

    # -- WorkerPool -------------------------------------------------------------------------
    def endpoints(self) -> list[WorkerEndpoint]:
        return self._endpoints

    def model_spec(self) -> ModelSpec:
        if self._spec is not None:
            return self._spec
        # NOTE: no worker seen yet: hash with the flags (a static pool's workers never report an algorithm).
        return ModelSpec(self.model_id, self.config.block_size, algorithm_name(self.config.hash_algorithm))

    def healthy(self, worker_id: str) -> bool:
        until = self._unhealthy.get(worker_id)
        return until is None or time.monotonic() >= until

    def mark_unhealthy(self, worker_id: str) -> None:
        self._unhealthy[worker_id] = time.monotonic() + self.config.unhealthy_s

    def generate(self, endpoint: WorkerEndpoint, request: WorkerRequest,
                 timeout_s: float) -> GrpcWorkerCall | OpenAIWorkerCall:
        if is_http(endpoint.address):
            return OpenAIWorkerCall(self._channels.http(), endpoint, request, timeout_s)
        call = self._channels.stub(endpoint.address).Generate(
            w_pb.WorkerGenerateRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                                       sampling=sampling_to_pb(request.sampling), cache_salt=request.cache_salt),
            timeout=timeout_s, metadata=self._md)
        return GrpcWorkerCall(call, endpoint)

    async def abort(self, endpoint: WorkerEndpoint, request_id: str) -> bool:
        if is_http(endpoint.address):
            return False  # NOTE: closing the call is the abort; its usage is not awaited
        try:
            r = await self._channels.stub(endpoint.address).Abort(
                w_pb.AbortRequest(request_id=request_id), timeout=self.config.rpc_timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            log.info("abort of %s on worker %s failed: %s", request_id, endpoint.worker_id, exc.code().name)
            return False
        return r.aborted

    # -- fed by WorkerDiscovery ------------------------------------------------------------------
    def update(self, endpoints: list[WorkerEndpoint], spec: ModelSpec | None, problem: str = "") -> None:
        """The model's live workers of the last poll (``spec`` None: keep the last one)."""
        if spec is not None:
            self._spec = spec
        self.problem = problem
        if not endpoints and self._endpoints and self.discovers_from_index:
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
        self._endpoints = endpoints

    def set_problem(self, problem: str) -> None:
        """The source failed: keep the last good set, say why it may be stale."""
        self.problem = problem


class WorkerDiscovery:
    """Polls the worker source every ``discovery_interval_s`` and hands each model's workers to its
    pool: kv_service's ListWorkers (every model in one call), or GetLoad of each static address.

    Args:
        pool_for: the pool of a model id, made on first sight (router/models.py's ModelSet).
        pools: the pools made so far (so a model whose workers all left is told so).
        on_change: awaited after each poll with whether any model has a worker (health).
    """

    def __init__(self, config: RouterConfig, kv: KVServiceClient | None, channels: WorkerChannels,
                 pool_for: Callable[[str], GrpcWorkerPool], pools: Callable[[], list[GrpcWorkerPool]],
                 on_change: Callable[[bool], Awaitable[None]] | None = None) -> None:
        self.config = config
        self.kv = kv
        self.channels = channels
        self._pool_for = pool_for
        self._pools = pools
        self._on_change = on_change
        self._problem = ""
        self._task: asyncio.Task | None = None

    async def start(self) -> WorkerDiscovery:
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.channels.close()
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
        pools = self._pools()
        await self.channels.prune({e.address for p in pools for e in p.endpoints()} | set(self.config.workers))
        if self._on_change is not None:
            await self._on_change(any(p.endpoints() for p in pools))

    async def _refresh_from_kv(self) -> None:
        assert self.kv is not None
        try:
            infos = [w for w in await self.kv.list_workers() if w.live]
        except grpc.aio.AioRpcError as exc:
            # NOTE: problem is shown to clients (UNAVAILABLE messages): no address in it.
            problem = f"the kv_service is unreachable ({exc.code().name})"
            if problem != self._problem:  # once per outage, not once per poll
                log.warning("kv_service at %s unreachable: %s; keeping the last worker sets", self.kv.target,
                            exc.code().name)
            self._problem = problem
            for pool in self._pools():
                pool.set_problem(problem)
            return
        self._problem = ""
        by_model: dict[str, list[kv_pb.WorkerInfo]] = {}
        for w in infos:
            by_model.setdefault(w.model_id, []).append(w)
        for model_id in by_model:
            self._pool_for(model_id)
        for pool in self._pools():
            mine = by_model.get(pool.model_id, [])
            spec = None
            if mine:
                algo = PB_TO_ALGO.get(mine[0].hash_algorithm, self.config.hash_algorithm)
                spec = ModelSpec(pool.model_id, mine[0].block_size, algo)
            problem = "" if mine else (
                f"no live worker of model {pool.model_id!r} in kv_service"
                + (f" (it has: {', '.join(sorted(by_model))})" if by_model else ""))
            pool.update([WorkerEndpoint(w.worker_id, w.address, load_from_pb(w.load)) for w in mine], spec, problem)

    async def _refresh_static(self) -> None:
        found: dict[str, list[WorkerEndpoint]] = {}
        block_size: dict[str, int] = {}
        problems = []
        lens: dict[str, list[int]] = {}
        for address in self.config.workers:
            try:
                r = await self.channels.stub(address).GetLoad(
                    w_pb.GetLoadRequest(), timeout=self.config.rpc_timeout_s, metadata=call_metadata())
            except grpc.aio.AioRpcError as exc:
                problems.append(f"{address}: {exc.code().name}")
                continue
            found.setdefault(r.model_id, []).append(WorkerEndpoint(r.worker_id, address, load_from_pb(r.load)))
            block_size.setdefault(r.model_id, r.block_size)
            lens.setdefault(r.model_id, []).append(r.max_model_len)
        # NOTE: problem is shown to clients (UNAVAILABLE messages): no address in it.
        problem = f"{len(problems)} of {len(self.config.workers)} static workers unreachable" if problems else ""
        if problems and problem != self._problem:
            log.warning("static workers: %s", "; ".join(problems))
        self._problem = problem
        for model_id in found:
            self._pool_for(model_id)
        for pool in self._pools():
            eps = found.get(pool.model_id, [])
            spec = (ModelSpec(pool.model_id, block_size[pool.model_id], algorithm_name(self.config.hash_algorithm))
                    if eps else None)
            pool.max_model_len = min((n for n in lens.get(pool.model_id, []) if n), default=0)
            pool.update(eps, spec, problem or ("" if eps else f"no worker in --workers serves {pool.model_id!r}"))
