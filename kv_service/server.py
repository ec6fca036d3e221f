"""gRPC adapter of the kv_service: protobuf in, KVService calls, protobuf out."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from kvmesh.contract.convert import (
    LookupReplies,
    algorithm_to_pb,
    audit_from_pb,
    audit_to_pb,
    events_from_pb,
    load_from_pb,
    registration_from_pb,
    reservation_answer_to_pb,
    reservation_from_pb,
    worker_info_to_pb,
)
from kvmesh.contract.errors import InvalidArgument, ResourceExhausted
from kvmesh.contract.limits import MAX_EXTRA_KEYS_CHARS, check_length
from kvmesh.kv_service.config import FaultConfig, KVServiceConfig, ServiceConfig
from kvmesh.kv_service.index import BlockIndex, PublishResult
from kvmesh.kv_service.metrics import KVMetrics
from kvmesh.kv_service.publish_trace import PublishTrace
from kvmesh.kv_service.service import KVService, now_ms
from kvmesh.kv_service.worker_watch import WorkerWatch
from kvmesh.transport import tracing
from kvmesh.transport.loop import LoopServer, LoopThread
from kvmesh.transport.server import AioServer
from kvmesh.transport.status import code_of
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.kv_service")

T = TypeVar("T")

STREAM_BACK_S = 0.3
"""How long after its event stream ended a worker may open the next before it counts as gone."""

LEAVE_REASON_OF = {pb.LEAVE_REASON_DRAINING: "draining", pb.LEAVE_REASON_UNREACHABLE: "unreachable"}

LOOKUP_RPC = tracing.rpc_attributes(pb.DESCRIPTOR.services_by_name["KVService"].full_name, "Lookup")
RESERVE_RPC = tracing.rpc_attributes(pb.DESCRIPTOR.services_by_name["KVService"].full_name, "Reserve")

DEFAULT_MAX_PUBLISHERS = KVServiceConfig().max_publishers
"""Workers that may hold a PublishEvents stream on one replica at once (a stream is a coroutine)."""


async def run_on(ingest: LoopThread | None, call: Coroutine[Any, Any, T]) -> T:
    """``call`` run on the ingest loop's thread and awaited from this loop (``ingest`` None: here).

    NOTE: this loop only waits on the result, so it keeps answering Lookups and Reserves while the
    ingest loop converts, checks and applies a batch (docs/kv-service.md "Reads apart from ingest")."""
    if ingest is None:
        return await call
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, ingest.loop))


class KVServiceServicer(pb_grpc.KVServiceServicer):
    def __init__(self, service: KVService, max_publishers: int = DEFAULT_MAX_PUBLISHERS,
                 faults: FaultConfig | None = None, ingest: LoopThread | None = None) -> None:
        self.svc = service
        self._ingest = ingest
        """The loop event batches are applied on (the service's writer's); None: this one."""
        self.max_publishers = max_publishers
        self._publishers = 0
        self._replies = LookupReplies()
        faults = faults or FaultConfig()
        # NOTE: half of an injected delay before the index is read or written, half after: a slow
        # round trip, so a pick lands late and its answer comes back late.
        self._lookup_delay_s = faults.lookup_delay_ms / 2000
        self._reserve_delay_s = faults.reserve_delay_ms / 2000
        self._landing: set[asyncio.Future] = set()
        self.watch = WorkerWatch(lambda: service.index.workers(now_ms()), service.config.watch_interval_ms / 1000)
        self.stopping = False
        """The replica stops: its streams that end say nothing of their workers."""
        self._streams: dict[str, int] = {}
        """worker id -> its open event streams on this replica."""

    async def RegisterWorker(self, request, context):
        check_length("extra_keys", request.extra_keys, MAX_EXTRA_KEYS_CHARS)
        reg = registration_from_pb(request)
        ttl = await self.svc.register(reg)
        self.watch.poke()
        log.info("registered worker %s (%s, model %s, epoch %d)", reg.worker_id, reg.address, reg.model_id, reg.epoch)
        return pb.RegisterWorkerResponse(lease_ttl_ms=ttl, next_seq=1)

    async def Heartbeat(self, request, context):
        answer = await self.svc.heartbeat(request.worker_id, request.epoch, load_from_pb(request.load))
        return pb.HeartbeatResponse(lease_ttl_ms=answer.lease_ttl_ms, resync=answer.resync)

    def PublishEvents(self, request_iterator, context) -> AsyncIterator[pb.PublishEventsResponse]:
        """The stream's answers (the error interceptor iterates them): traced while tracing is on."""
        if not tracing.ON:
            return self._publish(request_iterator, context, None)
        return self._traced_publish(request_iterator, context)

    async def _traced_publish(self, request_iterator, context) -> AsyncIterator[pb.PublishEventsResponse]:
        trace = PublishTrace(tracing.extract(context.invocation_metadata()))
        try:
            async for answer in self._publish(request_iterator, context, trace):
                yield answer
        except BaseException as exc:
            trace.end(code_of(exc), exc)
            raise
        trace.end()

    async def _publish(self, request_iterator, context,
                       trace: PublishTrace | None) -> AsyncIterator[pb.PublishEventsResponse]:
        # NOTE: a stream is a coroutine, not a thread, so the bound is about Redis and memory,
        # not about starving unary calls.
        if self._publishers >= self.max_publishers:
            self.svc.metrics.rejected.labels("max_publishers").inc()
            raise ResourceExhausted(
                f"this kv_service replica already serves {self.max_publishers} publishing workers: "
                "start it with a larger --max-publishers or point workers at another replica")
        self._publishers += 1
        sender: tuple[str, int] | None = None
        ended = False
        try:
            # NOTE: one message at a time: the next is read once this one is applied and answered, so a
            # worker's batches apply in its stream's order wherever they are applied.
            async for req in request_iterator:
                if sender is None and req.stream_bound:
                    sender = (req.worker_id, req.epoch)
                    self._streams[req.worker_id] = self._streams.get(req.worker_id, 0) + 1
                result = await self._applied(req, trace)
                yield pb.PublishEventsResponse(seq=req.seq, action=int(result.action), reason=result.reason)
            ended = True
        finally:
            self._publishers -= 1
            if sender is not None:
                self._streams[sender[0]] -= 1
                if ended and not self.stopping:
                    self._gone_unless_back(*sender)

    def _gone_unless_back(self, worker_id: str, epoch: int) -> None:
        """A worker's event stream that its liveness is bound to (``stream_bound``) ended. One that stops
        says so first (LeaveWorker, at its drain), one that restarts its stream opens the next at once; a
        stream that ends with no next one is a worker whose process is gone (SIGKILL, a crash, its node):
        it leaves the live set now, not at lease expiry.

        NOTE: grpc.aio tells a stream cut with its connection from one the client closed in no way: both
        end its request iterator. A worker that lives on after all registers again at its next heartbeat.
        Streams that do not say they are bound (tools, tests, an older worker) never do this."""
        async def leave() -> None:
            await asyncio.sleep(STREAM_BACK_S)
            if self._streams.get(worker_id, 0) > 0 or self.stopping:
                return
            self._streams.pop(worker_id, None)
            try:
                if await self.svc.leave(worker_id, epoch, "unreachable", "kv_service: its event stream ended"):
                    log.warning("worker %s (epoch %d): its event stream ended and no other came; out of the live "
                                "set", worker_id, epoch)
                    self.watch.poke()
            except Exception as exc:  # noqa: BLE001 - its lease still ends on its own
                log.info("worker %s: leave after its stream ended failed: %s", worker_id, exc)

        task = asyncio.ensure_future(leave())
        self._landing.add(task)
        task.add_done_callback(self._landing.discard)

    async def _applied(self, req: pb.PublishEventsRequest, trace: PublishTrace | None) -> PublishResult:
        """``req`` applied where batches are (run_on); a ``kv.batch`` event of the stream's span while traced."""
        if trace is None:
            return await run_on(self._ingest, self._apply(req))
        trace.received(req.worker_id)
        t0 = time.perf_counter()
        result = await run_on(self._ingest, self._apply(req))
        events = len(req.snapshot_hashes) if req.snapshot else len(req.events)
        trace.applied(req.seq, events, result.action.name.lower(), req.snapshot, time.perf_counter() - t0)
        return result

    async def _apply(self, req: pb.PublishEventsRequest) -> PublishResult:
        """One PublishEvents message converted, checked and applied (on the ingest loop when apart)."""
        load = load_from_pb(req.load) if req.HasField("load") else None
        if req.snapshot:
            if req.events:
                raise InvalidArgument("a snapshot batch carries snapshot_hashes only; events must be empty")
            return await self.svc.snapshot(req.worker_id, req.epoch, req.seq, list(req.snapshot_hashes),
                                           load, list(req.snapshot_host_hashes))
        if req.snapshot_hashes or req.snapshot_host_hashes:
            raise InvalidArgument("snapshot_hashes / snapshot_host_hashes given without snapshot=true")
        return await self.svc.publish(req.worker_id, req.epoch, req.seq, events_from_pb(req.events), load)

    async def _late(self, half_s: float, call: Coroutine[Any, Any, T]) -> T:
        """``call``, ``half_s`` late, answered ``half_s`` after it ran (an injected slow round trip).

        NOTE: the first half and the call are shielded: a caller that gives up (its deadline) does not
        recall a request already on the wire; a Reserve lands although its router forwarded unreserved."""
        if not half_s:
            return await call

        async def arrive() -> T:
            await asyncio.sleep(half_s)
            return await call

        task = asyncio.ensure_future(arrive())
        self._landing.add(task)
        task.add_done_callback(self._landing.discard)
        result = await asyncio.shield(task)
        await asyncio.sleep(half_s)
        return result

    async def Lookup(self, request, context):
        reserve = reservation_from_pb(request.reserve) if request.HasField("reserve") else None
        call = self.svc.lookup_reserve(request.model_id, request.block_hashes, reserve)
        if tracing.ON:
            with tracing.rpc_span("kv.lookup", tracing.extract(context.invocation_metadata()),
                                  {**LOOKUP_RPC, "kvmesh.blocks": len(request.block_hashes),
                                   "kvmesh.reserve": reserve is not None}, "server", code_of):
                matches, reserved = await self._late(self._lookup_delay_s, call)
        else:
            matches, reserved = await self._late(self._lookup_delay_s, call)
        bs = matches[0].block_size if matches else 0
        return self._replies.response(matches, bs, len(request.block_hashes), reserved)

    async def Reserve(self, request, context):
        call = self._late(self._reserve_delay_s, self.svc.reserve(reservation_from_pb(request)))
        if tracing.ON:
            with tracing.rpc_span("kv.reserve", tracing.extract(context.invocation_metadata()),
                                  {**RESERVE_RPC, "kvmesh.worker_id": request.worker_id}, "server", code_of):
                answer = await call
        else:
            answer = await call
        return reservation_answer_to_pb(answer)

    async def ReportAudit(self, request, context):
        audits = dict(audit_from_pb(w) for w in request.workers)
        if len(audits) != len(request.workers):
            raise InvalidArgument("workers names a worker twice")
        self.svc.report_audit(request.router_id, audits)
        return pb.ReportAuditResponse()

    async def GetAudit(self, request, context):
        return pb.GetAuditResponse(workers=[audit_to_pb(w, a) for w, a in (await self.svc.audit()).items()])

    async def LookupTokens(self, request, context):
        bs, matches = await self.svc.lookup_tokens(request.model_id, request.token_ids, request.cache_salt)
        return self._replies.response(matches, bs, len(request.token_ids) // bs if bs else 0)

    async def GetStats(self, request, context):
        st = await self.svc.index.stats(now_ms())
        return pb.GetStatsResponse(
            live_workers=st.live_workers, indexed_blocks=st.indexed_blocks, block_replicas=st.block_replicas,
            store=self.svc.index.name,
            models=[
                pb.ModelStats(model_id=spec.model_id, block_size=spec.block_size,
                              hash_algorithm=algorithm_to_pb(spec.hash_algorithm), live_workers=n)
                for spec, n in st.models
            ],
            lookups_total=self.svc.lookups_total, events_applied_total=self.svc.events_applied_total,
            resyncs_total=self.svc.resyncs_total, host_indexed_blocks=st.host_indexed_blocks,
            host_block_replicas=st.host_block_replicas,
        )

    async def ListWorkers(self, request, context):
        now = now_ms()
        infos = await self.svc.index.workers(now, include_expired=request.include_expired)
        return pb.ListWorkersResponse(workers=[worker_info_to_pb(info, now) for info in infos])

    async def GetBlock(self, request, context):
        holders, host = await self.svc.get_block(request.block_hash)
        return pb.GetBlockResponse(block_hash=request.block_hash, holders=holders, refcount=len(holders),
                                   host_holders=host)

    async def LeaveWorker(self, request, context):
        reason = LEAVE_REASON_OF.get(request.reason)
        if reason is None:
            raise InvalidArgument("reason must be LEAVE_REASON_DRAINING or LEAVE_REASON_UNREACHABLE")
        left = await self.svc.leave(request.worker_id, request.epoch, reason, request.reporter)
        if left:
            self.watch.poke()
            log.info("worker %s left the live set (%s, said by %s)", request.worker_id, reason,
                     request.reporter or "someone")
        return pb.LeaveWorkerResponse(left=left)

    async def WatchWorkers(self, request, context):
        async for infos in self.watch.watch():
            now = now_ms()
            yield pb.ListWorkersResponse(workers=[worker_info_to_pb(info, now) for info in infos])

    async def FlushWorker(self, request, context):
        removed = await self.svc.flush(request.worker_id)
        log.info("flushed worker %s from the index (%d blocks); it is asked to resync", request.worker_id, removed)
        return pb.FlushWorkerResponse(blocks_removed=removed)


class KVServiceServer(LoopServer):
    """The kv_service process: a grpc.aio server on an event loop of its own (``start``/``stop`` are
    called from any other thread), and, where the store has a writer (``BlockIndex.writer``: the Redis
    store with ``--ingest-loop apart``), a second loop thread that applies event batches and runs the
    reaper of expired workers through it; else both run on the serving loop.

    ``metrics`` (made here, at start of the service) holds this server's Prometheus registry.
    """

    def __init__(self, index: BlockIndex, host: str = "0.0.0.0", port: int = 50052,
                 config: ServiceConfig | None = None, max_publishers: int = DEFAULT_MAX_PUBLISHERS,
                 faults: FaultConfig | None = None) -> None:
        if max_publishers < 1:
            raise ValueError(f"max_publishers must be >= 1, got {max_publishers}")
        self.metrics = KVMetrics()
        writer = index.writer()
        self.service = KVService(index, config, self.metrics, events=writer)
        self.ingest = LoopThread("kv-ingest") if writer is not None else None
        """The event loop thread of event batches and the reaper (None: they run on the serving loop)."""
        self._loop = LoopThread("kv-service")
        self.grpc: AioServer = self._loop.run(self._build(host, port, max_publishers, faults))
        self.port = self.grpc.port
        self._reaper: asyncio.Task | concurrent.futures.Future | None = None

    async def _build(self, host: str, port: int, max_publishers: int, faults: FaultConfig | None) -> AioServer:
        server = AioServer(host, port)
        self.servicer = KVServiceServicer(self.service, max_publishers, faults, self.ingest)
        pb_grpc.add_KVServiceServicer_to_server(self.servicer, server.server)
        server.add_service(pb.DESCRIPTOR.services_by_name["KVService"].full_name)
        return server

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.service.config.reap_every_s)
            try:
                n = await self.service.reap()
                if n:
                    log.info("reaped %d expired worker(s)", n)
            except Exception as exc:  # noqa: BLE001 - keep reaping; the store may come back
                log.warning("reaper: %s", exc)

    async def _start(self) -> None:
        await self.service.index.ping()  # Unavailable: the CLI prints one line and exits
        if self.ingest is not None:
            await run_on(self.ingest, self.service.events.ping())
        await self.grpc.start()
        if self.ingest is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())
        else:
            self._reaper = asyncio.run_coroutine_threadsafe(self._reap_loop(), self.ingest.loop)
        await self.grpc.set_serving(True)

    def start(self) -> KVServiceServer:
        """Raises kvmesh.contract.errors.Unavailable when the store cannot be reached."""
        try:
            self._loop.run(self._start())
        except Exception:
            self.stop(0)
            raise
        return self

    async def _stop(self, grace: float) -> None:
        self.servicer.stopping = True
        await self.servicer.watch.close()
        if self._reaper is not None:
            self._reaper.cancel()
        await self.grpc.stop(grace)
        await self.service.index.close()
        if self.ingest is not None:
            await run_on(self.ingest, self.service.events.close())

    def stop(self, grace: float = 2.0) -> None:
        super().stop(grace)
        if self.ingest is not None:
            self.ingest.stop()
