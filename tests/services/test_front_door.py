"""The router's OpenAI HTTP front door against a real stack on loopback (Redis, kv_service, a
tiny-model worker, a token-protected router): bad input refused before it costs anyone anything,
authentication before the body, read timeouts, errors as OpenAI clients expect, and raw SSE.

Speed is benchmarks/front_door.py's business: nothing here asserts on wall time. Where a test
shows that the router answered *before* reading a body, the client simply has not sent the body."""

from __future__ import annotations

import json
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

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
from tests.support import wait_until

TOKEN = "s3cret"
SOCKET_TIMEOUT_S = 60.0
"""A safety net so a broken server fails a test instead of hanging it; never a latency bound."""


@dataclass
class Door:
    router: RouterServer
    model: str
    kv_addr: str
    worker: WorkerServer

    @property
    def port(self) -> int:
        assert self.router.http_port is not None
        return self.router.http_port


@pytest.fixture(scope="module")
def door(redis_server, model_dir) -> Iterator[Door]:
    kv = KVServiceServer(RedisIndex(redis_server.url, f"t{uuid.uuid4().hex[:12]}"), "127.0.0.1", free_port(),
                         ServiceConfig(lease_ttl_ms=5000, reap_interval_s=0.25)).start()
    kv_addr = f"127.0.0.1:{kv.port}"
    engine = LLMEngine(model=str(model_dir), num_blocks=128, max_num_batched_tokens=256, max_model_len=512)
    worker = WorkerServer(engine, "w0", "127.0.0.1", free_port(), kv_addr).start(wait_registered=10)
    security.configure(security.Security(server_token=TOKEN))
    try:
        router = RouterServer(RouterConfig(
            host="127.0.0.1", port=0, http_port=0, kv_service=kv_addr, model_dirs=[str(model_dir)],
            routing=RoutingConfig(discovery_interval_s=0.1, policy_config=PolicyConfig(seed=0)), http_header_timeout_s=1.0, http_body_timeout_s=2.0,
            http_max_unfinished=3)).start()
    finally:
        security.configure(security.Security())
    wait_until(lambda: bool(router.pool.endpoints()), what="the worker")
    yield Door(router, model_dir.name, kv_addr, worker)
    router.stop(0.5)
    worker.stop(0.5)
    kv.stop(0.5)


# -- a raw HTTP/1.1 client: the tests need to send part of a request, or read bytes as they come -----
def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def head(path: str, length: int | None, token: str | None = TOKEN, content_type: str | None = "application/json",
         method: str = "POST", extra: str = "") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)

    @property
    def error(self) -> dict:
        return self.json()["error"]


