"""A real stack on loopback for service tests: Redis, kv_service, tiny-model workers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import free_port
from kvmesh.make_model import ModelSpec, make_model
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.serving.server import WorkerServer
from kvmesh.router.config import EppConfig, RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.epp import EppServer
from kvmesh.router.server import RouterServer
from kvmesh.stack import wait_serving

TINY = ModelSpec(arch="llama", layers=2, hidden_size=64, heads=4, kv_heads=2, intermediate_size=128,
                 max_position_embeddings=512, seed=11, init_std=0.05)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("svc") / "tiny-llama", TINY)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kv_server(request, redis_url, redis_namespace) -> Iterator[KVServiceServer]:
    """kv_service on Redis; lease 1.5 s, or the ms of ``parametrize("kv_server", [ms], indirect=True)``."""
    lease_ttl_ms = getattr(request, "param", 1500)
    server = KVServiceServer(RedisIndex(redis_url, redis_namespace), "127.0.0.1", free_port(),
                             ServiceConfig(lease_ttl_ms=lease_ttl_ms, reap_interval_s=0.25)).start()
    yield server
    server.stop(0.5)


@pytest.fixture
def start_worker(model_dir) -> Iterator[Callable[..., WorkerServer]]:
    started: list[WorkerServer] = []

    def start(worker_id: str, kv_address: str | None, stream_interval: int = 1, **engine_kwargs) -> WorkerServer:
        kwargs = dict(num_blocks=128, max_num_batched_tokens=256, max_model_len=512) | engine_kwargs
        engine = LLMEngine(model=str(model_dir), **kwargs)
        server = WorkerServer(engine, worker_id, "127.0.0.1", free_port(), kv_address,
                              stream_interval=stream_interval).start(wait_registered=10)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop(0.5)


@pytest.fixture
def start_router(model_dir) -> Iterator[Callable[..., RouterServer]]:
    """Starts in-process routers over ``kv_address`` (discovery every 0.2 s, seeded policy); keyword
    arguments go to RoutingConfig, ``router_kw`` to RouterConfig. Stopped after the test."""
    started: list[RouterServer] = []

    def start(kv_address: str, router_kw: dict | None = None, **routing_kw) -> RouterServer:
        cfg = RouterConfig(host="127.0.0.1", port=free_port(), kv_service=kv_address, model_dirs=[str(model_dir)],
                           routing=RoutingConfig(**({"discovery_interval_s": 0.2, "policy_config": PolicyConfig(seed=0)}
                                                    | routing_kw)), **(router_kw or {}))
        server = RouterServer(cfg).start()
        started.append(server)
        wait_serving(f"127.0.0.1:{server.port}", timeout=20)
        return server

    yield start
    for s in started:
        s.stop(0.5)


@pytest.fixture
def start_epp(model_dir) -> Iterator[Callable[..., EppServer]]:
    """In-process endpoint pickers over a kv_service (discovery every 0.2 s, seeded policy)."""
    started: list[EppServer] = []

    def start(kv_address: str | None, router_kw: dict | None = None, epp_kw: dict | None = None,
              wait_workers: int = 1, **routing_kw) -> EppServer:
        cfg = RouterConfig(host="127.0.0.1", kv_service=kv_address, model_dirs=[str(model_dir)],
                           routing=RoutingConfig(discovery_interval_s=0.2, policy_config=PolicyConfig(seed=0),
                                                 **routing_kw), **(router_kw or {}))
        server = EppServer(cfg, EppConfig(port=0, **(epp_kw or {}))).start()
        started.append(server)
        deadline = time.monotonic() + 20
        while wait_workers and len(server.pool.endpoints()) < wait_workers:
            assert time.monotonic() < deadline, "the endpoint picker never saw the workers"
            time.sleep(0.05)
        return server

    yield start
    for s in started:
        s.stop(0.5)
