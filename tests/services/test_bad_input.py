"""Issue #17 on real processes: what one client's bad input gets, and that it hurts no one else.

One stack per module, every part its own process (the `kvmesh up` children: a private Redis, a
kv_service with 3 s leases, one tiny-model worker, a router on default flags), plus a second
router with the prompt bounds off (``--max-prompt-tokens 0 --max-prompt-bytes 0``). Requests are
built from raw bytes where a well-behaved client library could not send them (invalid UTF-8).
Each test here fails without its fix (issue #17 lists them); none asserts on wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.loopback import die_with_parent, free_port, free_port_run
from kvmesh.stack import LocalStack, StackConfig, kvmesh_cmd, wait_serving
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from tests.support import varint, wait_until
from tests.support import wire_field as field

KVMESH = str(Path(sys.executable).parent / "kvmesh")
MODEL_ID = "tiny-llama"
LEASE_MS = 3000
C = grpc.StatusCode


class Mesh:
    def __init__(self, stack: LocalStack, metrics_base: int, open_router: str, open_metrics: int) -> None:
        self.stack = stack
        self.router = stack.endpoints["router"]
        self.kv = stack.endpoints["kv_service"]
        self.worker = stack.endpoints["worker-0"]
        self.router_metrics = metrics_base + 1
        self.open_router = open_router
        """The router with the prompt bounds off."""
        self.open_metrics = open_metrics

    def log(self, name: str) -> str:
        return (self.stack.log_dir / f"{name}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory) -> Iterator[Mesh]:
    base = free_port_run(3)
    logs = tmp_path_factory.mktemp("bad-input-logs")
    cfg = StackConfig(model=str(model_dir), workers=1, router_port=free_port(), kv_service_port=free_port(),
                      worker_port=free_port(), metrics_port=base, log_dir=str(logs),
                      kv_service_args=[f"--lease-ttl-ms={LEASE_MS}"],
                      worker_args=["--num-blocks=128", "--max-model-len=512", "--torch-threads=1"],
                      router_args=["--discovery-interval=0.2"])
    stack = LocalStack(cfg).start()
    port, metrics = free_port(), free_port()
    with open(logs / "open-router.log", "w") as out:
        proc = subprocess.Popen([*die_with_parent(), *kvmesh_cmd(
            "router", "--host", "127.0.0.1", "--port", str(port), "--kv-service", stack.endpoints["kv_service"],
            "--model", str(model_dir), "--max-prompt-tokens", "0", "--max-prompt-bytes", "0",
            "--discovery-interval", "0.2", "--metrics-port", str(metrics))], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"127.0.0.1:{port}", proc, 60)
        yield Mesh(stack, base, f"127.0.0.1:{port}", metrics)
    finally:
        proc.terminate()
        proc.wait(10)
        stack.stop()


# -- helpers ---------------------------------------------------------------------------------------
def metrics(port: int) -> dict[str, float]:
    """``name{label="v",...}`` -> value of every sample on a /metrics page."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def fallbacks(port: int) -> dict[str, float]:
    return {k: v for k, v in metrics(port).items() if k.startswith("kvmesh_router_fallbacks_total")}


def generate(address: str, timeout: float = 60, **fields) -> list[router_pb2.GenerateResponse]:
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        return list(router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(**fields), timeout=timeout))


def status_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details() or ""