def read_reply(s: socket.socket) -> Reply:
    """One response (Content-Length or chunked); the connection may then close."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        if not data:
            raise ConnectionError(f"closed before a response: {buf!r}")
        buf += data
    raw_head, rest = buf.split(b"\r\n\r\n", 1)
    lines = raw_head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            data = s.recv(65536)
            if not data:
                break
            rest += data
        return Reply(status, headers, rest[:n])
    body = b""
    while True:  # chunked
        while b"\r\n" not in rest:
            rest += s.recv(65536)
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        while len(rest) < size + 2:
            data = s.recv(65536)
            if not data:
                raise ConnectionError("closed inside a chunk")
            rest += data
        if size == 0:
            return Reply(status, headers, body)
        body, rest = body + rest[:size], rest[size + 2:]


def post(port: int, path: str, payload: bytes | dict, token: str | None = TOKEN,
         content_type: str | None = "application/json") -> Reply:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    with connect(port) as s:
        s.sendall(head(path, len(body), token, content_type) + body)
        return read_reply(s)


def get(port: int, path: str, token: str | None = TOKEN, method: str = "GET") -> Reply:
    with connect(port) as s:
        s.sendall(head(path, None, token, None, method=method))
        return read_reply(s)


def chat(door: Door, **kw) -> dict:
    return {"model": door.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | kw


def closed_by_server(s: socket.socket) -> bool:
    """Reads to the end: True when the server closed the connection (EOF or reset)."""
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


# -- bad input refused while normal requests run ------------------------------------------------------
BAD_INPUTS = {
    "100k messages": (dict(messages=[{"role": "user", "content": "a"}] * 100_000), True, 400, "messages",
                      "--max-messages"),
    "1M messages": (dict(messages=[{"role": "user", "content": "a"}] * 1_000_000), True, 400, "messages",
                    "--max-messages"),
    "1M content parts": (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 1_000_000}]),
                         True, 400, "messages[0].content", "--max-content-parts"),
    "30 MB of stop strings": (dict(stop=["x" * 250] * 120_000), True, 400, "stop", "at most 16"),
    "1M messages, no token": (dict(messages=[{"role": "user", "content": "a"}] * 1_000_000), False, 401, None,
                              "API key"),
}


def test_bad_inputs_are_refused_before_their_bodies_arrive_while_normal_requests_run(door):
    results: list[dict] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def normal() -> None:
        try:
            while not stop.is_set():
                r = post(door.port, "/v1/chat/completions", chat(door))
                assert r.status == 200, r.body
                results.append(r.json())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    clients = [threading.Thread(target=normal) for _ in range(2)]
    for t in clients:
        t.start()
    try:
        for name, (extra, with_token, status, param, words) in BAD_INPUTS.items():
            body = json.dumps(chat(door, **extra)).encode()
            assert len(body) > 3_000_000, name
            with connect(door.port) as s:
                # NOTE: a tenth of the body, then wait: the answer must come from what was sent. A router that
                # buffered the whole body (or parsed it whole) before refusing would never answer here.
                s.sendall(head("/v1/chat/completions", len(body), TOKEN if with_token else None)
                          + body[: len(body) // 10])
                r = read_reply(s)
            assert r.status == status, (name, r.body[:300])
            assert r.error["param"] == param and words in r.error["message"], (name, r.error)
    finally:
        stop.set()
        for t in clients:
            t.join(SOCKET_TIMEOUT_S)
    assert not errors, errors
    assert results and all(r["usage"]["completion_tokens"] == 2 for r in results)
    # The router is still whole: a normal request after all that.
    assert post(door.port, "/v1/chat/completions", chat(door)).status == 200


def test_grpc_chat_counts_messages_before_making_them(door):
    import grpc

    from kvmesh.transport.channels import dial
    from kvmesh.v1 import router_pb2, router_pb2_grpc

    security.configure(security.Security(client_token=TOKEN))
    try:
        channel = dial(f"127.0.0.1:{door.router.port}")
    finally:
        security.configure(security.Security())
    stub = router_pb2_grpc.RouterStub(channel)
    try:
        many = router_pb2.ChatInput(messages=[router_pb2.ChatMessage(role="user", content="a")] * 5000)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(router_pb2.GenerateRequest(model=door.model, chat=many), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-messages" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(router_pb2.GenerateRequest(model=door.model, text="hi", stop=["x"] * 17), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 16" in err.value.details()
    finally:
        channel.close()


# -- authentication first -------------------------------------------------------------------------------
def test_a_request_without_the_token_gets_401_before_its_body_is_read(door):
    # Malformed JSON without a token: 401, not 400 (the body is not looked at).
    r = post(door.port, "/v1/chat/completions", b"{not json", token=None)
    assert r.status == 401 and r.error["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"].startswith("Bearer")
    # A 32 MB body without a token: the 401 comes back before a byte of the body is sent.
    with connect(door.port) as s:
        s.sendall(head("/v1/chat/completions", 32_000_000, None))
        r = read_reply(s)
    assert r.status == 401 and r.error["type"] == "authentication_error"
    # Wrong token, lowercase scheme with the right one (RFC 7235: schemes are case-insensitive).
    assert post(door.port, "/v1/completions", {"prompt": "x"}, token="nope").status == 401
    with connect(door.port) as s:
        body = json.dumps(chat(door)).encode()
        s.sendall(head("/v1/chat/completions", len(body), None, extra=f"authorization: bearer {TOKEN}\r\n") + body)
        assert read_reply(s).status == 200
    assert get(door.port, "/v1/models", token=None).status == 401
    assert get(door.port, "/health", token=None).status == 200


def test_a_declared_body_over_the_limit_is_413_unread(door):
    with connect(door.port) as s:
        s.sendall(head("/v1/chat/completions", 65 * 1024 * 1024))
        r = read_reply(s)
        assert r.status == 413 and "--max-body-bytes" in r.error["message"]
        assert r.headers["connection"] == "close" and closed_by_server(s)


# -- read timeouts ----------------------------------------------------------------------------------------
def test_slow_requests_are_closed_at_the_header_and_body_timeouts(door):
    # Half a request line, then nothing: 408 once --http-header-timeout (1 s here) has passed.
    with connect(door.port) as s:
        s.sendall(b"POST /v1/chat/com")
        r = read_reply(s)
        assert r.status == 408 and "--http-header-timeout" in r.error["message"] and closed_by_server(s)
    # Headers but never all of the body: 408 at --http-body-timeout.
    with connect(door.port) as s:
        s.sendall(head("/v1/chat/completions", 1000) + b'{"model": ')
        r = read_reply(s)
        assert r.status == 408 and "--http-body-timeout" in r.error["message"] and closed_by_server(s)
    # A connection that sends nothing is closed (nothing to answer).
    with connect(door.port) as s:
        assert s.recv(100) == b""
    # The router serves on.
    assert post(door.port, "/v1/chat/completions", chat(door)).status == 200


def test_a_client_holding_unfinished_requests_is_capped(door):
    held = [connect(door.port) for _ in range(3)]  # --http-max-unfinished 3
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\n")  # never finished
        wait_until(lambda: door.router.http.guard.stale.get("127.0.0.1", 0) >= 3, timeout=10,
                   what="the held connections to count as unfinished")
        with connect(door.port) as s:
            r = read_reply(s)
            assert r.status == 429 and "--http-max-unfinished" in r.error["message"]
    finally:
        for s in held:
            s.close()
    wait_until(lambda: not door.router.http.guard.stale.get("127.0.0.1"), what="the count to drop")
    assert get(door.port, "/health").status == 200


# -- errors as OpenAI clients expect ---------------------------------------------------------------------
@pytest.mark.parametrize("extra, param, words", [
    (dict(seed=2**70), "seed", "seed is out of range"),
    (dict(seed=-1), "seed", "seed must be an integer in [0, 2**64)"),
    (dict(top_k=2**40), "top_k", "top_k must be an integer in [0, 2**31)"),
    (dict(stop_token_ids=[2**40]), "stop_token_ids", "stop_token_ids[0]"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", "stop_token_ids[0]"),
    (dict(temperature=1e308), "temperature", "32-bit float"),
    (dict(max_completion_tokens=0), "max_completion_tokens", "max_completion_tokens must be"),
    (dict(tool_choice="auto"), "tool_choice", "function calling"),
    (dict(tool_choice="none"), "tool_choice", "function calling"),
    (dict(functions=[{"name": "f"}]), "functions", "function calling"),
    (dict(tools=[]), "tools", "function calling"),
    (dict(top_logprobs=2), "top_logprobs", "needs logprobs"),
    (dict(messages=[{"content": "no role"}]), "messages[0].role", "messages[0].role: Field required"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]), "messages[0].tool_calls",
     "function calling"),
    (dict(model="nope"), "model", "does not exist"),
    (dict(chat_template_kwargs={"messages": 1}), "chat_template_kwargs", "may not set messages"),
])
def test_each_refusal_names_its_parameter(door, extra, param, words):
    r = post(door.port, "/v1/chat/completions", chat(door, **extra))
    assert r.status in (400, 404), r.body
    assert r.error["param"] == param and words in r.error["message"], r.error
    assert "jinja2" not in r.error["message"] and "/" not in r.error["message"].replace("/v1", "")


@pytest.mark.parametrize("prompt, param", [([1, -1], "prompt"), ([1, 2**40], "prompt"), ("x" * 100_000, "prompt")])
def test_completion_prompts_out_of_range_name_the_prompt(door, prompt, param):
    r = post(door.port, "/v1/completions", {"model": door.model, "prompt": prompt, "max_tokens": 2})
    assert r.status == 400 and r.error["param"] == param, r.error
    assert "Value out of range" not in r.error["message"]


def test_ids_outside_the_vocabulary_are_refused_by_the_router_naming_the_first(door):
    """Issue 35: the router checks prompt ids against the model's vocabulary before routing (660 ids
    here): 400 naming the first bad one, in the router's words (the worker's would say "prompt token 2")."""
    r = post(door.port, "/v1/completions", {"model": door.model, "prompt": [5, 6, 700, 9000], "max_tokens": 2})
    assert r.status == 400 and r.error["param"] == "prompt", r.error
    assert "[2] is 700: outside the vocabulary of model 'tiny-llama' (ids 0 to 659)" in r.error["message"]


def test_malformed_requests_get_messages_that_say_what_to_fix(door):
    r = post(door.port, "/v1/chat/completions", b'{"model": "x", "messages": [}')
    assert r.status == 400 and r.error["message"].startswith("the request body is not valid JSON")
    assert r.error["param"] == "messages[0]"
    r = post(door.port, "/v1/chat/completions", json.dumps(chat(door)).encode(),
             content_type="application/x-www-form-urlencoded")
    assert r.status == 415 and "Content-Type: application/json" in r.error["message"]
    assert post(door.port, "/v1/chat/completions", json.dumps(chat(door)).encode(), content_type=None).status == 200
    r = get(door.port, "/v1/chat/completions")
    assert r.status == 405 and r.error["type"] == "invalid_request_error" and "use POST" in r.error["message"]
    assert r.headers["allow"] == "POST"
    r = get(door.port, "/v2/chat")
    assert r.status == 404 and r.error["type"] == "invalid_request_error"


def test_models_and_health_say_what_they_serve_and_no_paths(door):
    models = get(door.port, "/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(door.model, door.model)]
    assert get(door.port, f"/v1/models/{door.model}").json()["root"] == door.model
    health = get(door.port, "/health", token=None)
    assert health.status == 200 and health.json() == {"status": "ok", "models": [{"id": door.model, "workers": 1}]}


# -- server-sent events end with [DONE], nothing after -----------------------------------------------------
def sse_events(port: int, path: str, payload: dict) -> tuple[list[str], bytes]:
    """The events of one streamed response, and the raw body (to see that nothing follows [DONE])."""
    r = post(port, path, payload)
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream"), r.body[:300]
    text = r.body.decode()
    assert text.endswith("\n\n")
    return text[:-2].split("\n\n"), r.body


@pytest.mark.parametrize("path, payload", [
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "tell"}])),
    ("/v1/completions", dict(prompt="Once upon a time")),
])
def test_a_stream_ends_with_exactly_one_done_and_carries_usage(door, path, payload):
    events, raw = sse_events(door.port, path, {"model": door.model, "max_tokens": 5, "stream": True,
                                              "ignore_eos": True, "stream_options": {"include_usage": True},
                                              **payload})
    assert events[-1] == "data: [DONE]" and raw.endswith(b"data: [DONE]\n\n")
    assert events.count("data: [DONE]") == 1
    objects = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    usage = objects[-1]["usage"]
    assert objects[-1]["choices"] == [] and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5 > 5
    finishes = [c["finish_reason"] for o in objects for c in o["choices"] if c["finish_reason"]]
    assert finishes == ["length"]


def test_a_stream_that_fails_midway_ends_with_an_error_event_then_done(door, tmp_path):
    other = make_model(tmp_path / "tiny-other", ModelSpec(arch="llama", layers=2, hidden_size=64, heads=4, kv_heads=2,
                                                           intermediate_size=128, max_position_embeddings=2048,
                                                           seed=3, init_std=0.05))
    engine = LLMEngine(model=str(other), num_blocks=256, max_num_batched_tokens=256, max_model_len=2048)
    worker = WorkerServer(engine, "w-doomed", "127.0.0.1", free_port(), door.kv_addr).start(wait_registered=10)
    try:
        wait_until(lambda: any(m.model_id == other.name and m.pool.endpoints() for m in door.router.models.all()),
                   what="the router to see the other model")
        body = json.dumps({"model": other.name, "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        with connect(door.port) as s:
            s.sendall(head("/v1/completions", len(body)) + body)
            first = s.recv(65536)
            assert b" 200 " in first.split(b"\r\n", 1)[0]
            worker.stop(0)  # the worker goes away mid-stream
            raw = first
            while True:
                data = s.recv(65536)
                if not data:
                    break
                raw += data
                if raw.endswith(b"0\r\n\r\n"):
                    break
    finally:
        worker.stop(0)
    # De-chunk the body.
    payload, rest = b"", raw.split(b"\r\n\r\n", 1)[1]
    while rest:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            break
        payload, rest = payload + rest[:size], rest[size + 2:]
    events = payload.decode().removesuffix("\n\n").split("\n\n")
    assert events[-1] == "data: [DONE]" and payload.endswith(b"data: [DONE]\n\n")
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable_error" and "failed mid-stream" in error["message"]
    assert all("error" not in json.loads(e.removeprefix("data: ")) for e in events[:-2])


# -- lingering close: early answers reach clients that send the whole body first (issue 35) -------------
def ten_mb_body(door: Door, messages: int) -> bytes:
    """A chat body of ~10 MB: ``messages`` messages, padded to 10 MB with their content."""
    content = "a" * max(1, 10_000_000 // messages)
    body = json.dumps(chat(door, messages=[{"role": "user", "content": content}] * messages)).encode()
    assert len(body) >= 10_000_000
    return body


def urllib_post(door: Door, body: bytes, token: str | None, content_type: str = "application/json",
                port: int | None = None) -> tuple[int, dict]:
    """urllib sends the whole body before it reads a byte of the answer."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": content_type} | ({"Authorization": f"Bearer {token}"} if token else {})
    req = urllib.request.Request(f"http://127.0.0.1:{port or door.port}/v1/chat/completions", body, headers)
    try:
        with urllib.request.urlopen(req, timeout=SOCKET_TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize(("token", "messages", "status", "words"), [
    (None, 10, 401, "API key"),  # no token: refused before the body is read
    (TOKEN, 300_000, 400, "--max-messages"),  # refused by the streaming parser at the message past the limit
], ids=["no token", "too many messages"])
def test_urllib_and_httpx_sending_10_mb_read_the_early_answer(door, token, messages, status, words):
    # NOTE: httpx as the openai SDK (3.x) ships it, under the distribution name httpx2.
    import httpx2 as httpx

    body = ten_mb_body(door, messages)
    got, answer = urllib_post(door, body, token)
    assert got == status and words in answer["error"]["message"], answer
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    with httpx.Client(timeout=SOCKET_TIMEOUT_S) as client:
        r = client.post(f"http://127.0.0.1:{door.port}/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
        assert r.headers["connection"] == "close"
        # The client's next request, on a new connection, is served.
        ok = client.post(f"http://127.0.0.1:{door.port}/v1/chat/completions", json=chat(door),
                         headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200
    # Not JSON: 415 before the body, read all the same.
    got, answer = urllib_post(door, body, TOKEN, content_type="text/plain")
    assert got == 415 and "application/json" in answer["error"]["message"]
    # On Linux the rest of each body was dropped in the kernel (MSG_TRUNC), never copied to the loop.
    lingered = door.router.http.guard.lingered
    assert lingered["kernel"] >= 3 if sys.platform == "linux" else lingered["read"] >= 3, lingered


def test_a_413_reaches_urllib_and_the_linger_bounds_hold(door, model_dir):
    """A declared body over --max-body-bytes: 413, read by urllib after it sent 10 MB. Past
    --http-linger-bytes the connection is closed without reading on (the client then sees a reset)."""
    security.configure(security.Security(server_token=TOKEN))
    try:
        small = RouterServer(RouterConfig(
            host="127.0.0.1", port=0, http_port=0, kv_service=door.kv_addr, model_dirs=[str(model_dir)],
            max_body_bytes=4_000_000, http_linger_bytes=12_000_000)).start()
        tight = RouterServer(RouterConfig(
            host="127.0.0.1", port=0, http_port=0, kv_service=door.kv_addr, model_dirs=[str(model_dir)],
            http_linger_bytes=1_000_000)).start()
    finally:
        security.configure(security.Security())
    try:
        body = ten_mb_body(door, 10)
        got, answer = urllib_post(door, body, TOKEN, port=small.http_port)
        assert got == 413 and "--max-body-bytes" in answer["error"]["message"]
        got, answer = urllib_post(door, body, None, port=small.http_port)
        assert got == 401  # the token first, the size after
        import urllib.error

        with pytest.raises((ConnectionError, urllib.error.URLError)):
            urllib_post(door, body, None, port=tight.http_port)  # 10 MB past a 1 MB linger: reset
        # Lingering connections are not unfinished requests: nothing is left counted.
        assert not small.http.guard.stale and not tight.http.guard.stale
    finally:
        small.stop(0.5)
        tight.stop(0.5)
