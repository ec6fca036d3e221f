"""The admin CLI's kv_service client (`kvmesh admin`): one blocking call per admin RPC, with a deadline.

It answers the RPCs' messages as they are (the CLI prints them whole, as JSON or tables) and
raises grpc.RpcError as the call failed; kvmesh/commands/admin.py turns either into what a user reads.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.contract.convert import audit_from_pb
from kvmesh.contract.index_protocol import WorkerAudit
from kvmesh.transport.channels import dial, replicas
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc


class AdminClient:
    """Admin RPCs against one kv_service. Apply the caller's security settings first
    (kvmesh/transport/security.py): the channel is dialled with them."""

    def __init__(self, target: str, timeout_s: float = 5.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._stub = pb_grpc.KVServiceStub(dial(target))

    def stats(self) -> pb.GetStatsResponse:
        return self._stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout_s)

    def workers(self, include_expired: bool = False) -> pb.ListWorkersResponse:
        return self._stub.ListWorkers(pb.ListWorkersRequest(include_expired=include_expired), timeout=self.timeout_s)

    def block(self, block_hash: bytes) -> pb.GetBlockResponse:
        return self._stub.GetBlock(pb.GetBlockRequest(block_hash=block_hash), timeout=self.timeout_s)

    def lookup_tokens(self, model_id: str, token_ids: Sequence[int], cache_salt: str = "") -> pb.LookupResponse:
        return self._stub.LookupTokens(pb.LookupTokensRequest(model_id=model_id, token_ids=token_ids,
                                                              cache_salt=cache_salt), timeout=self.timeout_s)

    def audit(self) -> dict[str, WorkerAudit]:
        """The routers' miss audits, per worker, summed over every replica of ``target``: each replica
        holds the reports that reached it (kv_service/service.py), so a list ``a:1,b:2`` is asked
        address by address."""
        out: dict[str, WorkerAudit] = {}
        for address in replicas(self.target):
            stub = self._stub if address == self.target else pb_grpc.KVServiceStub(dial(address))
            for m in stub.GetAudit(pb.GetAuditRequest(), timeout=self.timeout_s).workers:
                worker_id, a = audit_from_pb(m)
                got = out.setdefault(worker_id, WorkerAudit(engine=a.engine))
                got.add(a)
                got.engine = got.engine or a.engine
        return dict(sorted(out.items()))

    def flush(self, worker_id: str) -> pb.FlushWorkerResponse:
        return self._stub.FlushWorker(pb.FlushWorkerRequest(worker_id=worker_id), timeout=self.timeout_s)
