"""In-process servers for fuzzing: kv_service on the memory store and on Redis, a tiny-model worker,
a router on top; and the check every fuzzed call ends with."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.contract.limits import MAX_STATUS_MESSAGE_BYTES
from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import free_port
from kvmesh.make_model import ModelSpec, make_model
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.serving.server import WorkerServer
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.server import RouterServer
from kvmesh.stack import wait_serving
from kvmesh.transport.channels import dial

TINY = ModelSpec(arch="llama", layers=2, hidden_size=64, heads=4, kv_heads=2, intermediate_size=128,
                 max_position_embeddings=512, seed=11, init_std=0.05)

NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
         grpc.StatusCode.UNIMPLEMENTED}


@pytest.fixture(scope="session")
def fuzz_model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("fuzz") / "tiny-llama", TINY)


@pytest.fixture(scope="module", params=["memory", "redis"])
def kv_address(request, redis_server) -> Iterator[str]:
    index = MemoryIndex() if request.param == "memory" else RedisIndex(redis_server.url, f"fuzz{free_port()}")
    server = KVServiceServer(index, "127.0.0.1", free_port(), ServiceConfig(lease_ttl_ms=5000, reap_interval_s=0.5))
    server.start()
    yield f"127.0.0.1:{server.port}"
    server.stop(0.5)


@pytest.fixture(scope="module")
def worker_and_router(fuzz_model, redis_server) -> Iterator[tuple[str, str]]:
    kv = KVServiceServer(RedisIndex(redis_server.url, f"fuzzstack{free_port()}"), "127.0.0.1", free_port(),
                         ServiceConfig(lease_ttl_ms=5000, reap_interval_s=0.5)).start()
    kv_addr = f"127.0.0.1:{kv.port}"
    engine = LLMEngine(model=str(fuzz_model), num_blocks=128, max_num_batched_tokens=256, max_model_len=512)
    worker = WorkerServer(engine, "fw1", "127.0.0.1", free_port(), kv_addr).start(wait_registered=10)
    router = RouterServer(RouterConfig(host="127.0.0.1", port=free_port(), kv_service=kv_addr,
                                       model_dirs=[str(fuzz_model)],
                                       routing=RoutingConfig(discovery_interval_s=0.2, policy_config=PolicyConfig(seed=0)))).start()
    wait_serving(f"127.0.0.1:{router.port}", timeout=20)
    yield f"127.0.0.1:{worker.port}", f"127.0.0.1:{router.port}"
    router.stop(0.5)
    worker.stop(0.5)
    kv.stop(0.5)


def outcome(call: Callable[[], object], allowed: set[grpc.StatusCode]) -> grpc.StatusCode:
    """Runs one fuzzed call; its status must be OK or one of ``allowed`` (never INTERNAL/UNKNOWN),
    with a message of at most MAX_STATUS_MESSAGE_BYTES (client input is only ever quoted short)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            for _ in result:  # a stream: drain it (bounded by the call's deadline)
                pass
    except grpc.RpcError as err:
        code, details = err.code(), err.details() or ""
        assert code not in NEVER, f"{code.name}: {details[:500]}"
        assert code in allowed, f"undocumented status {code.name}: {details[:500]}"
        assert len(details.encode()) <= MAX_STATUS_MESSAGE_BYTES, f"{code.name}: a {len(details)}-character message"
        return code
    return grpc.StatusCode.OK


def assert_serving(address: str) -> None:
    channel = dial(address)
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
