"""Worker discovery: one task on the router's loop polls every model's workers at once (kv_service's
ListWorkers, or GetLoad of each static address) and hands each model's to its pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc

from kvmesh.contract.block_hash import algorithm_name
from kvmesh.contract.convert import load_from_pb
from kvmesh.contract.index_protocol import Registration, WorkerInfo
from kvmesh.contract.types import Load, ModelSpec
from kvmesh.kv_client.router_client import KVServiceClient
from kvmesh.router.config import RouterConfig
from kvmesh.router.core.upstream import WorkerEndpoint
from kvmesh.router.workers.worker_calls import WorkerChannels
from kvmesh.router.workers.worker_pool import GrpcWorkerPool
from kvmesh.transport.security import call_metadata
from kvmesh.v1 import worker_pb2 as w_pb

log = logging.getLogger("kvmesh.router.discovery")


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
        self._tasks: list[asyncio.Task] = []
        self.pushes = 0
        """Worker sets the kv_service pushed (WatchWorkers) and this front applied."""

    async def start(self) -> WorkerDiscovery:
        await self.refresh()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._loop())]
        if self.kv is not None and not self.config.workers:
            self._tasks.append(loop.create_task(self._watch()))
        return self

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.channels.close()
        if self.kv is not None:
            await self.kv.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.routing.discovery_interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - keep polling; log and keep the last good set
                log.exception("worker discovery failed")

    async def _watch(self) -> None:
        """Push discovery: the kv_service's WatchWorkers stream, applied as each set arrives (a worker that
        drains or is reported down leaves every front at once); the poll stays as the fallback, and a
        broken stream is opened again."""
        assert self.kv is not None
        delay = 0.1
        while True:
            try:
                async for infos in self.kv.watch_workers():
                    delay = 0.1
                    self.pushes += 1
                    self._apply_kv(infos)
                    await self._after()
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("kv_service at %s has no WatchWorkers; polling every %gs", self.kv.target,
                             self.config.routing.discovery_interval_s)
                    return
                log.debug("worker watch ended: %s", exc.code().name)
            except Exception:  # noqa: BLE001 - the poll goes on; watch again
                log.exception("worker watch failed")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def refresh(self) -> None:
        """One poll of the worker source."""
        if self.config.workers:
            await self._refresh_static()
        else:
            await self._refresh_from_kv()
        await self._after()

    async def _after(self) -> None:
        pools = self._pools()
        await self.channels.prune({e.address for p in pools for e in p.endpoints()} | set(self.config.workers))
        if self._on_change is not None:
            await self._on_change(any(p.endpoints() for p in pools))

    async def _refresh_from_kv(self) -> None:
        assert self.kv is not None
        try:
            infos = await self.kv.list_workers()
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
        self._apply_kv(infos)

    def _apply_kv(self, infos: list[WorkerInfo]) -> None:
        """The kv_service's live workers (a poll's or a push's) handed to each model's pool."""
        self._problem = ""
        by_model: dict[str, list[Registration]] = {}
        loads: dict[str, Load] = {}
        for w in infos:
            # NOTE: ListWorkers without include_expired names live workers only.
            by_model.setdefault(w.registration.model_id, []).append(w.registration)
            loads[w.registration.worker_id] = w.load
        for model_id in by_model:
            self._pool_for(model_id)
        for pool in self._pools():
            mine = by_model.get(pool.model_id, [])
            spec = None
            if mine:
                algo = mine[0].hash_algorithm or self.config.hash_algorithm
                spec = ModelSpec(pool.model_id, mine[0].block_size, algo)
            problem = "" if mine else (
                f"no live worker of model {pool.model_id!r} in kv_service"
                + (f" (it has: {', '.join(sorted(by_model))})" if by_model else ""))
            pool.update([WorkerEndpoint(w.worker_id, w.address, loads[w.worker_id], w.role, w.epoch) for w in mine],
                        spec, problem)

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
            found.setdefault(r.model_id, []).append(WorkerEndpoint(r.worker_id, address, load_from_pb(r.load),
                                                                   r.role or "both"))
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
