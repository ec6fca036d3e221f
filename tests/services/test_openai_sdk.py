"""The official `openai` SDK against a real stack on loopback: Redis, kv_service, one worker of each of
two tiny models, and one router serving both over gRPC and the OpenAI HTTP API."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
import torch
from google.protobuf import struct_pb2
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import free_port
from kvmesh.make_model import ModelSpec, make_model
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.serving.server import WorkerServer
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.server import RouterServer
from kvmesh.transport import security
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support import wait_until

TINY_QWEN = ModelSpec(arch="qwen2", layers=2, hidden_size=64, heads=4, kv_heads=2, intermediate_size=128,
                      max_position_embeddings=1024, seed=5, init_std=0.05)
SYSTEM = ("You are the assistant of the kvmesh project. kvmesh routes every request to the worker that already "
          "holds the longest cached prefix of its prompt, so a long shared system prompt like this one is "
          "computed once and then reused by every request that starts with it.")


@dataclass
class Mesh:
    router: RouterServer
    a: str
    b: str
    dirs: dict[str, Path]
    workers: dict[str, WorkerServer]

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.router.http_port}/v1", api_key=kw.pop("api_key", "x"),
                             max_retries=0, timeout=60, **kw)


@pytest.fixture(scope="module")
def mesh(redis_server, model_dir, tmp_path_factory):
    qwen_dir = make_model(tmp_path_factory.mktemp("oai") / "tiny-qwen", TINY_QWEN)
    kv = KVServiceServer(RedisIndex(redis_server.url, f"t{uuid.uuid4().hex[:12]}"), "127.0.0.1", free_port(),
                         ServiceConfig(lease_ttl_ms=5000, reap_interval_s=0.25)).start()
    kv_addr = f"127.0.0.1:{kv.port}"
    workers = {}
    for wid, d, max_len in (("wa", model_dir, 512), ("wb", qwen_dir, 1024)):
        engine = LLMEngine(model=str(d), num_blocks=256, max_num_batched_tokens=256, max_model_len=max_len)
        workers[wid] = WorkerServer(engine, wid, "127.0.0.1", free_port(), kv_addr).start(wait_registered=10)
    router = RouterServer(RouterConfig(host="127.0.0.1", port=0, http_port=0, kv_service=kv_addr,
                                       model_dirs=[str(model_dir), str(qwen_dir)], routing=RoutingConfig(discovery_interval_s=0.1, policy_config=PolicyConfig(seed=0)))).start()
    a, b = model_dir.name, qwen_dir.name
    wait_until(lambda: all(m.pool.endpoints() for m in router.models.all()), what="both models' workers")
    yield Mesh(router, a, b, {a: model_dir, b: qwen_dir}, workers)
    router.stop(0.5)
    for w in workers.values():
        w.stop(0.5)
    kv.stop(0.5)


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly n tokens, as ignore_eos
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_chat_ids(model_dir: Path, messages: list[dict]) -> list[int]:
    ids = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_models_are_listed_and_an_unknown_one_is_404(mesh):
    client = mesh.client()
    assert [m.id for m in client.models.list()] == [mesh.a, mesh.b]
    assert client.models.retrieve(mesh.b).id == mesh.b
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found" and "no-such-model" in err.value.body["message"]


@pytest.mark.parametrize("which", ["a", "b"])
def test_chat_is_the_model_of_its_name_greedy_token_for_token_as_transformers(mesh, which):
    model = getattr(mesh, which)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    r = mesh.client().chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt = hf_chat_ids(mesh.dirs[model], messages)
    ids = r.choices[0].model_extra["token_ids"]
    assert ids == hf_greedy(mesh.dirs[model], prompt, 8)
    assert r.model == model and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == AutoTokenizer.from_pretrained(str(mesh.dirs[model])).decode(
        ids, skip_special_tokens=True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 8)


def test_chat_stream_delivers_each_token_as_the_worker_produces_it(mesh):
    client = mesh.client()
    engine = mesh.workers["wa"].engine
    stream = client.chat.completions.create(
        model=mesh.a, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=300,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = []
    generating_at_first_token = None
    for chunk in stream:
        if generating_at_first_token is None and chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
            generating_at_first_token = engine.has_unfinished_requests()
        chunks.append(chunk)
    # NOTE: one event per worker message: one token each unless the worker's loop found several steps'
    # tokens waiting at once (a busy host merges them, so how many events is the host's business);
    # never the whole answer at the end: the first token is here while the worker generates the rest.
    assert generating_at_first_token is True
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = [c for c in chunks[1:] if c.choices and c.choices[0].model_extra.get("token_ids")]
    sizes = [len(c.choices[0].model_extra["token_ids"]) for c in token_chunks]
    assert sum(sizes) == 300 and len(sizes) > 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.completion_tokens, usage.total_tokens) == (
        300, usage.prompt_tokens + 300)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model=mesh.a, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=300,
        temperature=0, extra_body={"ignore_eos": True})
    assert text == whole.choices[0].message.content


def test_completions_stream_and_not_agree(mesh):
    client = mesh.client()
    whole = client.completions.create(model=mesh.b, prompt="Once upon a time", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    parts = list(client.completions.create(model=mesh.b, prompt="Once upon a time", max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    # A token-id prompt is a prompt too.
    ids = client.completions.create(model=mesh.b, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_a_shared_system_prompt_is_served_from_the_cache(mesh):
    client = mesh.client()
    first = client.chat.completions.create(
        model=mesh.a, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First question?"}],
        max_tokens=4)
    second = client.chat.completions.create(
        model=mesh.a, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "And another?"}],
        max_tokens=4)
    assert first.usage.prompt_tokens > 32
    # The system prompt's full blocks (16 tokens each) are the cached part of the second request.
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


def test_stop_strings_and_stop_token_ids(mesh):
    client = mesh.client()
    base = client.completions.create(model=mesh.a, prompt="The cat", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = client.completions.create(model=mesh.a, prompt="The cat", max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 24


def test_bad_requests_are_400_with_the_routers_message(mesh):
    client = mesh.client()
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(model=mesh.a, messages=user, temperature=-1), "temperature must be a finite number >= 0"),
        (dict(model=mesh.a, messages=user, n=2), "n=2: kvmesh returns one choice per request"),
        (dict(model=mesh.a, messages=[]), "messages is empty"),
        (dict(model=mesh.a, messages=[{"role": "tool", "content": "x"}]), "roles are system, user and assistant"),
        (dict(model=mesh.a, messages=user, max_tokens=0), "max_tokens must be an integer in [1, 2**32)"),
        (dict(model=mesh.a, messages=[{"content": "no role"}]), "messages[0].role: Field required"),
        (dict(model=mesh.a, messages=user, extra_body={"top_k": -5}), "top_k must be an integer in [0, 2**31)"),
    ]
    for kw, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kw)
        assert message in err.value.body["message"], (kw, err.value.body)
        assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=mesh.a, messages=user, stream=True, temperature=-1)
    # The router keeps serving.
    assert client.chat.completions.create(model=mesh.a, messages=user, max_tokens=2).usage.completion_tokens == 2


def test_a_request_over_the_prompt_limit_is_400_not_429(mesh):
    mesh.router.router.config.max_prompt_tokens = 8
    try:
        with pytest.raises(openai.BadRequestError, match="--max-prompt-tokens"):
            mesh.client().completions.create(model=mesh.a, prompt=list(range(2, 20)), max_tokens=2)
    finally:
        mesh.router.router.config.max_prompt_tokens = 0


def test_the_api_token_guards_v1_but_not_health(mesh):
    security.configure(security.Security(server_token="s3cret"))
    try:
        secured = RouterServer(RouterConfig(host="127.0.0.1", port=0, http_port=0,
                                            kv_service=mesh.router.config.kv_service,
                                            model_dirs=[str(mesh.dirs[mesh.a])], routing=RoutingConfig(discovery_interval_s=0.1))).start()
    finally:
        security.configure(security.Security())
    try:
        base = f"http://127.0.0.1:{secured.http_port}/v1"
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        assert err.value.body["message"] == "wrong API key: send the header 'Authorization: Bearer <api token>'"
        with pytest.raises(urllib.error.HTTPError) as raw:
            urllib.request.urlopen(f"{base}/models")
        assert raw.value.code == 401 and json.loads(raw.value.read())["error"]["code"] == "invalid_api_key"
        ok = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
        # Given one --model, it still serves the other model its kv_service knows (token ids only).
        assert [m.id for m in ok.models.list()] == [mesh.a, mesh.b]
        with pytest.raises(openai.BadRequestError, match="no tokenizer for model 'tiny-qwen'"):
            ok.chat.completions.create(model=mesh.b, messages=[{"role": "user", "content": "hi"}])
        assert ok.completions.create(model=mesh.b, prompt=[3, 4, 5], max_tokens=2).usage.completion_tokens == 2
        assert urllib.request.urlopen(f"http://127.0.0.1:{secured.http_port}/health").status == 200
        assert ok.chat.completions.create(model=mesh.a, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).usage.completion_tokens == 2
    finally:
        secured.stop(0.5)


def test_grpc_chat_hashes_the_templated_tokens_and_names_its_model(mesh):
    channel = dial(f"127.0.0.1:{mesh.router.port}")
    stub = router_pb2_grpc.RouterStub(channel)
    try:
        listed = stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)
        assert [(m.id, m.workers, m.tokenizer, m.chat_template) for m in listed.models] == [
            (mesh.a, 1, True, True), (mesh.b, 1, True, True)]
        assert listed.default_model == mesh.a
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "gRPC question"}]
        req = router_pb2.GenerateRequest(
            model=mesh.b, sampling=common_pb2.SamplingParams(max_tokens=6, ignore_eos=True),
            chat=router_pb2.ChatInput(messages=[router_pb2.ChatMessage(**m) for m in messages],
                                      chat_template_kwargs=struct_pb2.Struct(fields={
                                          "enable_thinking": struct_pb2.Value(bool_value=False)})))
        out = list(stub.Generate(req, timeout=30))
        prompt = hf_chat_ids(mesh.dirs[mesh.b], messages)
        assert [t for m in out for t in m.token_ids] == hf_greedy(mesh.dirs[mesh.b], prompt, 6)
        assert out[-1].served_by == "wb" and out[-1].usage.prompt_tokens == len(prompt)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(router_pb2.GenerateRequest(model="nope", text="hi"), timeout=10))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(router_pb2.GenerateRequest(model=mesh.a, chat=router_pb2.ChatInput()), timeout=10))
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                           "messages is empty: send at least one message")
    finally:
        channel.close()


def test_health_and_metrics_are_open_and_metrics_count_http_requests(mesh):
    base = f"http://127.0.0.1:{mesh.router.http_port}"
    assert urllib.request.urlopen(f"{base}/health").status == 200
    before = _ok_requests(base)
    mesh.client().completions.create(model=mesh.a, prompt="x", max_tokens=1)
    assert _ok_requests(base) == before + 1


def _ok_requests(base: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics").read().decode()
    line = next((x for x in text.splitlines() if x.startswith('kvmesh_router_requests_total{outcome="ok"}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_client_that_leaves_mid_stream_frees_the_worker(mesh):
    client = mesh.client()
    engine = mesh.workers["wb"].engine
    stream = client.chat.completions.create(model=mesh.b, messages=[{"role": "user", "content": "go"}],
                                            max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the client goes away
    wait_until(lambda: not engine.has_unfinished_requests(), timeout=20, what="the worker to drop the request")
    wait_until(lambda: mesh.router.frontend.streams == 0, what="the router to close the stream")


def test_concurrent_sdk_requests_all_succeed(mesh):
    client = mesh.client()
    results: list[int] = []

    def one(i: int) -> None:
        r = client.chat.completions.create(model=[mesh.a, mesh.b][i % 2], max_tokens=4, temperature=0.7, seed=i,
                                           messages=[{"role": "user", "content": f"request {i}"}])
        results.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8 and all(0 < n <= 4 for n in results)


def test_curl_style_raw_json(mesh):
    body = json.dumps({"model": mesh.a, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{mesh.router.http_port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(req).read())
    usage = answer["usage"]
    assert answer["object"] == "chat.completion" and 0 < usage["completion_tokens"] <= 3
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    bad = urllib.request.Request(f"http://127.0.0.1:{mesh.router.http_port}/v1/chat/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(bad)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith("the request body is not valid JSON")
