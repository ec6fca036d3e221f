"""Worker roles: registered with the kv_service, shown by ``kvmesh admin workers``, refused when unknown."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.cli import main
from kvmesh.contract.convert import registration_to_pb
from kvmesh.contract.index_protocol import Registration
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from kvmesh.v1 import worker_pb2, worker_pb2_grpc


def test_roles_reach_the_index_the_admin_table_and_get_load(kv_server, start_worker, capsys):
    kv = f"127.0.0.1:{kv_server.port}"
    p = start_worker("pre-0", kv, role="prefill", kv_transport="grpc")
    start_worker("dec-0", kv, role="decode", kv_transport="grpc")
    start_worker("agg-0", kv)
    infos = kpb_grpc.KVServiceStub(dial(kv)).ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers
    assert {w.worker_id: w.role for w in infos} == {"pre-0": "prefill", "dec-0": "decode", "agg-0": "both"}
    r = worker_pb2_grpc.WorkerStub(dial(p.address)).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    assert r.role == "prefill"
    assert main(["admin", "workers", "--kv-service", kv]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[0][:3] == ["worker", "engine", "role"]
    rows = {cells[0]: cells[2] for cells in lines[1:] if cells[0] != "" and not cells[0].startswith("-")}
    assert rows == {"agg-0": "both", "dec-0": "decode", "pre-0": "prefill"}


def test_an_unknown_role_is_refused_with_the_choices(kv_server):
    reg = Registration("w", "127.0.0.1:1", "m", 16, "sha256_128", 10, 1, role="verifier")
    with pytest.raises(grpc.RpcError) as e:
        kpb_grpc.KVServiceStub(dial(f"127.0.0.1:{kv_server.port}")).RegisterWorker(registration_to_pb(reg), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefill, decode, both" in e.value.details()


def test_a_worker_with_a_role_needs_prefix_caching(start_worker):
    with pytest.raises(ValueError, match="needs prefix caching"):
        start_worker("p", None, role="prefill", enable_prefix_caching=False)
