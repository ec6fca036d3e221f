"""The HTTP side's tables and conversions: statuses of kvmesh errors, OpenAI bodies -> GenerateInput."""

from __future__ import annotations

import re

import pytest

from kvmesh.contract import errors
from kvmesh.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.transport import http, rpc


def test_every_error_grpc_maps_has_an_http_status_and_limits_are_400_not_429():
    for cls in rpc.STATUS_OF:
        assert http.status_for(cls("x"))[0] != 500, cls
    assert [http.status_for(e("m")) for e in (errors.InvalidArgument, errors.NotFound, errors.RequestTooLarge,
                                                errors.ResourceExhausted, errors.Unavailable,
                                                errors.Unauthenticated)] == [
        (400, "m"), (404, "m"), (400, "m"), (429, "m"), (503, "m"), (401, "m")]
    # gRPC keeps RESOURCE_EXHAUSTED for a request over a limit.
    assert rpc.status_for(errors.RequestTooLarge("m"))[0] == rpc.grpc.StatusCode.RESOURCE_EXHAUSTED
    assert http.status_for(RuntimeError("secret detail")) == (500, "internal error (RuntimeError); see the server log")
    assert http.error_body(404, "gone", code="model_not_found") == {
        "error": {"message": "gone", "type": "invalid_request_error", "param": None, "code": "model_not_found"}}


def test_bearer_check():
    assert http.check_bearer(None, None) is None
    assert http.check_bearer("Bearer t", "t") is None
    assert http.check_bearer("Bearer u", "t").startswith("wrong API key")
    assert http.check_bearer(None, "t").startswith("missing API key")


def test_chat_body_to_input():
    body = ChatCompletionRequest(model="m", messages=[
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_tokens=5, max_completion_tokens=7, stop="END", top_k=-1, cache_salt="tenant", ignore_eos=True,
        chat_template_kwargs={"x": 1}, add_generation_prompt=True, unknown_field=3)
    inp = body.to_input("rid")
    assert inp.chat is not None and [dict(m) for m in inp.chat.messages] == [
        {"role": "system", "content": "S", "name": None}, {"role": "user", "content": "a\nb", "name": None}]
    assert inp.chat.template_kwargs == {"x": 1} and inp.chat.add_generation_prompt
    s = inp.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.ignore_eos) == (7, 1.0, 0, True)  # OpenAI's default temperature
    assert (inp.stop, inp.cache_salt, inp.request_id) == (["END"], "tenant", "rid")


@pytest.mark.parametrize("extra, message", [
    (dict(n=3), "n=3"),
    (dict(logprobs=True), "logprobs are not supported"),
    (dict(presence_penalty=0.5), "presence_penalty is not supported"),
    (dict(tools=[{"type": "function"}]), "tools are not supported"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "has a 'image_url' part"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative"),
])
def test_chat_bodies_kvmesh_cannot_honour_are_refused_by_name(extra, message):
    body = ChatCompletionRequest(**({"model": "m", "messages": [{"role": "user", "content": "x"}]} | extra))
    with pytest.raises(ValueError, match=re.escape(message)):
        body.to_input("r")


def test_completion_prompts():
    assert CompletionRequest(prompt="hi").to_input("r").text == "hi"
    assert CompletionRequest(prompt=[1, 2, 3]).to_input("r").token_ids == [1, 2, 3]
    assert CompletionRequest(prompt=[[4, 5]]).to_input("r").token_ids == [4, 5]
    assert CompletionRequest(prompt=["one"]).to_input("r").sampling.max_tokens == 16  # OpenAI's default
    with pytest.raises(errors.InvalidArgument, match="holds 2 prompts"):
        CompletionRequest(prompt=["a", "b"]).to_input("r")
    with pytest.raises(errors.InvalidArgument, match="echo is not supported"):
        CompletionRequest(prompt="a", echo=True).to_input("r")


async def _call(app, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, bytes, bool]:
    """Runs one HTTP request through an ASGI app; (status, body, whether the app read the whole body)."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), \
        not messages


@pytest.mark.anyio
async def test_body_limit_refuses_declared_and_chunked_bodies_over_it():
    from kvmesh.router.openai_api import BodyLimit

    read: list[int] = []

    async def app(scope, receive, send) -> None:
        body = b""
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                raise ConnectionError("client gone")  # what a framework does when the body vanishes
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        read.append(len(body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limited = BodyLimit(app, limit=10)
    assert await _call(limited, [(b"content-length", b"4")], [b"abcd"]) == (200, b"ok", True)
    status, body, _ = await _call(limited, [(b"content-length", b"11")], [b"x" * 11])
    assert status == 413 and b"over 10 bytes" in body and read == [4]  # refused before the app ran
    status, body, _ = await _call(limited, [], [b"x" * 6, b"x" * 6, b"x" * 6])
    assert (status, read) == (413, [4])  # chunked: refused at the limit, the app never finished reading
