"""The model worker's gRPC server: a thin adapter over EngineLoop + KVPublisher."""

from __future__ import annotations

import logging
import uuid

from kvmesh.contract.convert import FINISH_TO_PB, load_to_pb, sampling_from_pb, usage_to_pb
from kvmesh.contract.errors import ResourceExhausted, Unavailable
from kvmesh.contract.types import Usage
from kvmesh.model_worker import metrics
from kvmesh.model_worker.engine_loop import EngineLoop, TokenEvent, _Stream
from kvmesh.model_worker.kv_publisher import KVPublisher, registration
from kvmesh.model_worker.llm_engine import LLMEngine
from kvmesh.transport.rpc import GrpcServer
from kvmesh.v1 import worker_pb2 as pb
from kvmesh.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.worker")


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, worker: WorkerServer) -> None:
        self.w = worker

    def Generate(self, request, context):
        w = self.w
        if w.draining:
            raise Unavailable(f"worker {w.worker_id} is shutting down; retry on another worker")
        if w.loop.num_streams >= w.max_queued_requests:
            raise ResourceExhausted(
                f"worker {w.worker_id} has {w.max_queued_requests} requests in flight (--max-queued-requests); "
                "retry later or on another worker")
        params = sampling_from_pb(request.sampling)
        rid = request.request_id or uuid.uuid4().hex
        events = w.loop.submit(rid, list(request.prompt_token_ids), params, request.cache_salt)
        # NOTE: a cancelled or expired RPC aborts the request at once (blocks freed next step);
        # after a normal finish the abort is a no-op.
        context.add_callback(lambda: w.loop.abort(rid))
        for batch in events:
            tokens = [ev.token_id for ev in batch if ev.token_id is not None]
            if tokens:
                yield pb.WorkerGenerateResponse(token_ids=tokens, worker_id=w.worker_id)
            ev = batch[-1]
            if ev.token_id is not None:
                continue
            if ev.error:
                raise Unavailable(f"worker {w.worker_id}: {ev.error}")
            yield pb.WorkerGenerateResponse(
                finish_reason=FINISH_TO_PB[ev.finish_reason or "stop"], worker_id=w.worker_id,
                usage=usage_to_pb(Usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)))

    def Abort(self, request, context):
        return pb.AbortResponse(aborted=self.w.loop.abort(request.request_id))

    def GetLoad(self, request, context):
        w = self.w
        return pb.GetLoadResponse(worker_id=w.worker_id, load=load_to_pb(w.engine.stats().load), model_id=w.engine.model_id,
                                  block_size=w.engine.config.block_size,
                                  max_model_len=w.engine.config.max_model_len or 0)


class WorkerServer:
    """A worker process's parts: engine loop, kv_service publisher (optional), gRPC server.

    Args:
        engine: a loaded LLMEngine.
        worker_id: this worker's id in the index and in ``served_by``.
        kv_service: host:port of the kv_service, or None to run without one.
        advertise_address: host:port routers dial (default 127.0.0.1:<port>).
        stream_interval: tokens per stream message after the first (EngineLoop).
    """

    def __init__(self, engine: LLMEngine, worker_id: str, host: str = "0.0.0.0", port: int = 50061,
                 kv_service: str | None = None, advertise_address: str | None = None,
                 max_queued_requests: int = 1024, stream_interval: int = 1) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.max_queued_requests = max_queued_requests
        self.draining = False
        # NOTE: the sync server runs one thread per open stream; with fewer threads than
        # --max-queued-requests, the extra streams would wait inside gRPC, unseen by the scheduler
        # and by the load it reports. Pool threads start only when needed.
        self.grpc = GrpcServer(host, port, max_workers=max_queued_requests + 8)
        self.port = self.grpc.port
        self.address = advertise_address or f"127.0.0.1:{self.port}"
        model = engine.model_id
        self._labels = {"model_name": model}
        self.publisher: KVPublisher | None = None
        if kv_service:
            reg = registration(worker_id, self.address, model, engine.config.block_size, engine.config.hash_algorithm,
                               engine.kv_cache_manager.num_blocks)
            self.publisher = KVPublisher(kv_service, reg, engine.stats)
        self.loop = EngineLoop(engine, self.publisher, on_step=self._on_step, on_finish=self._on_finish,
                               on_token=self._on_token, stream_interval=stream_interval)
        if self.publisher is not None:
            self.publisher._wake_engine = self.loop.wake
        pb_grpc.add_WorkerServicer_to_server(WorkerServicer(self), self.grpc.server)
        self.grpc.add_service(pb.DESCRIPTOR.services_by_name["Worker"].full_name)
        self._prefix = (0, 0)

    def start(self, wait_registered: float = 0.0) -> WorkerServer:
        self.loop.start()
        self.grpc.start()
        if self.publisher is not None:
            self.publisher.start()
            if wait_registered and not self.publisher.wait_registered(wait_registered):
                log.warning("not registered with kv_service yet; serving anyway (routers with --workers can reach us)")
        self.grpc.set_serving(True)
        return self

    def stop(self, grace: float = 5.0) -> None:
        self.draining = True
        self.grpc.stop(grace)
        self.loop.stop()
        if self.publisher is not None:
            self.publisher.stop()

    # -- metrics -------------------------------------------------------------------------
    def _on_step(self, outputs, _elapsed: float) -> None:
        s = self.engine.stats()
        m = self._labels
        metrics.NUM_RUNNING.labels(**m).set(s.num_running)
        metrics.NUM_WAITING.labels(**m).set(s.num_waiting)
        metrics.KV_USAGE.labels(**m).set(1 - s.num_free_blocks / max(1, s.num_total_blocks))
        q0, h0 = self._prefix
        if s.prefix_cache_queries > q0:
            metrics.PREFIX_QUERIES.labels(**m).inc(s.prefix_cache_queries - q0)
        if s.prefix_cache_hits > h0:
            metrics.PREFIX_HITS.labels(**m).inc(s.prefix_cache_hits - h0)
        self._prefix = (s.prefix_cache_queries, s.prefix_cache_hits)

    def _on_token(self, stream: _Stream, now: float) -> None:
        m = self._labels
        metrics.GENERATION_TOKENS.labels(**m).inc()
        if stream.first_token is None:
            metrics.TTFT.labels(**m).observe(now - stream.arrival)
        elif stream.last_token is not None:
            metrics.ITL.labels(**m).observe(now - stream.last_token)

    def _on_finish(self, stream: _Stream, end: TokenEvent) -> None:
        m = self._labels
        metrics.E2E.labels(**m).observe((stream.last_token or stream.arrival) - stream.arrival)
        metrics.PROMPT_TOKENS.labels(**m).inc(end.prompt_tokens)
        metrics.REQUESTS.labels(finished_reason=end.finish_reason or "stop", **m).inc()


