"""Keeps the kv_service's view of a worker true: registration, heartbeats, block events.

Shared by every kind of worker: kvmesh's own (model_worker/serving/server.py: the engine loop is the event
source) and the bridges in front of other engines (bridge/: vLLM's or SGLang's KV events, re-hashed).
What a message carries and when it may go is kvmesh/kv_client/event_batcher.py's (the simulator
drives the same core); this adapter adds the threads, the gRPC calls and the error policy:

- On start: register (a new epoch); the first message of the stream is all-cleared.
- Every step's events go to the batcher; the stream thread sends its messages (merged events at
  most every ``interval_s``, or the load alone when it changed), numbered as sent.
- RESYNC, a broken stream or a lost registration: (re-register if needed, then) ask the event
  source for a snapshot of the cached blocks and send it as the next message.
- Heartbeat every lease/3 with the load; NOT_FOUND means the lease expired: register again (the
  index dropped our blocks), then snapshot. An answer with ``resync`` (an operator flushed our
  blocks from the index) asks for a snapshot too.
The kv_service being down never blocks the engine: batches queue up to a bound, then collapse
into "snapshot when it is back".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc

from kvmesh.contract.convert import event_to_pb, load_to_pb, registration_to_pb
from kvmesh.contract.index_protocol import Registration
from kvmesh.contract.types import KVCacheEvent, Load
from kvmesh.kv_client.event_batcher import EventBatcher, Message
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.worker.publisher")

RPC_TIMEOUT_S = 5.0


class KVPublisher:
    """Args:
    target: kv_service host:port.
    registration: what the worker registers; the publisher sets the epoch (new on every start).
    load: returns the worker's current load (thread-safe).
    wake_engine: makes an idle event source run once (to take a snapshot).
    ack_admitted: told the admissions a report listed once the kv_service applied it (the
        engine's ``ack_admitted``: later reports leave them out).
    """

    def __init__(self, target: str, registration: Registration,
                 load: Callable[[], Load], wake_engine: Callable[[], None] = lambda: None,
                 ack_admitted: Callable[[tuple[str, ...]], None] = lambda _ids: None) -> None:
        self.target = target
        self._reg = registration
        self._load = load
        self.wake_engine = wake_engine
        """Makes an idle event source run once; may be set after construction (the engine loop is
        built with the publisher)."""
        self._ack_admitted = ack_admitted
        self._unacked: dict[int, tuple[str, ...]] = {}
        """seq -> the admissions its message listed, until the kv_service answers it."""
        self._stub = pb_grpc.KVServiceStub(dial(target))
        self.epoch = time.time_ns() // 1000  # microseconds: < 2**53, new on every start
        self.lease_ttl_s = 10.0
        self.batcher = EventBatcher()
        self._snapshot: tuple[list[bytes], list[bytes]] | None = None
        """The snapshot the event source took (device, host tier), to go out next."""
        self._stream_gen = 0
        """The live stream's number: a dead stream's request iterator ends instead of taking a
        message meant for the next one."""
        self._cond = threading.Condition()
        self._registered = threading.Event()
        self._stop = threading.Event()
        self._beat = threading.Event()
        """Set: the next heartbeat goes out now (``heartbeat_now``)."""
        self._register_lock = threading.Lock()
        self._heartbeat_lock = threading.Lock()
        self._left = False
        """Left the live set (``leave``): never registers again."""
        self.resyncs = 0
        self._threads = [threading.Thread(target=self._stream_loop, name="kv-publish", daemon=True),
                         threading.Thread(target=self._heartbeat_loop, name="kv-heartbeat", daemon=True)]

    # -- event-source side (EventSink) -----------------------------------------------------
    def publish(self, events: list[KVCacheEvent]) -> None:
        with self._cond:
            owed = self.batcher.need_snapshot
            if not self.batcher.add(events) and not owed:
                log.warning("kv_service is not keeping up; dropping queued events for a snapshot")
                self.wake_engine()
            self._cond.notify_all()

    def wants_snapshot(self) -> bool:
        return self.batcher.need_snapshot and self._snapshot is None and self._registered.is_set()

    def request_snapshot(self) -> None:
        """The source's state may differ from what was published (events were lost upstream): the
        queued batches go and the next thing sent is a snapshot (``wants_snapshot``)."""
        with self._cond:
            self.batcher.resync()
            self._snapshot = None
            self._cond.notify_all()
        self.wake_engine()

    def publish_snapshot(self, hashes: list[bytes], host_hashes: list[bytes] | None = None) -> None:
        """The event source's whole cache: its device blocks and its host tier's (each oldest first)."""
        with self._cond:
            self._snapshot = (hashes, host_hashes or [])
            self._cond.notify_all()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> KVPublisher:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._beat.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(2.0)

    def leave(self, timeout: float = RPC_TIMEOUT_S) -> bool:
        """Draining: out of the live set now, for every router and picker (LeaveWorker), then stopped: no
        heartbeat renews the lease, nothing registers again, no event goes out (the reaper takes the
        blocks). False: the kv_service did not take it (the lease then ends on its own)."""
        with self._heartbeat_lock:  # NOTE: a heartbeat in flight would renew the lease after the leave
            self._left = True
        left = False
        if self._registered.is_set():
            try:
                left = self._stub.LeaveWorker(pb.LeaveWorkerRequest(
                    worker_id=self._reg.worker_id, epoch=self.epoch, reason=pb.LEAVE_REASON_DRAINING,
                    reporter=self._reg.worker_id), timeout=timeout).left
            except grpc.RpcError as err:
                log.warning("could not leave the live set at kv_service %s: %s; its lease ends in %.0fs",
                            self.target, err.code().name, self.lease_ttl_s)
        self.stop()
        return left

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    # -- internals -----------------------------------------------------------------------
    def _register(self) -> None:
        """Registers (retrying with backoff until it works or we stop)."""
        with self._register_lock:
            if not self._registered.is_set():
                self._register_locked()

    def _register_locked(self) -> None:
        delay = 0.1
        while not self._stop.is_set() and not self._left:
            req = registration_to_pb(replace(self._reg, epoch=self.epoch))
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
            with self._cond:
                self.batcher.restart_numbering()
            self.lease_ttl_s = resp.lease_ttl_ms / 1000
            self._registered.set()
            log.info("registered %s with kv_service %s (epoch %d)", self._reg.worker_id, self.target, self.epoch)
            return

    def _next(self, gen: int) -> Message | None:
        """The stream's next message, when it may go; None when the stream is over."""
        with self._cond:
            while True:
                if self._stop.is_set() or gen != self._stream_gen:
                    return None
                now = time.monotonic()
                if self._snapshot is not None:
                    (hashes, host), self._snapshot = self._snapshot, None
                    return self.batcher.take_snapshot(now, hashes, self._load(), host)
                due = self.batcher.next_due()
                if now < due:
                    self._cond.wait(due - now)
                    continue
                msg = self.batcher.take(now, self._load())
                if msg is not None:
                    return msg
                # NOTE: nothing to send: look again after a slot (events wake it sooner).
                self._cond.wait(self.batcher.interval_s)

    def _requests(self, gen: int) -> Iterator[pb.PublishEventsRequest]:
        while (msg := self._next(gen)) is not None:
            # NOTE: stream_bound: this process's liveness follows the stream (the kv_service takes the
            # worker out when it ends and no next one opens: a SIGKILL is seen at once).
            req = pb.PublishEventsRequest(worker_id=self._reg.worker_id, epoch=self.epoch, seq=msg.seq,
                                          events=[event_to_pb(e) for e in msg.events], stream_bound=True)
            if msg.snapshot is not None:
                req.snapshot = True
                req.snapshot_hashes.extend(msg.snapshot)
                req.snapshot_host_hashes.extend(msg.host_snapshot)
            if msg.load is not None:
                req.load.CopyFrom(load_to_pb(msg.load))
                if msg.load.admitted:
                    self._unacked[msg.seq] = msg.load.admitted
            yield req

    def _stream_loop(self) -> None:
        self._register()
        first = True
        while not self._stop.is_set():
            with self._cond:
                self._stream_gen += 1
                gen = self._stream_gen
                if first:
                    # NOTE: seq 1 of a new registration: the index starts empty for this epoch.
                    self.batcher.register()
                self._cond.notify_all()
            if not first:
                # Whatever was in flight on the old stream may be lost: a snapshot makes it true.
                self.request_snapshot()
            first = False
            self._unacked.clear()  # NOTE: a dead stream's are listed again (they were never acknowledged)
            try:
                for ack in self._stub.PublishEvents(self._requests(gen)):
                    admitted = self._unacked.pop(ack.seq, None)
                    if admitted and ack.action == pb.PUBLISH_ACTION_ACK:
                        self._ack_admitted(admitted)
                    if ack.action == pb.PUBLISH_ACTION_RESYNC:
                        self.resyncs += 1
                        log.info("kv_service asked for a resync: %s", ack.reason)
                        self.request_snapshot()
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
                load = self._load()
                with self._heartbeat_lock:
                    if self._left:
                        return
                    resp = self._stub.Heartbeat(pb.HeartbeatRequest(worker_id=self._reg.worker_id, epoch=self.epoch,
                                                                    load=load_to_pb(load)), timeout=RPC_TIMEOUT_S)
                if load.admitted:
                    self._ack_admitted(load.admitted)
                self.lease_ttl_s = resp.lease_ttl_ms / 1000
                if resp.resync and not self.batcher.need_snapshot:
                    # NOTE: the index dropped our blocks (FlushWorker): a snapshot makes it hold
                    # exactly our cache again, idle or not.
                    log.info("kv_service flushed this worker's blocks; sending a snapshot")
                    self.resyncs += 1
                    self.request_snapshot()
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    log.warning("lease lost (%s); registering again", err.details())
                    self._registered.clear()
                    self._register()
                    self.request_snapshot()
                    continue
                log.debug("heartbeat failed: %s", err.code().name)
            self._beat.wait(max(0.05, self.lease_ttl_s / 3))
            self._beat.clear()

    def heartbeat_now(self) -> None:
        """Sends a load report now (what routing reads changed outside the queues: e.g. an adapter loaded)."""
        self._beat.set()


def registration(worker_id: str, address: str, model_id: str, block_size: int, hash_algorithm: str,
                 num_blocks: int, engine: str = "kvmesh", host_blocks: int = 0, role: str = "both") -> Registration:
    """What a worker registers: ``address`` is host:port for kvmesh's gRPC Worker, or an
    http(s):// base URL for an engine served over the OpenAI API (``engine`` "vllm", "sglang");
    ``host_blocks`` its host KV tier's blocks (0: none, or not known). The epoch is the publisher's
    (0 until it registers)."""
    return Registration(worker_id, address, model_id, block_size, hash_algorithm, num_blocks, 0, engine, host_blocks,
                        role)
