"""Prefill/decode disaggregation through the router: a real kv_service on Redis, a prefill worker, a
decode worker, an aggregated one for comparison. Split requests are token-exact with transformers,
report the cached tokens the prefill worker's cache served, leave the index agreeing with every pool,
and the router's decision and its inputs are metrics."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from kvmesh.client import Client
from kvmesh.router.core.pd import PDConfig
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from tests.support import wait_until

BS = 16


def ids(n: int, k: int = 0) -> list[int]:
    return [(11 * i + 37 * k + 5) % 500 + 2 for i in range(n)]


def metric(router, name: str, **labels) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


def index_holds(kv_addr: str, worker_id: str, hashes: list[bytes]) -> set[bytes]:
    stub = kpb_grpc.KVServiceStub(dial(kv_addr))
    return {h for h in hashes if worker_id in stub.GetBlock(kpb.GetBlockRequest(block_hash=h), timeout=5).holders}


def idle(w) -> bool:
    kv = w.engine.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks - 1 and not w.engine.kv_holds.holds and not w.engine.kv_holds.imports


def test_split_requests_are_token_exact_and_the_index_agrees_with_the_pools(kv_server, start_worker, start_router,
                                                                            model_dir):
    kv = f"127.0.0.1:{kv_server.port}"
    p = start_worker("pre", kv, role="prefill", kv_transport="grpc")
    d = start_worker("dec", kv, role="decode", kv_transport="grpc")
    router = start_router(kv, pd=PDConfig(pd_mode="always"))
    wait_until(lambda: len(router.router.pool.endpoints()) == 2, what="both workers discovered")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    client = Client(f"127.0.0.1:{router.port}", timeout=60)
    for k, n in enumerate([17, 32, 33, 80]):
        prompt = ids(n, k)
        out = client.generate(prompt, max_tokens=5, ignore_eos=True)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, min_new_tokens=5)[0, n:].tolist()
        assert out.token_ids == ref, n
        assert out.served_by == "dec"
        # the prefill worker's cache served nothing of these new prompts: the pulled blocks are no cache hit
        assert out.usage.cached_tokens == 0 and out.usage.prompt_tokens == n
    assert metric(router.router, "kvmesh_router_pd_decisions_total", reason="mode") == 4
    assert metric(router.router, "kvmesh_router_pd_transfers_total", transport="grpc") == 4
    # the decode worker's index entries are the blocks it took in (and computed), as its pool holds them
    chain = d.engine.block_hasher.hash_prompt(ids(80, 3))
    wait_until(lambda: index_holds(kv, "dec", chain) == set(chain) & d.engine.cached_block_hashes(),
               what="the index agrees with the decode worker's pool")
    assert set(chain[:4]) <= d.engine.cached_block_hashes()
    wait_until(lambda: idle(p) and idle(d), what="no hold and no import left")
    # the same prompt again: the decode worker holds it now, so nothing is sent and its cache serves it
    out = client.generate(ids(80, 3), max_tokens=5, ignore_eos=True)
    assert out.usage.cached_tokens == 4 * BS
    assert metric(router.router, "kvmesh_router_pd_decisions_total", reason="cached") == 1
    # no miss alarm: the audit did not count the pulled blocks as hits the index failed to predict
    assert metric(router.router, "kvmesh_router_audit_unseen_hits_total", worker="dec") == 0


def test_auto_splits_long_prompts_and_keeps_short_ones_local(kv_server, start_worker, start_router, model_dir):
    kv = f"127.0.0.1:{kv_server.port}"
    start_worker("pre", kv, role="prefill", kv_transport="grpc")
    start_worker("dec", kv, role="decode", kv_transport="grpc")
    router = start_router(kv, pd=PDConfig(pd_mode="auto", pd_cold_min_tokens=160))
    wait_until(lambda: len(router.router.pool.endpoints()) == 2, what="both workers discovered")
    client = Client(f"127.0.0.1:{router.port}", timeout=60)
    short = client.generate(ids(40, 1), max_tokens=3, ignore_eos=True)
    long = client.generate(ids(300, 2), max_tokens=3, ignore_eos=True)
    assert short.served_by == long.served_by == "dec"
    r = router.router
    assert metric(r, "kvmesh_router_pd_decisions_total", reason="cold_short") == 1
    assert metric(r, "kvmesh_router_pd_decisions_total", reason="disaggregated") == 1
    assert metric(r, "kvmesh_router_pd_transfers_total", transport="grpc") == 1


def test_a_request_the_decode_worker_would_refuse_is_refused_before_any_prefill(kv_server, start_worker,
                                                                                start_router):
    import grpc
    import pytest

    kv = f"127.0.0.1:{kv_server.port}"
    p = start_worker("pre", kv, role="prefill", kv_transport="grpc")
    start_worker("dec", kv, role="decode", kv_transport="grpc")
    router = start_router(kv, pd=PDConfig(pd_mode="always"))
    wait_until(lambda: len(router.router.pool.endpoints()) == 2, what="both workers discovered")
    client = Client(f"127.0.0.1:{router.port}", timeout=60)
    with pytest.raises(grpc.RpcError) as e:
        client.generate(ids(150), max_tokens=400, ignore_eos=True)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens is 400" in e.value.details()
    assert p.engine.stats().steps == 0 and not p.engine.kv_holds.holds


def test_a_client_that_leaves_mid_decode_reaches_both_legs(kv_server, start_worker, start_router):
    kv = f"127.0.0.1:{kv_server.port}"
    p = start_worker("pre", kv, role="prefill", kv_transport="grpc")
    d = start_worker("dec", kv, role="decode", kv_transport="grpc")
    router = start_router(kv, pd=PDConfig(pd_mode="always"))
    wait_until(lambda: len(router.router.pool.endpoints()) == 2, what="both workers discovered")
    from kvmesh.client import make_request
    from kvmesh.v1 import router_pb2_grpc

    stream = router_pb2_grpc.RouterStub(dial(f"127.0.0.1:{router.port}")).Generate(
        make_request(ids(120, 7), max_tokens=300, ignore_eos=True), timeout=60)
    got = 0
    for msg in stream:
        got += len(msg.token_ids)
        if got >= 3:
            stream.cancel()
            break
    # the decode worker aborted the request and freed its blocks; the prefill worker's hold went with the pull
    wait_until(lambda: idle(d) and idle(p), what="both legs' blocks freed after the client left")
    assert d.engine.stats().num_running == 0


def test_the_stack_splits_its_workers_into_pools():
    import pytest

    from kvmesh.stack import StackConfig

    StackConfig(model="m", workers=3, prefill_workers=1).check()
    for bad in (3, 4):
        with pytest.raises(ValueError, match="--prefill-workers"):
            StackConfig(model="m", workers=3, prefill_workers=bad).check()
