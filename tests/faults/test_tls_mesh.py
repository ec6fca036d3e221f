"""Mutual TLS across real processes: `kvmesh kv-service`, `worker` and `router` started from the CLI
with certificates from a throwaway CA (openssl), every hop over mTLS.

The worker registers with the kv_service and publishes its blocks over mTLS (it shows up in the
index), the router discovers it, looks prefixes up and forwards over mTLS (a request through the
router is served by it, a repeated prefix is a cache hit). A client certificate from another CA,
no certificate, or plaintext are refused by each server.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvmesh.client import Client
from kvmesh.transport import security
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import worker_pb2 as wpb
from kvmesh.v1 import worker_pb2_grpc as wpb_grpc
from tests.faults.conftest import Cluster, Proc, kv_stub
from tests.support import wait_until

PROMPT = [(11 * i + 7) % 300 + 3 for i in range(80)]  # 5 full blocks


def make_pki(d: Path) -> Path:
    """CA ``ca`` signing a server cert (localhost, 127.0.0.1) and a client cert; CA ``rogue``
    signing a client cert of its own."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    for ca in ("ca", "rogue"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
            "-subj", f"/CN=kvmesh-test-{ca}")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, ca in (("server", "ca"), ("client", "ca"), ("rogue-client", "rogue")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=kvmesh-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")
    return d


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def server_flags(p: Path) -> list[str]:
    return ["--tls-cert", str(p / "server.pem"), "--tls-key", str(p / "server.key"), "--tls-client-ca", str(p / "ca.pem")]


def client_flags(p: Path) -> list[str]:
    return ["--tls-ca", str(p / "ca.pem"), "--tls-client-cert", str(p / "client.pem"),
            "--tls-client-key", str(p / "client.key")]


def as_client(p: Path, cert: str | None = "client") -> security.Security:
    """This process's security as a client presenting ``cert`` (None: none) and trusting ``ca``."""
    files = security.TLSFiles(str(p / f"{cert}.pem"), str(p / f"{cert}.key"), str(p / "ca.pem")) if cert else \
        security.TLSFiles(ca=str(p / "ca.pem"))
    return security.Security(client_tls=files)


@pytest.fixture(scope="module")
def mesh(cluster: Cluster, pki: Path) -> Iterator[dict[str, Proc]]:
    saved = security.current()
    security.configure(as_client(pki))  # so the cluster's readiness checks dial over mTLS
    try:
        kv = cluster.kv_service("tls-kv", None, "--store", "memory", *server_flags(pki))
        worker = cluster.worker("tls-w", kv.address, None, True, *server_flags(pki), *client_flags(pki))
        router = cluster.router(kv.address, 0, *server_flags(pki), *client_flags(pki), name="tls-router")
        yield {"kv": kv, "worker": worker, "router": router}
    finally:
        security.configure(saved)


def code_as(sec: security.Security, call: Callable[[], object]) -> grpc.StatusCode:
    saved = security.current()
    security.configure(sec)
    try:
        call()
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()
    finally:
        security.configure(saved)


@pytest.mark.timeout(90)
def test_every_hop_runs_over_mutual_tls(mesh: dict[str, Proc], pki: Path):
    saved = security.current()
    security.configure(as_client(pki))
    try:
        kv = kv_stub(mesh["kv"].address)
        # worker -> kv_service: registered and publishing
        assert [w.worker_id for w in kv.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers] == ["tls-w"]
        with Client(mesh["router"].address, timeout=30) as client:
            first = client.generate(PROMPT, max_tokens=2, ignore_eos=True)  # client -> router -> worker
            assert (first.served_by, first.usage.completion_tokens) == ("tls-w", 2)
            # The worker's block events reach the index over mTLS; the router's Lookup reads them.
            wait_until(lambda: kv.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers[0].blocks_indexed
                       == len(PROMPT) // 16, 10, "the worker's blocks in the index")
            again = client.generate(PROMPT + [5], max_tokens=2, ignore_eos=True)
            assert again.usage.cached_tokens == len(PROMPT) // 16 * 16
    finally:
        security.configure(saved)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", ["kv", "worker", "router"])
def test_a_client_cert_from_another_ca_is_refused(mesh: dict[str, Proc], pki: Path, server: str):
    address = mesh[server].address

    def call() -> None:
        from kvmesh.transport.channels import dial

        channel = dial(address)
        try:
            if server == "kv":
                kv_stub(address).GetStats(kpb.GetStatsRequest(), timeout=5)
            elif server == "worker":
                wpb_grpc.WorkerStub(channel).GetLoad(wpb.GetLoadRequest(), timeout=5)
            else:
                with Client(address, timeout=5) as c:
                    c.generate([5, 6, 7], max_tokens=1)
        finally:
            channel.close()

    assert code_as(as_client(pki), call) == grpc.StatusCode.OK  # the control: the right cert gets in
    assert code_as(as_client(pki, "rogue-client"), call) == grpc.StatusCode.UNAVAILABLE  # handshake refused
    assert code_as(as_client(pki, None), call) == grpc.StatusCode.UNAVAILABLE  # no client cert
    assert code_as(security.Security(), call) == grpc.StatusCode.UNAVAILABLE  # plaintext
