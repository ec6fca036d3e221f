"""gRPC adapter of the kv_service: protobuf in, KVService calls, protobuf out."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from kvmesh.contract.convert import (
    algorithm_from_pb,
    algorithm_to_pb,
    events_from_pb,
    load_from_pb,
    load_to_pb,
)
from kvmesh.contract.errors import InvalidArgument, ResourceExhausted
from kvmesh.kv_service.index import BlockIndex, Registration, WorkerMatch
from kvmesh.kv_service.service import KVService, ServiceConfig, now_ms
from kvmesh.transport.rpc import GrpcServer
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.kv_service")

DEFAULT_MAX_PUBLISHERS = 256
"""Workers that may hold a PublishEvents stream on one replica at once."""
UNARY_THREADS = 32
"""Server threads beyond the publisher bound: Lookup, Heartbeat, RegisterWorker and admin calls."""


def lookup_response(matches: list[WorkerMatch], block_size: int, n: int) -> pb.LookupResponse:
    return pb.LookupResponse(
        workers=[
            pb.WorkerMatch(worker_id=m.worker_id, address=m.address, matched_blocks=m.matched_blocks,
                           load=load_to_pb(m.load), block_size=m.block_size)
            for m in matches
        ],
        block_size=block_size,
        num_blocks_queried=n,
    )


class KVServiceServicer(pb_grpc.KVServiceServicer):
    def __init__(self, service: KVService, max_publishers: int = DEFAULT_MAX_PUBLISHERS) -> None:
        self.svc = service
        self.max_publishers = max_publishers
        self._publishers = threading.BoundedSemaphore(max_publishers)

    def RegisterWorker(self, request, context):
        algo = algorithm_from_pb(request.hash_algorithm)
        reg = Registration(request.worker_id, request.address, request.model_id, request.block_size, algo,
                           request.num_blocks, request.epoch)
        ttl = self.svc.register(reg)
        log.info("registered worker %s (%s, model %s, epoch %d)", reg.worker_id, reg.address, reg.model_id, reg.epoch)
        return pb.RegisterWorkerResponse(lease_ttl_ms=ttl, next_seq=1)

    def Heartbeat(self, request, context):
        ttl = self.svc.heartbeat(request.worker_id, request.epoch, load_from_pb(request.load))
        return pb.HeartbeatResponse(lease_ttl_ms=ttl)

    def PublishEvents(self, request_iterator, context) -> Iterator[pb.PublishEventsResponse]:
        # NOTE: a publishing worker holds its stream, and so one server thread, for its whole
        # life; a bounded number of them keeps threads free for Lookup, Heartbeat and admin calls.
        if not self._publishers.acquire(blocking=False):
            raise ResourceExhausted(
                f"this kv_service replica already serves {self.max_publishers} publishing workers: "
                "start it with a larger --max-publishers or point workers at another replica")
        try:
            yield from self._publish_stream(request_iterator)
        finally:
            self._publishers.release()

    def _publish_stream(self, request_iterator) -> Iterator[pb.PublishEventsResponse]:
        for req in request_iterator:
            if req.snapshot:
                if req.events:
                    raise InvalidArgument("a snapshot batch carries snapshot_hashes only; events must be empty")
                result = self.svc.snapshot(req.worker_id, req.epoch, req.seq, list(req.snapshot_hashes))
            else:
                if req.snapshot_hashes:
                    raise InvalidArgument("snapshot_hashes given without snapshot=true")
                result = self.svc.publish(req.worker_id, req.epoch, req.seq, events_from_pb(req.events))
            yield pb.PublishEventsResponse(seq=req.seq, action=int(result.action), reason=result.reason)

    def Lookup(self, request, context):
        matches = self.svc.lookup(request.model_id, request.block_hashes)
        bs = matches[0].block_size if matches else 0
        return lookup_response(matches, bs, len(request.block_hashes))

    def LookupTokens(self, request, context):
        bs, matches = self.svc.lookup_tokens(request.model_id, request.token_ids, request.cache_salt)
        return lookup_response(matches, bs, len(request.token_ids) // bs if bs else 0)

    def GetStats(self, request, context):
        st = self.svc.index.stats(now_ms())
        return pb.GetStatsResponse(
            live_workers=st.live_workers, indexed_blocks=st.indexed_blocks, block_replicas=st.block_replicas,
            store=self.svc.index.name,
            models=[
                pb.ModelStats(model_id=spec.model_id, block_size=spec.block_size,
                              hash_algorithm=algorithm_to_pb(spec.hash_algorithm), live_workers=n)
                for spec, n in st.models
            ],
            lookups_total=self.svc.lookups_total, events_applied_total=self.svc.events_applied_total,
            resyncs_total=self.svc.resyncs_total,
        )

    def ListWorkers(self, request, context):
        now = now_ms()
        out = []
        for info in self.svc.index.workers(now, include_expired=request.include_expired):
            r = info.registration
            out.append(pb.WorkerInfo(
                worker_id=r.worker_id, address=r.address, model_id=r.model_id, block_size=r.block_size,
                hash_algorithm=algorithm_to_pb(r.hash_algorithm), num_blocks=r.num_blocks, epoch=r.epoch,
                last_seq=info.last_seq, blocks_indexed=info.blocks_indexed, load=load_to_pb(info.load),
                lease_remaining_ms=info.lease_expiry_ms - now, live=info.live(now),
            ))
        return pb.ListWorkersResponse(workers=out)

    def GetBlock(self, request, context):
        holders = self.svc.get_block(request.block_hash)
        return pb.GetBlockResponse(block_hash=request.block_hash, holders=holders, refcount=len(holders))

    def FlushWorker(self, request, context):
        return pb.FlushWorkerResponse(blocks_removed=self.svc.flush(request.worker_id))


class KVServiceServer:
    """The kv_service process: gRPC server + background reaper of expired workers."""

    def __init__(self, index: BlockIndex, host: str = "0.0.0.0", port: int = 50052,
                 config: ServiceConfig | None = None, max_publishers: int = DEFAULT_MAX_PUBLISHERS) -> None:
        if max_publishers < 1:
            raise ValueError(f"max_publishers must be >= 1, got {max_publishers}")
        self.service = KVService(index, config)
        # NOTE: sync gRPC runs each RPC on a pool thread and a PublishEvents stream keeps its
        # thread; UNARY_THREADS more than the publisher bound are always left for unary calls.
        self.grpc = GrpcServer(host, port, max_workers=max_publishers + UNARY_THREADS)
        pb_grpc.add_KVServiceServicer_to_server(KVServiceServicer(self.service, max_publishers), self.grpc.server)
        self.grpc.add_service(pb.DESCRIPTOR.services_by_name["KVService"].full_name)
        self.port = self.grpc.port
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="kv-reaper", daemon=True)

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.service.config.reap_interval_s):
            try:
                n = self.service.reap()
                if n:
                    log.info("reaped %d expired worker(s)", n)
            except Exception as exc:  # noqa: BLE001 - keep reaping; the store may come back
                log.warning("reaper: %s", exc)

    def start(self) -> KVServiceServer:
        self.grpc.start()
        self._reaper.start()
        self.grpc.set_serving(True)
        return self

    def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        self.grpc.stop(grace)
        self.service.index.close()
