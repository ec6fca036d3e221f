"""The HTTP side's tables and conversions: statuses of kvmesh errors, OpenAI bodies -> GenerateInput."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from kvmesh.contract import errors
from kvmesh.router.api.body_bounds import BodyBounds, BodyTooLarge
from kvmesh.router.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.router.api.request_body import BodyParser, read_json_body
from kvmesh.transport import http, status


def test_every_error_grpc_maps_has_an_http_status_and_limits_are_400_not_429():
    for cls in status.STATUS_OF:
        assert http.status_for(cls("x"))[0] != 500, cls
    assert [http.status_for(e("m")) for e in (errors.InvalidArgument, errors.NotFound, errors.RequestTooLarge,
                                                errors.ResourceExhausted, errors.Unavailable,
                                                errors.Unauthenticated)] == [
        (400, "m"), (404, "m"), (400, "m"), (429, "m"), (503, "m"), (401, "m")]
    # gRPC keeps RESOURCE_EXHAUSTED for a request over a limit.
    assert status.status_for(errors.RequestTooLarge("m"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert http.status_for(RuntimeError("secret detail")) == (500, "internal error (RuntimeError); see the server log")
    assert http.error_body(404, "gone", code="model_not_found") == {
        "error": {"message": "gone", "type": "invalid_request_error", "param": None, "code": "model_not_found"}}


def test_bearer_check():
    assert http.check_bearer(None, None) is None
    assert http.check_bearer("Bearer t", "t") is None
    assert http.check_bearer("bearer t", "t") is None and http.check_bearer("BEARER  t ", "t") is None  # RFC 7235
    assert http.check_bearer("Bearer u", "t").startswith("wrong API key")
    assert http.check_bearer("Basic t", "t").startswith("wrong API key")
    assert http.check_bearer("t", "t").startswith("wrong API key")
    assert http.check_bearer(None, "t").startswith("missing API key")
    assert http.error_body(405, "no")["error"]["type"] == "invalid_request_error"
    assert http.error_body(502, "no")["error"]["type"] == "server_error"


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


@pytest.mark.parametrize("extra, param, message", [
    (dict(n=3), "n", "n=3"),
    (dict(logprobs=True), "logprobs", "logprobs are not supported"),
    (dict(presence_penalty=0.5), "presence_penalty", "presence_penalty is not supported"),
    (dict(tools=[{"type": "function"}]), "tools", "function calling"),
    (dict(tool_choice="auto"), "tool_choice", "function calling"),
    (dict(tool_choice="none"), "tool_choice", "function calling"),
    (dict(functions=[]), "functions", "function calling"),
    (dict(function_call="auto"), "function_call", "function calling"),
    (dict(parallel_tool_calls=False), "parallel_tool_calls", "function calling"),
    (dict(top_logprobs=0), "top_logprobs", "needs logprobs"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content",
     "has a 'image_url' part"),
    (dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "c1"}]), "messages[0].tool_call_id",
     "function calling"),
    (dict(top_p=0.0), "top_p", "top_p must be in (0, 1]"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", "stop_token_ids must be non-negative"),
    (dict(stop_token_ids=[2**40]), "stop_token_ids", "stop_token_ids[0] = 1099511627776"),
    (dict(seed=2**64), "seed", "seed must be an integer in [0, 2**64)"),
    (dict(top_k=2**31), "top_k", "top_k must be an integer in [0, 2**31)"),
    (dict(temperature=1e308), "temperature", "at most 3.403e+38 (a 32-bit float), got 1e+308"),
    (dict(max_tokens=2**32), "max_tokens", "max_tokens must be an integer in [1, 2**32)"),
    (dict(max_completion_tokens=0), "max_completion_tokens", "max_completion_tokens must be an integer"),
])
def test_chat_bodies_kvmesh_cannot_honour_are_refused_by_name(extra, param, message):
    body = ChatCompletionRequest(**({"model": "m", "messages": [{"role": "user", "content": "x"}]} | extra))
    with pytest.raises(errors.InvalidArgument, match=re.escape(message)) as err:
        body.to_input("r")
    assert err.value.param == param


def test_completion_prompts():
    assert CompletionRequest(prompt="hi").to_input("r").text == "hi"
    assert CompletionRequest(prompt=[1, 2, 3]).to_input("r").token_ids == [1, 2, 3]
    assert CompletionRequest(prompt=[[4, 5]]).to_input("r").token_ids == [4, 5]
    assert CompletionRequest(prompt=["one"]).to_input("r").sampling.max_tokens == 16  # OpenAI's default
    with pytest.raises(errors.InvalidArgument, match="holds 2 prompts"):
        CompletionRequest(prompt=["a", "b"]).to_input("r")
    with pytest.raises(errors.InvalidArgument, match="echo is not supported"):
        CompletionRequest(prompt="a", echo=True).to_input("r")
    for bad in (-1, 2**31, 2**40):
        with pytest.raises(errors.InvalidArgument, match=re.escape(f"prompt[1] is {bad}: token ids are integers in")):
            CompletionRequest(prompt=[1, bad]).to_input("r")


BOUNDS = BodyBounds(max_bytes=100_000, max_messages=3, max_content_parts=4, max_prompt_ids=5, max_token_bytes=200)


async def _read(body: bytes, bounds: BodyBounds = BOUNDS, chunk: int = 7) -> dict:
    async def chunks():
        for i in range(0, len(body), chunk):
            yield body[i:i + chunk]

    return await read_json_body(chunks(), bounds)


@pytest.mark.anyio
async def test_the_body_parser_builds_what_json_loads_builds():
    doc = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\u00e9"}]},
                                      {"role": "assistant", "content": None, "name": "x"}],
           "stop": ["a", "b"], "stop_token_ids": [1, 2], "prompt": [[1, 2, 3]], "temperature": 0.5, "n": 1,
           "stream": True, "chat_template_kwargs": {"a": {"b": [1, 2.5, None, False]}}}
    raw = json.dumps(doc).encode()
    for chunk in (1, 7, 4096):
        assert await _read(raw, chunk=chunk) == json.loads(raw)


@pytest.mark.anyio
@pytest.mark.parametrize("doc, exc, param, message", [
    ({"messages": [{"role": "user"}] * 4}, errors.RequestTooLarge, "messages", "more than 3 messages"),
    ({"messages": [{"content": [{"type": "text"}] * 3}, {"content": [{"type": "text"}] * 2}]},
     errors.RequestTooLarge, "messages[1].content", "more than 4 content parts"),
    ({"messages": [{f"k{i}": 1 for i in range(65)}]}, errors.InvalidArgument, "messages[0]", "more than 64 fields"),
    ({"stop": ["s"] * 17}, errors.InvalidArgument, "stop", "more than 16 strings"),
    ({"stop": ["s", ""]}, errors.InvalidArgument, "stop", "got 0 in stop[1]"),
    ({"stop": "x" * 257}, errors.InvalidArgument, "stop", "got 257 in stop"),
    ({"stop_token_ids": [1] * 1025}, errors.InvalidArgument, "stop_token_ids", "more than 1024 ids"),
    ({"prompt": [1] * 6}, errors.RequestTooLarge, "prompt", "more than 5 token ids"),
    ({"prompt": [[1], [2]]}, errors.InvalidArgument, "prompt", "more than one prompt"),
    ({"prompt": "x" * 100_000}, errors.RequestTooLarge, "prompt", "over 200 bytes of JSON"),
    ({"junk": list(range(4097))}, errors.InvalidArgument, None, "more than 4096 JSON values"),
    ({"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}, errors.InvalidArgument, "a",
     "nests deeper than 32"),
])
async def test_the_body_parser_refuses_at_the_first_element_past_a_bound(doc, exc, param, message):
    bounds = BodyBounds(10**6, 3, 4) if "junk" in doc else BodyBounds(10**6, 3, 4, 5, 200) if isinstance(
        doc.get("prompt"), str) else BOUNDS
    with pytest.raises(exc, match=re.escape(message)) as err:
        await _read(json.dumps(doc).encode(), bounds)
    assert err.value.param == param


@pytest.mark.anyio
@pytest.mark.parametrize("raw, message, param", [
    (b"", "the request body is empty", None),
    (b"[1, 2]", "must be a JSON object", None),
    (b'"x"', "must be a JSON object", None),
    (b"{not json", "not valid JSON: invalid string in json text", None),
    (b'{"a": 1} x', "not valid JSON: trailing garbage", None),
    (b'{"model": "m", "messages": [', "not valid JSON: it ends early in messages[0]", "messages[0]"),
    (b'{"seed": 1180591620717411303424}', "seed is out of range", "seed"),
])
async def test_malformed_bodies_say_where(raw, message, param):
    with pytest.raises(errors.InvalidArgument, match=re.escape(message)) as err:
        await _read(raw, BodyBounds(10**6, 3, 4))
    assert err.value.param == param


@pytest.mark.anyio
async def test_a_body_over_the_byte_limit_is_refused_where_it_passes_it():
    read = []

    async def chunks():
        for _ in range(100):
            read.append(1)
            yield b" " * 100

    with pytest.raises(BodyTooLarge, match="over 1000 bytes"):
        await read_json_body(chunks(), BodyBounds(1000, 3, 4))
    assert len(read) == 11  # refused at the chunk that passed the limit, the rest never pulled


@pytest.mark.anyio
async def test_a_long_string_is_read_in_growing_slices():
    """yajl re-reads a token split across slices: fixed slices would cost time quadratic in its length."""
    parser = BodyParser(BodyBounds(10**9, 3, 4))
    sends: list[int] = []
    real = parser._send
    parser._send = lambda data: (sends.append(len(data)), real(data))[1]  # type: ignore[method-assign]
    body = json.dumps({"prompt": "x" * 4_000_000}).encode()
    for i in range(0, len(body), 65536):
        await parser.feed(body[i:i + 65536])
    assert parser.close()["prompt"] == "x" * 4_000_000
    assert len(sends) < 30 and max(sends) > 1_000_000  # doubling, not 500 slices of 8 KiB
