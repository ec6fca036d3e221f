"""Bearer tokens and TLS / mTLS on a real gRPC server (the kv_service, memory store)."""

from __future__ import annotations

import asyncio
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.loopback import free_port
from kvmesh.transport import security
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc


@pytest.fixture
def configured():
    """Sets the process-wide security for one test and restores it."""
    before = security.current()

    def set_(**kw) -> None:
        security.configure(security.Security(**kw))

    yield set_
    security.configure(before)


def serve() -> KVServiceServer:
    return KVServiceServer(MemoryIndex(), "localhost", free_port()).start()


def stats(server: KVServiceServer, **client) -> grpc.StatusCode:
    saved = security.current()
    security.configure(security.Security(**client))
    try:
        stub = pb_grpc.KVServiceStub(dial(f"localhost:{server.port}"))
        stub.GetStats(pb.GetStatsRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()
    finally:
        security.configure(saved)


def test_admin_token_is_required_and_compared(configured):
    configured(server_token="s3cret")
    server = serve()
    try:
        assert stats(server) == grpc.StatusCode.UNAUTHENTICATED
        assert stats(server, client_token="wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert stats(server, client_token="s3cret") == grpc.StatusCode.OK
        # Health stays open for probes.
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"localhost:{server.port}"))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KVServiceStub(grpc.insecure_channel(f"localhost:{server.port}")).GetStats(
                pb.GetStatsRequest(), timeout=5)
        assert "missing bearer token" in err.value.details()
    finally:
        server.stop(0)


def test_read_token_prefers_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", "from-env")
    f = tmp_path / "t"
    f.write_text("from-file\n")
    assert security.read_token(str(f), "KVMESH_ADMIN_TOKEN") == "from-file"
    assert security.read_token(None, "KVMESH_ADMIN_TOKEN") == "from-env"
    monkeypatch.delenv("KVMESH_ADMIN_TOKEN")
    assert security.read_token(None, "KVMESH_ADMIN_TOKEN") is None
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        security.read_token(str(tmp_path / "empty"), "X")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server cert for localhost and a client cert, made with openssl."""
    d = tmp_path_factory.mktemp("pki")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=kvmesh-test-ca")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={'localhost' if name == 'server' else 'kvmesh-client'}")
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return d


def test_tls_and_mutual_tls(configured, pki):
    p = str(pki)
    configured(server_tls=security.TLSFiles(f"{p}/server.pem", f"{p}/server.key", ca=f"{p}/ca.pem"))
    server = serve()
    try:
        ca_only = security.TLSFiles(ca=f"{p}/ca.pem")
        with_cert = security.TLSFiles(f"{p}/client.pem", f"{p}/client.key", ca=f"{p}/ca.pem")
        assert stats(server, client_tls=with_cert) == grpc.StatusCode.OK
        assert stats(server, client_tls=ca_only) == grpc.StatusCode.UNAVAILABLE  # no client cert: mTLS refuses
        assert stats(server) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
    finally:
        server.stop(0)


def test_redis_password_is_required_and_used():
    from kvmesh.contract.errors import Unavailable
    from kvmesh.kv_service.store_redis import RedisIndex
    from kvmesh.loopback import RedisServer

    def ping(url: str) -> str:
        async def run() -> str:
            index = RedisIndex(url)
            try:
                await index.ping()
                return "ok"
            finally:
                await index.close()

        return asyncio.run(run())

    with RedisServer(password="pw-789") as redis:
        assert ping(redis.url) == "ok"
        with pytest.raises(Unavailable, match="invalid username-password pair"):
            ping(redis.url.replace("pw-789", "nope"))
        with pytest.raises(Unavailable, match="(?i)authenticat"):
            ping(f"redis://127.0.0.1:{redis.port}/0")


def test_router_openai_http_serves_tls_and_requires_the_client_cert(configured, pki):
    import http.client
    import json
    import ssl
    import urllib.error
    import urllib.request

    from kvmesh.router.config import RouterConfig
    from kvmesh.router.server import RouterServer

    p = str(pki)
    configured(server_tls=security.TLSFiles(f"{p}/server.pem", f"{p}/server.key", ca=f"{p}/ca.pem"),
               server_token="tok")
    router = RouterServer(RouterConfig(host="localhost", port=0, http_port=0, kv_service=None,
                                       workers=[f"127.0.0.1:{free_port()}"], model_id="m", rpc_timeout_s=0.2)).start()

    def get(url: str, context: ssl.SSLContext | None, token: str | None = "tok"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), context=context, timeout=5)

    try:
        url = f"https://localhost:{router.http_port}/v1/models"
        with_cert = ssl.create_default_context(cafile=f"{p}/ca.pem")
        with_cert.load_cert_chain(f"{p}/client.pem", f"{p}/client.key")
        assert [m["id"] for m in json.loads(get(url, with_cert).read())["data"]] == ["m"]
        with pytest.raises(urllib.error.HTTPError) as err:  # TLS does not replace the API token
            get(url, with_cert, token=None)
        assert err.value.code == 401
        with pytest.raises(OSError):  # no client certificate: mutual TLS refuses the handshake
            get(url, ssl.create_default_context(cafile=f"{p}/ca.pem")).read()
        with pytest.raises((OSError, http.client.HTTPException)):  # plaintext to the TLS port
            get(url.replace("https", "http"), None).read()
    finally:
        router.stop(0)