def raw_unary(address: str, method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            call(data, timeout=10)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
    return C.OK, ""


def raw_stream(address: str, method: str, data: bytes, client_streaming: bool = False) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as ch:
        if client_streaming:
            call = ch.stream_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            responses = call(iter([data]), timeout=10)
        else:
            call = ch.unary_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            responses = call(data, timeout=10)
        try:
            list(responses)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
    return C.OK, ""


PROMPT = [(7 * i + 3) % 600 + 3 for i in range(64)]  # 4 full blocks of 16


# -- 1. a huge text is refused early, and tokenizing never holds up the others ---------------------
def test_huge_text_is_refused_before_the_tokenizer_sees_it(mesh):
    before = metrics(mesh.router_metrics)
    # 5 MB against a byte bound of 32 x 511: refused without tokenizing anything.
    code, msg = status_of(lambda: generate(mesh.router, text="a " * 2_500_000))
    assert code == C.RESOURCE_EXHAUSTED and "--max-prompt-bytes" in msg
    after = metrics(mesh.router_metrics)
    assert after["kvmesh_router_tokenized_chars_total"] == before["kvmesh_router_tokenized_chars_total"]
    assert after['kvmesh_router_prompts_refused_total{limit="bytes"}'] == 1
    # Under the byte bound but far over the model's context of 512 tokens: the tokenizer stops in
    # the first piece of the text instead of tokenizing all of it.
    text = "a " * 8000
    code, msg = status_of(lambda: generate(mesh.router, text=text))
    assert code == C.INVALID_ARGUMENT and "more than 511 tokens" in msg and "context is 512" in msg
    seen = metrics(mesh.router_metrics)["kvmesh_router_tokenized_chars_total"] - after["kvmesh_router_tokenized_chars_total"]
    assert 0 < seen < len(text) / 2
    ok = generate(mesh.router, text="Hello there", sampling=common_pb2.SamplingParams(max_tokens=2))
    assert ok[-1].usage.completion_tokens == 2


def test_a_long_tokenization_never_holds_up_other_requests(mesh):
    """The router with the bounds off tokenizes a 600 kB text (seconds of tokenizer work); requests
    sent while it is being tokenized complete while it still is (its gauge says so). With the
    tokenizer holding the GIL (``Tokenizer.encode`` on a thread) they waited for it to end."""
    outcome: dict[str, object] = {}

    def bad() -> None:
        try:
            generate(mesh.open_router, text="a " * 300_000, timeout=120)
            outcome["code"] = C.OK
        except grpc.RpcError as err:
            outcome["code"] = err.code()

    thread = threading.Thread(target=bad)
    thread.start()
    try:
        tokenizing = "kvmesh_router_tokenizing_texts"
        wait_until(lambda: metrics(mesh.open_metrics)[tokenizing] == 1, 60, "the long text to be tokenizing")
        for i in range(3):
            out = generate(mesh.open_router, token_ids=router_pb2.TokenIds(ids=PROMPT[: 20 + i]),
                           sampling=common_pb2.SamplingParams(max_tokens=2))
            assert out[-1].usage.completion_tokens == 2
        assert metrics(mesh.open_metrics)[tokenizing] == 1, "the long text finished tokenizing first"
    finally:
        thread.join(120)
    # 300k tokens do not fit the worker's max_model_len: its refusal comes back.
    assert outcome["code"] == C.INVALID_ARGUMENT


# -- 2. an oversized prompt never switches the index off ----------------------------------------------
def test_oversized_prompt_is_refused_before_the_lookup_and_the_index_stays_on(mesh):
    """1,048,592 ids (65,537 blocks, over the kv_service's Lookup bound): refused by the router
    before any Lookup, and the next requests of everyone still use the index (no fallback)."""
    generate(mesh.router, token_ids=router_pb2.TokenIds(ids=PROMPT), sampling=common_pb2.SamplingParams(max_tokens=1))
    before = fallbacks(mesh.router_metrics)
    lookups = metrics(mesh.router_metrics)["kvmesh_router_lookup_latency_seconds_count"]
    code, msg = status_of(lambda: generate(mesh.router, token_ids=router_pb2.TokenIds(ids=[5] * 1_048_592)))
    assert code == C.INVALID_ARGUMENT and "1048592 tokens" in msg and "context is 512" in msg, msg
    for n in range(3):
        generate(mesh.router, token_ids=router_pb2.TokenIds(ids=PROMPT[: 48 + n]),
                 sampling=common_pb2.SamplingParams(max_tokens=1))
    assert fallbacks(mesh.router_metrics) == before, "a request routed without the index"
    assert metrics(mesh.router_metrics)["kvmesh_router_lookup_latency_seconds_count"] == lookups + 3


# -- 3. ids are bounded; a status message quotes at most an excerpt -------------------------------------
def test_oversized_ids_get_a_short_invalid_argument_and_the_channel_keeps_working(mesh):
    big = "w" * 70_000
    kv = kpb_grpc.KVServiceStub(dial(mesh.kv))
    worker = worker_pb2_grpc.WorkerStub(dial(mesh.worker))
    router = router_pb2_grpc.RouterStub(dial(mesh.router))
    calls = {
        "FlushWorker": lambda: kv.FlushWorker(kpb.FlushWorkerRequest(worker_id=big), timeout=10),
        "Heartbeat": lambda: kv.Heartbeat(kpb.HeartbeatRequest(worker_id=big, epoch=1), timeout=10),
        "RegisterWorker": lambda: kv.RegisterWorker(kpb.RegisterWorkerRequest(
            worker_id="ok", address=big, model_id=MODEL_ID, block_size=16, hash_algorithm=1, num_blocks=8,
            epoch=1), timeout=10),
        "LookupTokens": lambda: kv.LookupTokens(kpb.LookupTokensRequest(model_id=big, token_ids=PROMPT), timeout=10),
        "Lookup": lambda: kv.Lookup(kpb.LookupRequest(model_id=big, block_hashes=[b"x" * 16]), timeout=10),
        "Worker.Generate": lambda: list(worker.Generate(worker_pb2.WorkerGenerateRequest(
            request_id=big, prompt_token_ids=[5, 6]), timeout=10)),
        "Worker.Abort": lambda: worker.Abort(worker_pb2.AbortRequest(request_id=big), timeout=10),
        "Router.Generate id": lambda: list(router.Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=[5, 6]), request_id=big), timeout=10)),
        "Router.Generate salt": lambda: list(router.Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=[5, 6]), cache_salt=big), timeout=10)),
    }
    for name, call in calls.items():
        code, msg = status_of(call)
        assert code == C.INVALID_ARGUMENT, f"{name}: {code.name} {msg[:200]}"
        assert len(msg.encode()) <= 300 and big[:100] not in msg, f"{name}: {len(msg)} bytes"
    # The same channels answer the next calls at once.
    assert kv.GetStats(kpb.GetStatsRequest(), timeout=10).live_workers == 1
    assert worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=10).model_id == MODEL_ID
    assert list(router.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6]), sampling=
                                                           common_pb2.SamplingParams(max_tokens=1)), timeout=60))


