"""The OpenAI-compatible HTTP API of the router (docs/openai.md): a FastAPI app served by uvicorn on
the router's own event loop, calling the same Frontend (model pick, stream limit, request path) as
the gRPC adapter. This module only converts JSON to GenerateInput and outputs to OpenAI objects.

- ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed as server-sent events (one
  event per token as the worker produces it, then ``data: [DONE]``) or as one JSON object;
- ``GET /v1/models`` (``/v1/models/{id}``), ``GET /health``, ``GET /metrics`` (the router's registry);
- errors are OpenAI error objects; the status comes from kvmesh/transport/http.py, the one table
  that maps kvmesh's errors to HTTP. A streamed request that fails before its first token gets
  that status; one that fails later ends its stream with an error event.
- ``/v1/*`` requires ``Authorization: Bearer <api token>`` when the router has an API token;
  ``/health`` and ``/metrics`` stay open (probes, scrapers), as gRPC health does. TLS when the
  router serves TLS (the same certificate, key and client CA).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.contract.errors import KVMeshError, Unauthenticated
from kvmesh.contract.types import Usage
from kvmesh.router.frontend import Frontend
from kvmesh.router.models import ServedModel
from kvmesh.router.openai_protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from kvmesh.router.router import GenerateOutput
from kvmesh.transport import http, security

log = logging.getLogger("kvmesh.router.http")

MAX_REQUEST_ID_CHARS = 128


def usage_json(u: Usage | None) -> dict[str, Any]:
    u = u or Usage()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def error_response(exc: BaseException) -> JSONResponse:
    status, message = http.status_for(exc)
    if status == 500:
        log.error("unhandled error in an HTTP request", exc_info=exc)
    code = {401: "invalid_api_key", 404: "model_not_found"}.get(status)
    return JSONResponse(http.error_body(status, message, code=code), status_code=status)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before the app holds it in memory.

    A declared ``content-length`` over the limit is refused before the app runs; a chunked body is
    counted as it arrives, and at the limit the 413 goes out, the app is told the client left and
    whatever it still sends is dropped.
    """

    def __init__(self, app: Any, limit: int = http.MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        seen = 0
        refused = False

        async def limited() -> dict:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: dict) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, limited, guarded)
        except Exception:
            if not refused:
                raise  # NOTE: after a 413 the app's complaint about the vanished body is moot

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(http.error_body(413, f"the request body is over {self.limit} bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class OpenAIApi:
    """The routes; ``app`` is the ASGI application."""

    def __init__(self, frontend: Frontend, token: str | None = None) -> None:
        self.frontend = frontend
        self._token = token
        app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(KVMeshError, self._on_error)
        app.add_exception_handler(ValueError, self._on_error)
        app.add_exception_handler(RequestValidationError, self._on_invalid)
        app.add_exception_handler(StarletteHTTPException, self._on_http)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.get_model, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.fastapi = app
        self.app = BodyLimit(app)
        self._created = int(time.time())

    # -- errors ---------------------------------------------------------------------------------
    async def _on_error(self, _request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def _on_invalid(self, _request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors()[:3]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            problems.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return JSONResponse(http.error_body(400, "invalid request body: " + "; ".join(problems)), status_code=400)

    async def _on_http(self, _request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(http.error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    def _authorize(self, request: Request) -> None:
        why = http.check_bearer(request.headers.get("authorization"), self._token)
        if why is not None:
            raise Unauthenticated(why)

    # -- plain routes -----------------------------------------------------------------------------
    async def health(self) -> Response:
        if any(m.pool.endpoints() for m in self.frontend.models.all()):
            return Response(status_code=200)
        return JSONResponse(http.error_body(503, "no worker is available yet"), status_code=503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.frontend.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _card(self, m: ServedModel) -> ModelCard:
        return ModelCard(id=m.model_id, created=self._created, root=m.files.model_dir if m.files else m.model_id)

    async def list_models(self, request: Request) -> ModelList:
        self._authorize(request)
        return ModelList(data=[self._card(m) for m in self.frontend.models.all()])

    async def get_model(self, request: Request, model: str) -> ModelCard:
        self._authorize(request)
        return self._card(self.frontend.model(model))

    # -- generation -------------------------------------------------------------------------------
    async def chat_completions(self, request: Request, body: ChatCompletionRequest) -> Response:
        return await self._generate(request, body, chat=True)

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        return await self._generate(request, body, chat=False)

    async def _generate(self, request: Request, body: ChatCompletionRequest | CompletionRequest,
                        chat: bool) -> Response:
        self._authorize(request)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        if len(rid) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"the x-request-id header has {len(rid)} characters; at most {MAX_REQUEST_ID_CHARS}")
        model = self.frontend.model(body.model)
        inp = body.to_input(rid)
        outputs = self.frontend.generate(model, inp)
        response_id = ("chatcmpl-" if chat else "cmpl-") + rid
        created = int(time.time())
        if not body.stream:
            return await self._whole(outputs, response_id, created, model.model_id, chat, body.return_token_ids)
        # NOTE: the first output is awaited before the 200 goes out, so a request refused before its
        # first token (bad input, unknown model, overload) gets its real status, not a broken stream.
        try:
            first = await outputs.__anext__()
        except StopAsyncIteration:
            raise RuntimeError("the request path ended without output") from None
        return StreamingResponse(
            self._stream(first, outputs, response_id, created, model.model_id, chat, body),
            media_type="text/event-stream", headers={"cache-control": "no-cache", "x-request-id": rid})

    async def _whole(self, outputs: AsyncIterator[GenerateOutput], response_id: str, created: int, model: str,
                     chat: bool, token_ids: bool) -> JSONResponse:
        text, ids, last = [], [], None
        async for out in outputs:
            text.append(out.text)
            ids.extend(out.token_ids)
            last = out
        assert last is not None
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        if token_ids:
            choice["token_ids"] = ids
        return JSONResponse({
            "id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage_json(last.usage), "system_fingerprint": None})

    async def _stream(self, first: GenerateOutput, outputs: AsyncIterator[GenerateOutput], response_id: str,
                      created: int, model: str, chat: bool,
                      body: ChatCompletionRequest | CompletionRequest) -> AsyncIterator[str]:
        head = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model}

        def chunk(out: GenerateOutput | None, role: bool = False) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                      "finish_reason": out.finish_reason if out is not None else None}
            text = out.text if out is not None else ""
            if chat:
                choice["delta"] = {"role": "assistant", "content": text} if role else (
                    {"content": text} if text else {})
            else:
                choice["text"] = text
            if body.return_token_ids and out is not None:
                choice["token_ids"] = list(out.token_ids)
            return {**head, "choices": [choice]}

        try:
            if chat:
                yield _sse(chunk(None, role=True))
            out: GenerateOutput | None = first
            last = first
            while out is not None:
                last = out
                # NOTE: one event per worker message (one token each by default), sent at once;
                # a token that completes no character yet (UTF-8 held back) sends nothing.
                if out.text or out.finish_reason is not None or (body.return_token_ids and out.token_ids):
                    yield _sse(chunk(out))
                out = await anext_or_none(outputs)
            if body.include_usage:
                yield _sse({**head, "choices": [], "usage": usage_json(last.usage)})
        except (KVMeshError, ValueError) as exc:
            status, message = http.status_for(exc)
            yield _sse(http.error_body(status, message))
        except Exception as exc:  # noqa: BLE001 - the stream is open: end it with an error event
            log.error("unhandled error in an HTTP stream", exc_info=exc)
            yield _sse(http.error_body(500, f"internal error ({type(exc).__name__}); see the server log"))
        finally:
            # NOTE: shielded: the client may be gone and this task cancelled; closing the request path
            # frees its in-flight share and cancels the worker call.
            with anyio.CancelScope(shield=True):
                await outputs.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"


async def anext_or_none(it: AsyncIterator[GenerateOutput]) -> GenerateOutput | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


class HttpServer:
    """uvicorn serving :class:`OpenAIApi` on the calling event loop (the router's); TLS and the API
    token from kvmesh/transport/security.py. Build, ``start`` and ``stop`` it on that loop."""

    def __init__(self, frontend: Frontend, host: str, port: int) -> None:
        sec = security.current()
        self.api = OpenAIApi(frontend, sec.server_token)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot listen on {host}:{port} (--http-port): {exc.strerror}") from None
        self.port: int = self._sock.getsockname()[1]
        tls = sec.server_tls
        kwargs: dict[str, Any] = {}
        if tls.enabled:
            kwargs = dict(ssl_certfile=tls.cert, ssl_keyfile=tls.key, ssl_ca_certs=tls.ca,
                          ssl_cert_reqs=ssl.CERT_REQUIRED if tls.ca else ssl.CERT_NONE)
        self.tls = tls.enabled
        config = uvicorn.Config(self.api.app, lifespan="off", log_config=None, access_log=False,
                                server_header=False, timeout_keep_alive=30, **kwargs)
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self, grace: float) -> None:
        """Stops accepting, lets open requests finish for ``grace`` seconds, then closes them."""
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace
        self._server.should_exit = True
        with suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self._sock.close()
