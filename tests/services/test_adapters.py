"""LoRA adapters through a real stack (docs/adapters.md; issue 52): Redis, kv_service, two tiny-model workers
with ``--enable-lora`` serving different adapters, a router (gRPC and HTTP).

A request whose ``model`` names an adapter runs under it on a worker that serves it, token for token what the
engine gives under that adapter alone (and not the base model's output); ``/v1/models`` and ListModels list
the adapters with their base as parent; the workers' load reports say where each adapter is; an adapter no
worker serves is 404 / NOT_FOUND, on the worker too.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.transport.channels import dial
from kvmesh.v1 import (
    common_pb2,
    kv_service_pb2,
    kv_service_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.support import wait_until

PROMPT = [(5 * i) % 200 + 3 for i in range(40)]  # 2 full blocks of 16 and a tail
GPU, CPU, DISK = common_pb2.ADAPTER_LEVEL_GPU, common_pb2.ADAPTER_LEVEL_CPU, common_pb2.ADAPTER_LEVEL_DISK


def make_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """peft's own save_pretrained output, B random (init_lora_weights=False): the adapter changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if not out.exists():
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        torch.manual_seed(seed)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                            init_lora_weights=False, lora_dropout=0.0)
        get_peft_model(base, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(model_dir, root / name, seed) for name, seed in (("sql", 1), ("chat", 2))}


@pytest.fixture(scope="module")
def expected(model_dir, adapters) -> dict[str, list[int]]:
    """Greedy ids of PROMPT under each adapter and the base model, from the engine alone (LLM)."""
    llm = LLM(str(model_dir), num_blocks=64, max_model_len=512, enable_lora=True, max_loras=2,
              lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    out = {name: llm.generate([PROMPT], sp, lora_names=name)[0].token_ids for name in adapters}
    out[""] = llm.generate([PROMPT], sp)[0].token_ids
    return out


@pytest.fixture
def stack(kv_server, start_worker, start_router, adapters):
    kv = f"127.0.0.1:{kv_server.port}"
    lora = {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1}
    # w0 serves sql only; w1 serves both, chat in its one slot's reach first
    w0 = start_worker("w0", kv, lora_modules=[f"sql={adapters['sql']}"], **lora)
    w1 = start_worker("w1", kv, lora_modules=[f"sql={adapters['sql']}", f"chat={adapters['chat']}"], **lora)
    router = start_router(kv, router_kw={"http_port": 0})
    wait_until(lambda: {a.name for m in router.models.all() for e in m.pool.endpoints() for a in e.load.adapters}
               == {"sql", "chat"}, 10, "the router to see both workers' adapters")
    return kv, w0, w1, router


def generate(router, model: str, ids: list[int]) -> tuple[list[int], str]:
    stub = router_pb2_grpc.RouterStub(dial(f"127.0.0.1:{router.port}"))
    out = list(stub.Generate(router_pb2.GenerateRequest(
        model=model, token_ids=router_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True)), timeout=60))
    return [t for m in out for t in m.token_ids], out[-1].served_by