# -- 4. invalid UTF-8 is INVALID_ARGUMENT naming the field, on every service ------------------------------
def test_invalid_utf8_is_invalid_argument_naming_the_field_on_every_service(mesh):
    bad = b"ab\xff\xfe"
    ids = field(2, b"".join(varint(i) for i in (5, 6, 7)))  # GenerateRequest.token_ids (TokenIds)
    cases = [
        (mesh.router, "/kvmesh.v1.Router/Generate", field(1, bad), "text", False),
        (mesh.router, "/kvmesh.v1.Router/Generate", field(2, field(1, b"\x05\x06")) + field(4, bad), "cache_salt",
         False),
        (mesh.router, "/kvmesh.v1.Router/Generate", ids + field(5, bad), "request_id", False),
        (mesh.worker, "/kvmesh.v1.Worker/Generate", field(1, bad), "request_id", False),
        (mesh.worker, "/kvmesh.v1.Worker/Generate", field(4, bad), "cache_salt", False),
        (mesh.worker, "/kvmesh.v1.Worker/Abort", field(1, bad), "request_id", None),
        (mesh.kv, "/kvmesh.v1.KVService/RegisterWorker", field(1, b"w") + field(3, bad), "model_id", None),
        (mesh.kv, "/kvmesh.v1.KVService/Heartbeat", field(1, bad), "worker_id", None),
        (mesh.kv, "/kvmesh.v1.KVService/LookupTokens", field(1, MODEL_ID.encode()) + field(3, bad), "cache_salt", None),
        (mesh.kv, "/kvmesh.v1.KVService/FlushWorker", field(1, bad), "worker_id", None),
        (mesh.kv, "/kvmesh.v1.KVService/PublishEvents", field(1, bad), "worker_id", True),
        (mesh.kv, "/grpc.health.v1.Health/Check", field(1, bad), "service", None),
    ]
    for address, method, data, name, streaming in cases:
        if streaming is None:
            code, msg = raw_unary(address, method, data)
        else:
            code, msg = raw_stream(address, method, data, client_streaming=streaming)
        assert code == C.INVALID_ARGUMENT, f"{method} {name}: {code.name} {msg}"
        assert msg.startswith(f"{name} is not valid UTF-8"), f"{method}: {msg}"
    for log in ("router", "worker-0", "kv_service"):
        assert "Exception deserializing" not in mesh.log(log), log


# -- 5 / 7. a duplicate request id is ALREADY_EXISTS; an aborted request reports its real usage -----------
def test_duplicate_request_id_and_aborted_usage(mesh):
    worker = worker_pb2_grpc.WorkerStub(dial(mesh.worker))
    prompt = PROMPT[:30]  # one full block of 16, cached by the first request
    list(worker.Generate(worker_pb2.WorkerGenerateRequest(
        request_id="warm", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=60))
    stream = worker.Generate(worker_pb2.WorkerGenerateRequest(
        request_id="dup-1", prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)), timeout=120)
    got = [next(stream) for _ in range(3)]
    assert all(m.token_ids for m in got)
    code, msg = status_of(lambda: list(worker.Generate(worker_pb2.WorkerGenerateRequest(
        request_id="dup-1", prompt_token_ids=[5, 6]), timeout=10)))
    assert code == C.ALREADY_EXISTS and "'dup-1' is already in use" in msg
    assert worker.Abort(worker_pb2.AbortRequest(request_id="dup-1"), timeout=10).aborted
    rest = list(stream)
    last = rest[-1]
    completion = sum(len(m.token_ids) for m in got + rest)
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert (last.usage.prompt_tokens, last.usage.cached_tokens) == (30, 16)
    # NOTE: a token sampled in the step the abort lands in may be counted and not sent, or neither.
    assert 3 <= last.usage.completion_tokens <= completion + 1


