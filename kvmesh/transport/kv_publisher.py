"""Keeps the kv_service's view of a worker true: registration, heartbeats, block events.

Shared by every kind of worker: kvmesh's own (model_worker/server.py: the engine loop is the event
source) and the bridges in front of other engines (bridge/: vLLM's or SGLang's KV events, re-hashed).

- On start: register (a new epoch) and publish all-cleared as seq 1.
- Every engine step: the step's events, queued for a PublishEvents stream. A batch (epoch, seq+1)
  goes out at most every ``BATCH_INTERVAL_S`` and carries every step's events queued meanwhile, in
  order: a busy worker steps hundreds of times a second, and one message (one Redis script) per
  step would load the kv_service for nothing; the index trails the engine by that interval.
- RESYNC, a broken stream or a lost registration: (re-register if needed, then) ask the engine
  loop for a snapshot of the cached blocks and send it as the next batch.
- Every message carries the engine's load as it is sent, and when the load changed but no events
  are queued, a message with the load alone goes out (at the same pace): routers see a worker's
  queue through Lookup as fresh as the event stream, not a heartbeat old (several routers, each
  blind to the others' in-flight requests, would otherwise herd onto one worker).
- Heartbeat every lease/3 with the engine's load; NOT_FOUND means the lease expired: register
  again (the index dropped our blocks), then snapshot. An answer with ``resync`` (an operator
  flushed our blocks from the index) asks for a snapshot too.
The kv_service being down never blocks the engine: batches queue up to a bound, then collapse
into "snapshot when it is back".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from kvmesh.contract.convert import algorithm_to_pb, event_to_pb, load_to_pb
from kvmesh.contract.types import KVCacheEvent, Load
from kvmesh.transport.rpc import dial
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.worker.publisher")

MAX_QUEUED_BATCHES = 1024
BATCH_INTERVAL_S = 0.02
_NOTHING = object()
RPC_TIMEOUT_S = 5.0


class KVPublisher:
    """Args:
    target: kv_service host:port.
    registration: the RegisterWorkerRequest fields except epoch.
    load: returns the worker's current load (thread-safe).
    wake_engine: makes an idle event source run once (to take a snapshot).
    """

    def __init__(self, target: str, registration: pb.RegisterWorkerRequest,
                 load: Callable[[], Load], wake_engine: Callable[[], None] = lambda: None) -> None:
        self.target = target
        self._reg = registration
        self._load = load
        self._wake_engine = wake_engine
        self._stub = pb_grpc.KVServiceStub(dial(target))
        self.epoch = time.time_ns() // 1000  # microseconds: < 2**53, new on every start
        self.lease_ttl_s = 10.0
        self.batch_interval_s = BATCH_INTERVAL_S
        self._seq = 0
        self._out: queue.Queue[pb.PublishEventsRequest | None] = queue.Queue()
        self._need_snapshot = threading.Event()
        self._registered = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()
        self.resyncs = 0
        self._threads = [threading.Thread(target=self._stream_loop, name="kv-publish", daemon=True),
                         threading.Thread(target=self._heartbeat_loop, name="kv-heartbeat", daemon=True)]

    # -- engine-loop side (EventSink) ----------------------------------------------------
    def publish(self, events: list[KVCacheEvent]) -> None:
        if self._need_snapshot.is_set():
            return  # the coming snapshot supersedes these
        if self._out.qsize() >= MAX_QUEUED_BATCHES:
            log.warning("kv_service is not keeping up; dropping queued events for a snapshot")
            self._request_snapshot()
            return
        self._enqueue(pb.PublishEventsRequest(events=[event_to_pb(e) for e in events]))

    def wants_snapshot(self) -> bool:
        return self._need_snapshot.is_set() and self._registered.is_set()

    def request_snapshot(self) -> None:
        """The source's state may differ from what was published (events were lost upstream): the
        queued batches go and the next thing sent is a snapshot (``wants_snapshot``)."""
        self._request_snapshot()

    def publish_snapshot(self, hashes: list[bytes]) -> None:
        self._need_snapshot.clear()
        self._drain()
        self._enqueue(pb.PublishEventsRequest(snapshot=True, snapshot_hashes=hashes))

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> KVPublisher:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._out.put(None)
        for t in self._threads:
            t.join(2.0)

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    # -- internals -----------------------------------------------------------------------
    def _enqueue(self, req: pb.PublishEventsRequest) -> None:
        with self._lock:
            self._out.put(req)

    def _drain(self) -> None:
        try:
            while True:
                if self._out.get_nowait() is None:
                    self._out.put(None)
                    return
        except queue.Empty:
            pass

    def _new_stream_queue(self, head: pb.PublishEventsRequest | None = None) -> queue.Queue:
        """A fresh queue for the next stream. With ``head`` (the first stream of a registration: its
        all-cleared), the batches queued before it follow it: events of a source that ran before
        the kv_service answered are not lost."""
        # NOTE: one queue per stream: a dead stream's request iterator can never take (and
        # lose) a batch meant for the next stream.
        fresh: queue.Queue[pb.PublishEventsRequest | None] = queue.Queue()
        with self._lock:
            old, self._out = self._out, fresh
            if head is not None:
                fresh.put(head)
                while True:
                    try:
                        item = old.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        fresh.put(item)
        old.put(None)
        return fresh

    def _request_snapshot(self) -> None:
        self._need_snapshot.set()
        self._drain()
        self._wake_engine()

    def _register(self) -> None:
        """Registers (retrying with backoff until it works or we stop)."""
        with self._register_lock:
            if not self._registered.is_set():
                self._register_locked()

    def _register_locked(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            req = pb.RegisterWorkerRequest()
            req.CopyFrom(self._reg)
            req.epoch = self.epoch
            try:
                resp = self._stub.RegisterWorker(req, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                    log.error("kv_service refused registration: %s", err.details())
                else:
                    log.warning("cannot register with kv_service %s: %s", self.target, err.code().name)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            with self._lock:
                self._seq = 0
            self.lease_ttl_s = resp.lease_ttl_ms / 1000
            self._registered.set()
            log.info("registered %s with kv_service %s (epoch %d)", self._reg.worker_id, self.target, self.epoch)
            return

    def _requests(self, q: queue.Queue) -> Iterator[pb.PublishEventsRequest]:
        """The stream's batches: queued step batches merged (up to a snapshot), numbered as sent."""
        held: object = _NOTHING
        last_sent = 0.0
        sent_state: tuple[int, ...] | None = None
        while True:
            if held is _NOTHING:
                try:
                    item = q.get(timeout=self.batch_interval_s)
                except queue.Empty:
                    if self._need_snapshot.is_set() or self._load().queue_state() == sent_state:
                        continue
                    item = pb.PublishEventsRequest()  # the load alone (attached below)
            else:
                item = held
            held = _NOTHING
            if item is None or self._stop.is_set():
                return
            if not item.snapshot:
                wait = last_sent + self.batch_interval_s - time.monotonic()
                if wait > 0:
                    self._stop.wait(wait)
                while True:
                    try:
                        more = q.get_nowait()
                    except queue.Empty:
                        break
                    if more is None or more.snapshot:
                        held = more  # NOTE: a snapshot replaces all before it: never merged
                        break
                    item.events.extend(more.events)
            load = self._load()
            item.load.CopyFrom(load_to_pb(load))
            sent_state = load.queue_state()
            with self._lock:
                self._seq += 1
                item.worker_id, item.epoch, item.seq = self._reg.worker_id, self.epoch, self._seq
            last_sent = time.monotonic()
            yield item

    def _stream_loop(self) -> None:
        self._register()
        first = True
        while not self._stop.is_set():
            if first:
                # NOTE: seq 1 of a new registration: the index starts empty for this epoch.
                q = self._new_stream_queue(pb.PublishEventsRequest(
                    events=[pb.KVEvent(all_cleared=pb.AllBlocksCleared())]))
                first = False
            else:
                q = self._new_stream_queue()
                # Whatever was in flight on the old stream may be lost: a snapshot makes it true.
                self._request_snapshot()
            try:
                for ack in self._stub.PublishEvents(self._requests(q)):
                    if ack.action == pb.PUBLISH_ACTION_RESYNC:
                        self.resyncs += 1
                        log.info("kv_service asked for a resync: %s", ack.reason)
                        self._request_snapshot()
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                code = err.code()
                log.warning("event stream to kv_service ended: %s %s", code.name, err.details())
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    self._registered.clear()
                    self._register()
                else:
                    # NOTE: a full replica (RESOURCE_EXHAUSTED) frees a slot only when a worker leaves.
                    self._stop.wait(5.0 if code == grpc.StatusCode.RESOURCE_EXHAUSTED else 0.5)
                continue
            return

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            if not self._registered.wait(0.2):
                continue
            try:
                resp = self._stub.Heartbeat(pb.HeartbeatRequest(worker_id=self._reg.worker_id, epoch=self.epoch,
                                                                load=load_to_pb(self._load())), timeout=RPC_TIMEOUT_S)
                self.lease_ttl_s = resp.lease_ttl_ms / 1000
                if resp.resync and not self._need_snapshot.is_set():
                    # NOTE: the index dropped our blocks (FlushWorker): a snapshot makes it hold
                    # exactly our cache again, idle or not.
                    log.info("kv_service flushed this worker's blocks; sending a snapshot")
                    self.resyncs += 1
                    self._request_snapshot()
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    log.warning("lease lost (%s); registering again", err.details())
                    self._registered.clear()
                    self._register()
                    self._request_snapshot()
                    continue
                log.debug("heartbeat failed: %s", err.code().name)
            self._stop.wait(max(0.05, self.lease_ttl_s / 3))


def registration(worker_id: str, address: str, model_id: str, block_size: int, hash_algorithm: str,
                 num_blocks: int, engine: str = "kvmesh") -> pb.RegisterWorkerRequest:
    """What a worker registers: ``address`` is host:port for kvmesh's gRPC Worker, or an
    http(s):// base URL for an engine served over the OpenAI API (``engine`` "vllm", "sglang")."""
    return pb.RegisterWorkerRequest(worker_id=worker_id, address=address, model_id=model_id, block_size=block_size,
                                    hash_algorithm=algorithm_to_pb(hash_algorithm), num_blocks=num_blocks,
                                    engine=engine)