def http(router, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{router.http_port}{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_adapters_request_runs_under_it_on_a_worker_that_serves_it(stack, expected, model_dir):
    _, w0, w1, router = stack
    assert len({tuple(v) for v in expected.values()}) == 3  # the adapters change the output
    for _ in range(3):
        ids, served = generate(router, "chat", PROMPT)
        assert (ids, served) == (expected["chat"], "w1")  # only w1 serves chat
    ids, served = generate(router, "sql", PROMPT)
    assert ids == expected["sql"] and served in ("w0", "w1")
    ids, _ = generate(router, "", PROMPT)
    assert ids == expected[""]
    # over HTTP: the answer names the adapter, as vLLM's does
    # (temperature 0: the OpenAI API's default is 1)
    status, body = http(router, "POST", "/v1/completions", {"model": "chat", "prompt": PROMPT, "max_tokens": 6,
                                                            "temperature": 0, "ignore_eos": True,
                                                            "return_token_ids": True})
    assert status == 200, body
    assert body["model"] == "chat" and body["choices"][0]["token_ids"] == expected["chat"], (body, expected)


def test_models_are_listed_with_their_adapters_and_an_unknown_one_is_not_found(stack, model_dir):
    _, w0, _, router = stack
    status, body = http(router, "GET", "/v1/models")
    assert status == 200
    cards = {c["id"]: c.get("parent") for c in body["data"]}
    base = next(i for i, p in cards.items() if p is None)
    assert cards == {base: None, "sql": base, "chat": base}
    assert http(router, "GET", "/v1/models/chat")[1]["parent"] == base
    listed = router_pb2_grpc.RouterStub(dial(f"127.0.0.1:{router.port}")).ListModels(router_pb2.ListModelsRequest())
    assert {(m.id, m.parent, m.workers) for m in listed.models} == {(base, "", 2), ("sql", base, 2), ("chat", base, 1)}
    status, body = http(router, "POST", "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert status == 404 and "nope" in body["error"]["message"]
    # a worker asked for an adapter it does not serve says so (NOT_FOUND), whatever a router believes
    worker = worker_pb2_grpc.WorkerStub(dial(w0.address))
    with pytest.raises(grpc.RpcError) as err:
        list(worker.Generate(worker_pb2.WorkerGenerateRequest(prompt_token_ids=PROMPT, adapter="chat"), timeout=30))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "serves no LoRA adapter 'chat'" in err.value.details()


def test_load_reports_say_where_each_adapter_is(stack):
    kv, _, w1, router = stack
    stub = kv_service_pb2_grpc.KVServiceStub(dial(kv))

    def levels() -> dict[str, tuple[int, int]]:
        w = next(w for w in stub.ListWorkers(kv_service_pb2.ListWorkersRequest()).workers if w.worker_id == "w1")
        assert w.load.max_loras == 1
        return {a.name: (a.level, a.requests) for a in w.load.adapters}

    # one slot, one adapter in host memory: the one used last holds the slot, the other is on disk or in host
    # memory (max_cpu_loras 1: the slot's adapter is the one kept there)
    generate(router, "chat", PROMPT)
    wait_until(lambda: levels()["chat"] == (GPU, 0), 10, "chat in w1's slot")
    # the slot load is counted and timed (what routers learn a load's cost from)
    w = next(w for w in stub.ListWorkers(kv_service_pb2.ListWorkersRequest()).workers if w.worker_id == "w1")
    assert w.load.adapter_cpu_loads_total + w.load.adapter_disk_loads_total >= 1
    assert w.load.adapter_cpu_load_seconds + w.load.adapter_disk_load_seconds > 0
    # the worker's own metrics say the same, in vLLM's (proposed) shape
    page = generate_latest(w1.metrics.registry).decode()
    assert 'kvmesh:lora_adapter_loaded{adapter_name="chat",level="gpu",model_name=' in page
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(page) for s in f.samples}
    assert [v for (n, labels), v in samples.items() if n == "kvmesh:max_gpu_lora_adapters"] == [1.0]
    assert [v for (n, labels), v in samples.items() if n == "kvmesh:num_gpu_loaded_lora_adapters"] == [1.0]
    assert any(n == "kvmesh:lora_requests_info" and ("running_lora_adapters", "chat") in labels
               for n, labels in samples)  # chat had a request in flight at some step
    generate(router, "sql", PROMPT[:20])
    ids, served = generate(router, "sql", PROMPT[:20])
    if served == "w1":
        wait_until(lambda: levels()["sql"] == (GPU, 0) and levels()["chat"][0] in (CPU, DISK), 10,
                   "sql in w1's slot, chat out of it")
    else:  # NOTE: sql went to w0 both times: w1's slot still holds chat
        assert levels()["chat"] == (GPU, 0)


def test_an_adapter_loaded_and_unloaded_at_run_time_through_the_router(kv_server, start_worker, start_router,
                                                                        adapters, model_dir, tmp_path):
    kv = f"127.0.0.1:{kv_server.port}"
    for w in ("w0", "w1"):
        start_worker(w, kv, enable_lora=True, max_loras=1)
    closed = start_router(kv, router_kw={"http_port": 0})
    router = start_router(kv, router_kw={"http_port": 0, "allow_runtime_lora_updating": True})
    body = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
    status, answer = http(closed, "POST", "/v1/load_lora_adapter", body)
    assert status == 400 and "--allow-runtime-lora-updating" in answer["error"]["message"]
    status, answer = http(router, "POST", "/v1/load_lora_adapter", {"lora_name": "chat"})
    assert status == 400 and "lora_path" in answer["error"]["message"]
    status, answer = http(router, "POST", "/v1/load_lora_adapter", {**body, "lora_path": str(tmp_path)})
    assert status == 400 and "2 of 2 workers refused" in answer["error"]["message"], answer
    assert http(router, "POST", "/v1/completions", {"model": "chat", "prompt": PROMPT, "max_tokens": 2})[0] == 404
    status, answer = http(router, "POST", "/v1/load_lora_adapter", body)
    assert status == 200 and sorted(answer["workers"]) == ["w0", "w1"], answer
    # the next request may name it: the answer came once the router's view listed it
    ids, _ = generate(router, "chat", PROMPT)
    assert ids == expected_ids(model_dir, adapters, "chat")
    status, answer = http(router, "POST", "/v1/load_lora_adapter", body)
    assert status == 409 and "already loaded" in answer["error"]["message"], answer
    status, answer = http(router, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200 and answer["status"] == "unloaded", answer
    assert http(router, "POST", "/v1/completions", {"model": "chat", "prompt": PROMPT, "max_tokens": 2})[0] == 404
    status, answer = http(router, "POST", "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404, answer


def expected_ids(model_dir: Path, adapters: dict[str, Path], name: str) -> list[int]:
    llm = LLM(str(model_dir), num_blocks=64, max_model_len=512, enable_lora=True, max_loras=1,
              lora_modules=[f"{name}={adapters[name]}"])
    return llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True), lora_names=name)[0].token_ids
