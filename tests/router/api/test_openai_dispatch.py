"""The generate routes' POSTs skip FastAPI (OpenAIApi.app calls _post straight): every answer, error or
stream, is byte for byte what the same request gets through the FastAPI app, which still holds the routes."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvmesh.contract.errors import NotFound
from kvmesh.contract.types import Usage
from kvmesh.router.api.body_bounds import BodyBounds
from kvmesh.router.api.frontend import Frontend
from kvmesh.router.api.openai_api import OpenAIApi
from kvmesh.router.config import RouterConfig
from kvmesh.router.generate_types import GenerateInput, GenerateOutput
from kvmesh.router.metrics import RouterMetrics
from tests.support.asgi import asgi_call

TOKEN = "secret"


class _Model:
    def __init__(self, model_id: str) -> None:
        self.model_id = model_id


class _Frontend(Frontend):
    """A request path that answers at once: two tokens ("he", "llo"), or a bug for the model "boom"."""

    def __init__(self) -> None:
        super().__init__(None, 8, RouterMetrics())  # type: ignore[arg-type]

    def body_bounds(self, config: RouterConfig) -> BodyBounds:
        return BodyBounds(config.max_body_bytes, config.max_messages, config.max_content_parts, 64, 4096)

    def model(self, name: str) -> Any:
        if name not in ("", "m", "boom"):
            raise NotFound(f"model {name!r} is not served")
        return _Model(name or "m")

    def target(self, name: str) -> tuple[Any, str]:
        return self.model(name), ""

    async def generate(self, model: Any, inp: GenerateInput, request_id: str | None = None,
                       span: Any = None) -> AsyncIterator[GenerateOutput]:
        self.admit()
        try:
            if model.model_id == "boom":
                raise RuntimeError("a bug")
            yield GenerateOutput([7], "he", None, None, "w0", inp.request_id)
            yield GenerateOutput([8], "llo", "length", Usage(3, 1, 2), "w0")
        finally:
            self.release("ok")


async def _call(app: Any, method: str, path: str, headers: dict[str, str], chunks: list[bytes]) -> tuple[Any, ...]:
    start, sent, scope = await asgi_call(app, method, path, headers, chunks)
    body = b"".join(m.get("body", b"") for m in sent[1:])
    body = re.sub(rb'"created":\s*\d+', b'"created":0', body)
    return start["status"], sorted(start["headers"]), body, scope.get("kvmesh.body_read")


def _requests() -> list[tuple[str, str, dict[str, str], list[bytes]]]:
    auth = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json", "x-request-id": "rid"}

    def post(path: str, doc: Any, headers: dict[str, str] | None = None, split: int = 0) -> tuple[Any, ...]:
        raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        chunks = [raw[:split], raw[split:]] if split else [raw]
        return "POST", path, {**auth, **(headers or {})}, chunks

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
    return [
        post("/v1/completions", comp), post("/v1/chat/completions", chat),
        post("/v1/completions", {**comp, "prompt": "once upon"}, split=9),
        post("/v1/completions", {**comp, "stream": True, "stream_options": {"include_usage": True}}),
        post("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True},
                                      "return_token_ids": True}),
        post("/v1/chat/completions", {**chat, "stream": True}, split=20),
        post("/v1/completions", comp, {"authorization": "Bearer wrong"}),
        post("/v1/completions", comp, {"content-type": "text/plain"}),
        post("/v1/completions", comp, {"content-length": str(10**9)}),
        post("/v1/completions", b'{"model": "m", "prompt": [1, 2'), post("/v1/completions", b"{not json"),
        post("/v1/completions", {**comp, "prompt": list(range(65))}),
        post("/v1/completions", {**comp, "n": 2}), post("/v1/chat/completions", {**chat, "tools": []}),
        post("/v1/chat/completions", {"model": "m", "messages": [{"content": "x"}]}),
        post("/v1/completions", {**comp, "model": "nope"}), post("/v1/completions", {**comp, "model": "boom"}),
        post("/v1/chat/completions", {**chat, "model": "boom", "stream": True}),
        post("/v1/completions", comp, {"x-request-id": "r" * 200}),
        ("GET", "/v1/completions", auth, [b""]), ("POST", "/v1/completions/", auth, [json.dumps(comp).encode()]),
        ("POST", "/v1/models", auth, [b"{}"]), ("POST", "/v1/chat", auth, [b"{}"]),
    ]


@pytest.mark.anyio
async def test_the_generate_routes_answer_as_through_fastapi():
    api = OpenAIApi(_Frontend(), TOKEN, RouterConfig(max_body_bytes=100_000))
    answers = []
    for method, path, headers, chunks in _requests():
        fast = await _call(api.app, method, path, headers, chunks)
        slow = await _call(api.fastapi, method, path, headers, chunks)
        assert fast == slow, (method, path, chunks[0][:80])
        answers.append(fast[0])
    # the requests cover what they mean to: answers, streams, early refusals and errors
    assert answers[:6] == [200] * 6 and {401, 415, 413, 400, 404, 405, 500} <= set(answers)