# -- 8. reflection v1 as well as v1alpha ---------------------------------------------------------------
@pytest.mark.parametrize("part", ["router", "worker", "kv"])
def test_reflection_v1_and_v1alpha_on_every_server(mesh, part):
    address, service = {"router": (mesh.router, "kvmesh.v1.Router"), "worker": (mesh.worker, "kvmesh.v1.Worker"),
                        "kv": (mesh.kv, "kvmesh.v1.KVService")}[part]
    with grpc.insecure_channel(address) as ch:
        for version in ("v1", "v1alpha"):
            call = ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                    request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                    response_deserializer=rpb.ServerReflectionResponse.FromString)
            listed, described = call(iter([rpb.ServerReflectionRequest(list_services=""),
                                           rpb.ServerReflectionRequest(file_containing_symbol=service)]), timeout=10)
            names = {s.name for s in listed.list_services_response.service}
            assert {service, "grpc.reflection.v1.ServerReflection", "grpc.health.v1.Health"} <= names, version
            assert described.WhichOneof("message_response") == "file_descriptor_response", version


# -- 10. the request id in the stream, the trailers and both logs -----------------------------------------
def test_request_id_is_echoed_and_logged_by_router_and_worker(mesh):
    with grpc.insecure_channel(mesh.router) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=PROMPT[:20]), request_id="trace-me",
            sampling=common_pb2.SamplingParams(max_tokens=3)), timeout=60)
        msgs = list(call)
        trailer = dict(call.trailing_metadata())["kvmesh-request-id"]
    rid = msgs[0].request_id
    assert rid.startswith("trace-me-") and len(rid) == len("trace-me-") + 12 and rid == trailer
    assert all(not m.request_id for m in msgs[1:])
    wait_until(lambda: f"request {rid}: length on worker-0" in mesh.log("router"), 10, "the router's log line")
    wait_until(lambda: f"request {rid}: length, prompt 20" in mesh.log("worker-0"), 10, "the worker's log line")
    # A refused request's id is in the trailers and the router's log too.
    with grpc.insecure_channel(mesh.router) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=[10**6]), request_id="bad-one"), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        rid = dict(err.value.trailing_metadata())["kvmesh-request-id"]
    assert rid.startswith("bad-one-")
    wait_until(lambda: f"request {rid}: InvalidArgument" in mesh.log("router"), 10, "the refusal's log line")


# -- 11. public messages name no internal address -----------------------------------------------------------
def test_worker_errors_reach_clients_without_internal_topology(mesh):
    port = mesh.worker.rsplit(":", 1)[1]
    for fields, words in [
        ({"token_ids": router_pb2.TokenIds(ids=[5, 10**6])}, "outside the vocabulary"),
        ({"token_ids": router_pb2.TokenIds(ids=[5] * 20), "sampling": common_pb2.SamplingParams(max_tokens=500)},
         "ask for at most 492"),
    ]:
        code, msg = status_of(lambda f=fields: generate(mesh.router, **f))
        assert code == C.INVALID_ARGUMENT and words in msg, msg
        assert "worker-0" not in msg and "127.0.0.1" not in msg and port not in msg, msg


# -- 12. admin flush leaves index and worker consistent -----------------------------------------------------
def test_admin_flush_is_followed_by_a_resync_of_the_worker(mesh):
    kv = kpb_grpc.KVServiceStub(dial(mesh.kv))

    def matched() -> int:
        answer = kv.LookupTokens(kpb.LookupTokensRequest(model_id=MODEL_ID, token_ids=PROMPT), timeout=10)
        return max((w.matched_blocks for w in answer.workers), default=0)

    def indexed() -> int:
        return {w.worker_id: w.blocks_indexed for w in kv.ListWorkers(kpb.ListWorkersRequest(), timeout=10).workers}[
            "worker-0"]

    generate(mesh.router, token_ids=router_pb2.TokenIds(ids=PROMPT), sampling=common_pb2.SamplingParams(max_tokens=1))
    wait_until(lambda: matched() == 4, 10, "the index to learn the prompt")
    held = indexed()
    out = subprocess.run([KVMESH, "admin", "flush", "worker-0", "--kv-service", mesh.kv, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["blocks_removed"] == held > 0
    # The idle worker is told at its next heartbeat (a third of the 3 s lease) and sends its cache.
    wait_until(lambda: matched() == 4 and indexed() == held, 10, "the worker to resync after the flush")
    assert "flushed this worker's blocks; sending a snapshot" in mesh.log("worker-0")
