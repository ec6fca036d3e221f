"""The model worker's gRPC server: a thin adapter over EngineLoop + KVPublisher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from concurrent.futures import Future

from kvmesh.contract.convert import (
    FINISH_TO_PB,
    kv_source_from_pb,
    kv_source_to_pb,
    load_to_pb,
    sampling_from_pb,
    usage_to_pb,
)
from kvmesh.contract.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvmesh.contract.kv_transfer import check_role
from kvmesh.contract.limits import (
    MAX_ADAPTER_NAME_CHARS,
    MAX_ADAPTER_PATH_CHARS,
    MAX_CACHE_SALT_CHARS,
    MAX_WORKER_REQUEST_ID_CHARS,
    check_id,
    check_length,
    excerpt,
)
from kvmesh.contract.types import AdapterLevel, Usage
from kvmesh.kv_client.publisher import KVPublisher, registration
from kvmesh.model_worker.engine.engine_loop import EngineLoop, Stream, TokenEvent
from kvmesh.model_worker.engine.kv_legs import DecodeLeg, KVLeg, PrefillLeg
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.engine.stats import EngineStats
from kvmesh.model_worker.engine.timeline import RequestTimeline
from kvmesh.model_worker.serving.kv_transfer import KVTransfers, Pulled
from kvmesh.model_worker.serving.metrics import WorkerMetrics
from kvmesh.transport import tracing
from kvmesh.transport.loop import LoopThread
from kvmesh.transport.server import AioServer
from kvmesh.transport.status import code_of
from kvmesh.v1 import worker_pb2 as pb
from kvmesh.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.worker")

GENERATE_RPC = tracing.rpc_attributes(pb.DESCRIPTOR.services_by_name["Worker"].full_name, "Generate")


def check_disaggregation(engine: LLMEngine) -> None:
    """Raises ValueError unless the engine can hand over or take in a prompt's KV: prefix caching on
    (blocks travel under their hashes), one full-attention KV cache group (kv_holds.py)."""
    if not engine.config.enable_prefix_caching:
        raise ValueError("a prefill or decode worker needs prefix caching (KV blocks travel under their hashes): "
                         "drop --no-prefix-caching, or run --role both")
    if not engine.kv_cache_manager.kv_cache_config.full_attention_only:
        raise ValueError("prefill/decode disaggregation needs full attention in every layer (sliding-window "
                         "blocks are not all kept); run this model with --role both")

DEFAULT_MAX_QUEUED_REQUESTS = 1024
"""Streams one worker accepts at once (``--max-queued-requests``); each is a coroutine."""


def record_timeline(span, timeline: RequestTimeline, ended: str) -> None:
    """A traced request's engine timeline as the children of its ``worker.generate`` span: the wait in the
    queue, each prefill chunk, the first token, each decode window, the finish (docs/tracing.md)."""
    parent = tracing.context_of(span)
    t = timeline
    if t.scheduled_ns is not None:
        tracing.record("worker.queue", t.arrival_ns, t.scheduled_ns, parent)
    for i, (a, b, n) in enumerate(t.prefill):
        tracing.record("worker.prefill", a, b, parent, {"kvmesh.chunk": i, "kvmesh.tokens": n})
    if t.first_token_ns is not None:
        tracing.record("worker.first_token", t.first_token_ns, t.first_token_ns, parent)
    for a, b, n in t.decode:
        tracing.record("worker.decode", a, b, parent, {"kvmesh.tokens": n})
    end = t.finished_ns or tracing.now_ns()
    tracing.record("worker.finish", end, end, parent, {"kvmesh.outcome": ended})
    span.set_attribute("kvmesh.outcome", ended)
    span.end(end_time=max(end, span.start_time))


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, worker: WorkerServer) -> None:
        self.w = worker

    def _adapter(self, name: str) -> str | None:
        """The LoRA adapter a request names (None: the base model); NOT_FOUND unless this worker serves it."""
        if not name:
            return None
        check_length("adapter", name, MAX_ADAPTER_NAME_CHARS)
        lora = self.w.engine.lora
        if lora is None or not lora.has(name):
            raise NotFound(f"worker {self.w.worker_id} serves no LoRA adapter {excerpt(name)}"
                           + ("" if lora is not None else " (it runs without --enable-lora)"))
        return name

    async def Generate(self, request, context):
        w = self.w
        if w.draining:
            raise Unavailable(f"worker {w.worker_id} is shutting down; retry on another worker")
        if w.loop.num_streams >= w.max_queued_requests:
            raise ResourceExhausted(
                f"worker {w.worker_id} has {w.max_queued_requests} requests in flight (--max-queued-requests); "
                "retry later or on another worker")
        params = sampling_from_pb(request.sampling)
        check_id("request_id", request.request_id, MAX_WORKER_REQUEST_ID_CHARS, allow_empty=True)
        check_length("cache_salt", request.cache_salt, MAX_CACHE_SALT_CHARS)
        adapter = self._adapter(request.adapter)
        rid = request.request_id or uuid.uuid4().hex
        kvt = request.kv_transfer if request.HasField("kv_transfer") else None
        prompt = list(request.prompt_token_ids)
        leg: KVLeg | None = None
        pulled: Pulled | None = None
        if kvt is not None and kvt.do_remote_decode:
            # NOTE: a prefill leg: the prompt's blocks are held for a decode worker when it ends.
            w.kv.check_prefill_leg(params.max_tokens)
            leg = PrefillLeg(w.kv.hold_ttl_s, held=Future())
        elif kvt is not None and kvt.HasField("source"):
            # NOTE: a decode leg: everything is checked before any KV moves; a pull that fails leaves
            # the request to prefill here.
            source = kv_source_from_pb(kvt.source)
            w.engine.check_request(prompt, params)
            w.kv.check_decode_leg(rid, prompt, request.cache_salt, source)
            pulled = await w.kv.pull(rid, source)
            if pulled.kv_import is not None:
                leg = DecodeLeg(pulled.kv_import)
        span = timeline = None
        if tracing.ON:
            span = tracing.start("worker.generate", tracing.extract(context.invocation_metadata()),
                                 {**GENERATE_RPC, "kvmesh.request_id": rid, "kvmesh.worker_id": w.worker_id},
                                 kind="server")
            timeline = RequestTimeline(span.start_time, len(prompt))
        try:
            stream = w.loop.submit_async(rid, prompt, params, request.cache_salt, timeline, leg, adapter)
        except BaseException as exc:
            tracing.end_rpc(span, code_of(exc), exc)
            raise
        ended = "cancelled"  # the caller went away (or its deadline passed) unless set below
        first: int | None = None
        try:
            while True:
                batch = await stream.next_batch()
                tokens = [ev.token_id for ev in batch if ev.token_id is not None]
                if tokens and first is None:
                    first = tokens[0]
                if tokens:
                    yield pb.WorkerGenerateResponse(token_ids=tokens, worker_id=w.worker_id)
                ev = batch[-1]
                if ev.token_id is not None:
                    continue
                ended = f"{ev.finish_reason or 'stop'}, prompt {ev.prompt_tokens} cached {ev.cached_tokens} " \
                        f"completion {ev.completion_tokens} tokens"
                if ev.error:
                    ended = f"failed: {ev.error}"
                    raise Unavailable(f"worker {w.worker_id}: {ev.error}")
                last = pb.WorkerGenerateResponse(
                    finish_reason=FINISH_TO_PB[ev.finish_reason or "stop"], worker_id=w.worker_id,
                    usage=usage_to_pb(Usage(ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)))
                if isinstance(leg, PrefillLeg) and leg.held is not None and ev.finish_reason != "abort":
                    # NOTE: resolved on the step thread before the last event was delivered: no wait here.
                    held = await asyncio.wrap_future(leg.held)
                    last.kv_source.CopyFrom(kv_source_to_pb(w.kv.source_for(rid, held, first)))
                    ended += f", {len(last.kv_source.block_hashes)} KV blocks held"
                if pulled is not None:
                    last.kv_transport, last.kv_blocks_pulled, last.kv_bytes_pulled, last.kv_pull_seconds = (
                        pulled.transport, pulled.blocks, pulled.bytes, pulled.seconds)
                    ended += f", KV {pulled.transport} ({pulled.blocks} blocks pulled, {pulled.skipped} held here)"
                tracing.end_rpc(span, tracing.GRPC_OK, end=False)
                yield last
                return
        except BaseException as exc:
            tracing.end_rpc(span, code_of(exc), exc, end=False)
            raise
        finally:
            # NOTE: one line per request at the default level, under the id the router logged.
            log.info("request %s: %s", rid, ended)
            # NOTE: a cancelled or expired RPC (CancelledError here) aborts the request at once
            # (blocks freed next step); after a normal finish the abort is a no-op.
            w.loop.abort(rid)
            if span is not None:
                record_timeline(span, timeline, ended)

    async def Abort(self, request, context):
        check_length("request_id", request.request_id, MAX_WORKER_REQUEST_ID_CHARS)
        aborted = self.w.loop.abort(request.request_id)
        if aborted:
            log.info("request %s: abort asked", request.request_id)
        return pb.AbortResponse(aborted=aborted)

    async def LoadAdapter(self, request, context):
        name = request.name
        if not name or len(name) > MAX_ADAPTER_NAME_CHARS or not name.isprintable():
            raise InvalidArgument(f"name must be 1-{MAX_ADAPTER_NAME_CHARS} printable characters")
        check_length("path", request.path, MAX_ADAPTER_PATH_CHARS)
        lora = self._lora()
        if lora.has(name):
            raise AlreadyExists(f"LoRA adapter {excerpt(name)} is already loaded on worker {self.w.worker_id}")
        try:
            # NOTE: reads and checks the adapter's files: off the server's loop
            await asyncio.to_thread(self.w.engine.load_adapter, name, request.path)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        log.info("LoRA adapter %s loaded from %s", name, request.path)
        self._report_now()
        return pb.LoadAdapterResponse()

    async def UnloadAdapter(self, request, context):
        check_length("name", request.name, MAX_ADAPTER_NAME_CHARS)
        lora = self._lora()
        if not lora.has(request.name):
            raise NotFound(f"no LoRA adapter {excerpt(request.name)} is loaded on worker {self.w.worker_id}")
        try:
            self.w.engine.unload_adapter(request.name)
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None
        log.info("LoRA adapter %s unloaded", request.name)
        self._report_now()
        return pb.UnloadAdapterResponse()

    def _lora(self):
        lora = self.w.engine.lora
        if lora is None:
            raise FailedPrecondition(f"worker {self.w.worker_id} serves no LoRA adapters (start it with "
                                     "--enable-lora)")
        return lora

    def _report_now(self) -> None:
        """The adapters changed: a load report goes out now, not at the next heartbeat."""
        if self.w.publisher is not None:
            self.w.publisher.heartbeat_now()

    async def GetLoad(self, request, context):
        w = self.w
        return pb.GetLoadResponse(worker_id=w.worker_id, load=load_to_pb(w.engine.stats().load), model_id=w.engine.model_id,
                                  block_size=w.engine.config.block_size,
                                  max_model_len=w.engine.config.max_model_len or 0, role=w.role)

    async def PullKV(self, request, context):
        check_length("request_id", request.request_id, MAX_WORKER_REQUEST_ID_CHARS)
        # NOTE: closed at once when the puller goes away: the stream's read of the hold ends with it.
        async with contextlib.aclosing(self.w.kv.serve_pull(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def ReleaseKV(self, request, context):
        check_length("request_id", request.request_id, MAX_WORKER_REQUEST_ID_CHARS)
        return pb.ReleaseKVResponse(released=await self.w.kv.release(request.request_id))


class WorkerServer:
    """A worker process's parts: engine loop (its own thread), kv_service publisher (optional),
    grpc.aio server (its own event loop).

    Args:
        engine: a loaded LLMEngine.
        worker_id: this worker's id in the index and in ``served_by``.
        kv_service: host:port of the kv_service, or None to run without one.
        advertise_address: host:port routers dial (default 127.0.0.1:<port>).
        max_queued_requests: streams accepted at once; one more gets RESOURCE_EXHAUSTED.
        stream_interval: tokens per stream message after the first (EngineLoop).
        role: prefill, decode or both (prefill/decode disaggregation, kv_transfer.py).
        kv_transport: auto (NIXL when it loads, else gRPC streaming), nixl or grpc.
        kv_hold_ttl_s: seconds a prefill leg's blocks are held for a decode worker at most.
    """

    def __init__(self, engine: LLMEngine, worker_id: str, host: str = "0.0.0.0", port: int = 50061,
                 kv_service: str | None = None, advertise_address: str | None = None,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, stream_interval: int = 1,
                 role: str = "both", kv_transport: str = "auto", kv_hold_ttl_s: float = 30.0) -> None:
        self.role = check_role(role)
        if self.role != "both":
            check_disaggregation(engine)
        self.engine = engine
        self.worker_id = worker_id
        self.max_queued_requests = max_queued_requests
        self.draining = False
        self._stopping = threading.Lock()
        self.metrics = WorkerMetrics()
        self._aio = LoopThread("worker-grpc")
        self.grpc: AioServer = self._aio.run(self._build(host, port))
        self.port = self.grpc.port
        self.address = advertise_address or f"127.0.0.1:{self.port}"
        model = engine.model_id
        self._labels = {"model_name": model}
        # NOTE: the per-token series resolved once, not a label lookup per token.
        self._tokens = self.metrics.generation_tokens.labels(model)
        self._ttft = self.metrics.ttft.labels(model)
        self._itl = self.metrics.itl.labels(model)
        self.publisher: KVPublisher | None = None
        if kv_service:
            reg = registration(worker_id, self.address, model, engine.config.block_size, engine.config.hash_algorithm,
                               engine.kv_cache_manager.num_blocks, host_blocks=engine.kv_cache_manager.num_host_blocks,
                               role=self.role)
            self.publisher = KVPublisher(kv_service, reg, engine.report_load, ack_admitted=engine.ack_admitted)
        self.loop = EngineLoop(engine, self.publisher, on_step=self._on_step, on_finish=self._on_finish,
                               on_token=self._on_token, stream_interval=stream_interval)
        if self.publisher is not None:
            self.publisher.wake_engine = self.loop.wake
        self.kv = KVTransfers(self.loop, worker_id, self.address, self.metrics, self.role, kv_transport, kv_hold_ttl_s)
        self._prefix = (0, 0, 0)
        self._adapter_series: set[tuple[str, str]] = set()
        self._adapters_busy: str | None = None

    async def _build(self, host: str, port: int) -> AioServer:
        server = AioServer(host, port)
        pb_grpc.add_WorkerServicer_to_server(WorkerServicer(self), server.server)
        server.add_service(pb.DESCRIPTOR.services_by_name["Worker"].full_name)
        return server

    def start(self, wait_registered: float = 0.0) -> WorkerServer:
        self.loop.start()
        self._aio.run(self.grpc.start())
        if self.publisher is not None:
            self.publisher.start()
            if wait_registered and not self.publisher.wait_registered(wait_registered):
                log.warning("not registered with kv_service yet; serving anyway (routers with --workers can reach us)")
        self._aio.run(self.grpc.set_serving(True))
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Refuses new requests, lets open streams finish for up to ``grace`` seconds, then stops; a call
        while another stops waits for it and does nothing more."""
        with self._stopping:
            if not self._aio.running:
                return
            self.draining = True
            if self.publisher is not None:
                # NOTE: out of every router's and picker's live set first (a push, not at lease expiry),
                # then what is in flight finishes; past the grace its streams end UNAVAILABLE and the
                # routers migrate them (docs/router.md, "Workers that leave").
                self.publisher.leave()
            self._aio.run(self.grpc.stop(grace))
            self._aio.run(self.kv.close())
            self._aio.stop()
            self.loop.stop()
            if self.publisher is not None:
                self.publisher.stop()

    # -- metrics (called on the engine thread) --------------------------------------------
    def _on_step(self, outputs, _elapsed: float) -> None:
        s = self.engine.stats()
        m, wm = self._labels, self.metrics
        wm.num_running.labels(**m).set(s.num_running)
        wm.num_waiting.labels(**m).set(s.num_waiting)
        wm.kv_usage.labels(**m).set(1 - s.num_free_blocks / max(1, s.num_total_blocks))
        q0, h0, host0 = self._prefix
        if s.prefix_cache_queries > q0:
            wm.prefix_queries.labels(**m).inc(s.prefix_cache_queries - q0)
        if s.prefix_cache_hits > h0:
            wm.prefix_hits.labels(**m).inc(s.prefix_cache_hits - h0)
        if s.num_host_blocks:
            wm.host_kv_usage.labels(**m).set(s.num_host_cached_blocks / s.num_host_blocks)
            if s.host_cache_hits > host0:
                wm.host_hits.labels(**m).inc(s.host_cache_hits - host0)
        self._prefix = (s.prefix_cache_queries, s.prefix_cache_hits, s.host_cache_hits)
        wm.kv_held_requests.labels(**m).set(self.engine.kv_connector.num_held)
        if s.max_loras:
            self._adapter_metrics(s)

    def _adapter_metrics(self, s: EngineStats) -> None:
        """The adapters' residency series (model_worker/serving/metrics.py): a series per adapter and level
        while it is there, removed when it leaves."""
        m, wm = self._labels, self.metrics
        levels = {AdapterLevel.GPU: "gpu", AdapterLevel.CPU: "cpu"}
        now = {(a.name, levels[a.level]) for a in s.adapters if a.level in levels}
        for name, level in self._adapter_series - now:
            wm.lora_loaded.remove(m["model_name"], name, level)
        for name, level in now - self._adapter_series:
            wm.lora_loaded.labels(adapter_name=name, level=level, **m).set(1)
        self._adapter_series = now
        wm.lora_gpu.labels(**m).set(sum(level == "gpu" for _, level in now))
        wm.lora_cpu.labels(**m).set(sum(level == "cpu" for _, level in now))
        wm.lora_max_gpu.labels(**m).set(s.max_loras)
        busy = ",".join(a.name for a in s.adapters if a.requests)
        if busy != self._adapters_busy:
            self._adapters_busy = busy
            wm.lora_info.labels(max_lora=str(s.max_loras), running_lora_adapters=busy,
                                waiting_lora_adapters=busy).set_to_current_time()

    def _on_token(self, stream: Stream, now: float) -> None:
        self._tokens.inc()
        if stream.first_token is None:
            self._ttft.observe(now - stream.arrival)
        elif stream.last_token is not None:
            self._itl.observe(now - stream.last_token)

    def _on_finish(self, stream: Stream, end: TokenEvent) -> None:
        m, wm = self._labels, self.metrics
        wm.e2e.labels(**m).observe((stream.last_token or stream.arrival) - stream.arrival)
        wm.prompt_tokens.labels(**m).inc(end.prompt_tokens)
        wm.requests.labels(finished_reason=end.finish_reason or "stop", **m).inc()

