"""Auth and limits across real processes: `kvmesh up` children with tokens from the environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvmesh.client import Client
from kvmesh.loopback import free_port
from kvmesh.stack import LocalStack, StackConfig
from kvmesh.transport import security

KVMESH = str(Path(sys.executable).parent / "kvmesh")
API, ADMIN = "api-token-123", "admin-token-456"


@pytest.fixture(scope="module")
def secured_stack(model_dir, tmp_path_factory):
    base = free_port()
    cfg = StackConfig(model=str(model_dir), workers=1, router_port=free_port(), kv_service_port=free_port(),
                      worker_port=base, metrics_port=0, store="memory",
                      worker_args=["--num-blocks=128", "--max-model-len=512"],
                      router_args=["--max-prompt-tokens=300", "--max-tokens-limit=50"],
                      log_dir=str(tmp_path_factory.mktemp("logs")),
                      env={security.API_TOKEN_ENV: API, security.ADMIN_TOKEN_ENV: ADMIN})
    stack = LocalStack(cfg).start()
    yield stack
    stack.stop()


def call(stack: LocalStack, token: str | None, prompt, **kw):
    saved = security.current()
    security.configure(security.Security(client_token=token))
    try:
        with Client(stack.endpoints["router"], timeout=60) as c:
            return c.generate(prompt, **kw)
    finally:
        security.configure(saved)


def code_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def test_router_requires_the_api_token(secured_stack):
    assert code_of(lambda: call(secured_stack, None, [5, 6, 7], max_tokens=2))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: call(secured_stack, ADMIN, [5, 6, 7], max_tokens=2))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert call(secured_stack, API, [5, 6, 7], max_tokens=2).usage.completion_tokens == 2


def test_kv_service_and_workers_require_the_admin_token(secured_stack):
    kv = secured_stack.endpoints["kv_service"]
    no = subprocess.run([KVMESH, "admin", "stats", "--kv-service", kv], capture_output=True, text=True, timeout=30,
                        env={"PATH": "/usr/bin:/bin"})
    assert no.returncode == 1 and "UNAUTHENTICATED" in no.stderr
    ok = subprocess.run([KVMESH, "admin", "stats", "--kv-service", kv, "--json"], capture_output=True, text=True,
                        timeout=30, env={"PATH": "/usr/bin:/bin", security.ADMIN_TOKEN_ENV: ADMIN})
    assert ok.returncode == 0 and '"live_workers": 1' in ok.stdout
    from kvmesh.v1 import worker_pb2, worker_pb2_grpc

    worker = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(secured_stack.endpoints["worker-0"]))
    with pytest.raises(grpc.RpcError) as err:
        worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_limits_answer_resource_exhausted(secured_stack):
    code, msg = code_of(lambda: call(secured_stack, API, [5] * 301, max_tokens=2))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 300 (--max-prompt-tokens)" in msg
    code, msg = code_of(lambda: call(secured_stack, API, [5, 6], max_tokens=51))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-tokens-limit" in msg
    assert call(secured_stack, API, [5, 6], max_tokens=50).usage.completion_tokens == 50
