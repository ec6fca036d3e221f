"""The OpenAI-compatible HTTP API of the router (docs/openai.md): a FastAPI app served by uvicorn on
the router's own event loop, calling the same Frontend (model pick, stream limit, request path) as
the gRPC adapter. This module only converts JSON to GenerateInput and outputs to OpenAI objects.

- ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed as server-sent events (one
  event per token as the worker produces it, then ``data: [DONE]``) or as one JSON object;
- ``GET /v1/models`` (``/v1/models/{id}``), ``GET /health``, ``GET /metrics`` (the router's registry);
- errors are OpenAI error objects naming ``param`` where there is one; the status comes from
  kvmesh/transport/http.py, the one table that maps kvmesh's errors to HTTP. A streamed request
  that fails before its first token gets that status; one that fails later ends its stream with an
  error event, then ``data: [DONE]``.
- ``/v1/*`` requires ``Authorization: Bearer <api token>`` when the router has an API token,
  checked from the headers before a byte of the body is read; ``/health`` and ``/metrics`` stay
  open (probes, scrapers), as gRPC health does. TLS when the router serves TLS (the same
  certificate, key and client CA).

The front door (docs/security.md): a POST body is read by router/api/request_body.py, parsed as it
arrives and refused at the first element past a bound, never buffered whole; connections whose
request is slow to arrive are closed by kvmesh/transport/http_guard.py. What is left that grows
with a request (rendering a long conversation, tokenizing a long text) runs on the tokenizer pool
(router/text/prompt.py), so no request holds the loop that HTTP and gRPC share.
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
from dataclasses import replace
from typing import Any

import anyio
import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvmesh.contract.errors import InvalidArgument, KVMeshError, Unauthenticated
from kvmesh.contract.types import Usage
from kvmesh.router.api.adapter_admin import change_adapter
from kvmesh.router.api.body_bounds import BodyBounds, BodyTooLarge
from kvmesh.router.api.frontend import Frontend
from kvmesh.router.api.objectives import objectives_from_headers
from kvmesh.router.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    public_param,
    validation_error,
)
from kvmesh.router.api.request_body import read_json_parts
from kvmesh.router.config import RouterConfig
from kvmesh.router.generate_types import GenerateOutput
from kvmesh.router.models import ServedModel
from kvmesh.transport import http, security, tracing
from kvmesh.transport.http_guard import ReadGuard

log = logging.getLogger("kvmesh.router.http")

MAX_REQUEST_ID_CHARS = 128
BODY_READ = "kvmesh.body_read"
"""ASGI scope key: the request's body was read to its end (an answer after it keeps the connection alive)."""
GENERATE_ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}
"""The POST routes, and whether each is a chat."""


def usage_json(u: Usage | None) -> dict[str, Any]:
    u = u or Usage()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def error_response(exc: BaseException, chat: bool | None = None) -> JSONResponse:
    """The OpenAI error object of ``exc``; ``chat``: the request was a chat (its prompt is ``messages``)."""
    status, message = http.status_for(exc)
    if status == 500:
        log.error("unhandled error in an HTTP request", exc_info=exc)
    code = {401: "invalid_api_key", 404: "model_not_found"}.get(status)
    param = public_param(http.param_of(exc), chat)
    return JSONResponse(http.error_body(status, message, param=param, code=code), status_code=status,
                        headers=_headers(status))


def _headers(status: int) -> dict[str, str] | None:
    if status == 401:
        name, value = http.WWW_AUTHENTICATE
        return {name.decode(): value.decode()}
    return None


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
"""The last event of every stream, after an error event too: SSE clients wait for it."""


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or kind.endswith("+json")


class OpenAIApi:
    """The routes; ``app`` is the ASGI application.

    Args:
        frontend: what both protocols call.
        token: the API token (None: no auth).
        config: the router's flags (the body bounds); default: RouterConfig's defaults.
    """

    def __init__(self, frontend: Frontend, token: str | None = None, config: RouterConfig | None = None) -> None:
        self.frontend = frontend
        self._token = token
        self.config = config or RouterConfig()
        app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(KVMeshError, self._on_error)
        app.add_exception_handler(ValueError, self._on_error)
        app.add_exception_handler(RequestValidationError, self._on_invalid)
        app.add_exception_handler(StarletteHTTPException, self._on_http)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.get_model, methods=["GET"])
        app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])
        # NOTE: the POST routes take the raw Request: FastAPI reads no body for them (read_json_parts does).
        # A POST to them never gets here (``app`` calls _post straight); these give the 405s of other methods.
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.fastapi = app
        self._created = int(time.time())

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI application: a POST to a generate route goes straight to :meth:`_post`; everything
        else (the other routes, other methods, 404s) through FastAPI.

        NOTE: FastAPI's stack (its middlewares, the route table, the dependency solver) does nothing for
        these routes, and costs the loop on every request (benchmarks/http_front.py --front-only): _post
        takes the raw request and answers every error itself."""
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = GENERATE_ROUTES.get(scope["path"])
            if chat is not None:
                response = await self._post(Request(scope, receive), chat)
                await response(scope, receive, send)
                return
        await self.fastapi(scope, receive, send)

    # -- errors ---------------------------------------------------------------------------------
    async def _on_error(self, _request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    async def _on_invalid(self, _request: Request, exc: RequestValidationError) -> JSONResponse:
        # NOTE: only path and query parameters reach FastAPI's validation (the bodies are read by _post).
        return error_response(InvalidArgument("invalid request: " + "; ".join(
            str(e.get("msg")) for e in exc.errors()[:3])))

    async def _on_http(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = str(exc.detail)
        if status == 404:
            message = f"no route {request.url.path}: the API is under /v1 (POST /v1/chat/completions, ...)"
        elif status == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
        return JSONResponse(http.error_body(status, message), status_code=status, headers=exc.headers)

    def _authorize(self, request: Request) -> None:
        why = http.check_bearer(request.headers.get("authorization"), self._token)
        if why is not None:
            raise Unauthenticated(why)

    # -- plain routes -----------------------------------------------------------------------------
    async def health(self) -> Response:
        """200 with each model's worker count while some model has a worker; 503 naming why not."""
        models = [{"id": m.model_id, "workers": len(m.pool.endpoints())} for m in self.frontend.models.all()]
        if any(m["workers"] for m in models):
            return JSONResponse({"status": "ok", "models": models})
        known = ", ".join(m["id"] for m in models) or "none"
        body = http.error_body(503, f"no worker is available yet (models: {known}): workers register with the "
                                    "kv_service (or answer at --workers) when they are up")
        return JSONResponse({**body, "status": "unavailable", "models": models}, status_code=503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.frontend.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _card(self, m: ServedModel, adapter: str = "") -> ModelCard:
        """A model's card, or an adapter's with its base model as ``parent`` (as vLLM lists --lora-modules)."""
        if adapter:
            return ModelCard(id=adapter, created=self._created, root=adapter, parent=m.model_id)
        return ModelCard(id=m.model_id, created=self._created, root=m.model_id)

    async def list_models(self, request: Request) -> ModelList:
        self._authorize(request)
        models = self.frontend.models
        return ModelList(data=[self._card(m) for m in models.all()]
                         + [self._card(m, name) for name, m in sorted(models.adapters().items())])

    async def get_model(self, request: Request, model: str) -> ModelCard:
        self._authorize(request)
        return self._card(*self.frontend.target(model))

    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        return await self._change_adapter(request, load=True)

    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        return await self._change_adapter(request, load=False)

    async def _change_adapter(self, request: Request, load: bool) -> JSONResponse:
        self._authorize(request)
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise InvalidArgument("the body must be JSON: {\"lora_name\": ..., \"lora_path\": ...}") from None
        return JSONResponse(await change_adapter(self.frontend.models, body, load,
                                                 self.config.allow_runtime_lora_updating))

    # -- generation -------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._post(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._post(request, chat=False)

    def bounds(self) -> BodyBounds:
        """The body bounds now (Frontend.body_bounds)."""
        return self.frontend.body_bounds(self.config)

    async def _post(self, request: Request, chat: bool) -> Response:
        """Authenticate (headers only), check the declared size and type, read the body within its bounds,
        then generate. Nothing reads the body before the token is checked. An answer given before the body
        was read whole says ``connection: close``: kvmesh/transport/http_guard.py then reads and drops the
        rest (a lingering close), so a client that sends its whole body first reads the answer."""
        span = None
        if tracing.ON:
            # NOTE: the request's span opens before anything is checked: a refused request has its trace too.
            path = request.scope["path"]
            span = tracing.start("router.request", tracing.extract(request.headers),
                                 tracing.http_attributes("POST", path, path, request.scope.get("scheme", "http")),
                                 kind="server")
        response = await self._answer(request, chat, span)
        if not request.scope.get(BODY_READ):
            response.headers["connection"] = "close"
        if span is not None:
            span.set_attribute("http.response.status_code", response.status_code)
            if not isinstance(response, StreamingResponse):  # NOTE: a stream ends its span at its end
                if response.status_code < 400:
                    tracing.set_ok(span)
                span.end()
        return response

    async def _answer(self, request: Request, chat: bool, span: Any) -> Response:
        """The answer; a refusal's error is written on ``span`` (the request's span; None while tracing is off)."""
        try:
            self._authorize(request)
            length = request.headers.get("content-length")
            limit = self.config.max_body_bytes
            if length is not None and length.isdigit() and int(length) > limit:
                raise BodyTooLarge(limit)
            content_type = request.headers.get("content-type")
            if content_type is not None and not _is_json(content_type):
                message = (f"the request body must be JSON sent with 'Content-Type: application/json', got "
                           f"{content_type[:60]!r} (curl -d needs -H 'Content-Type: application/json')")
                tracing.set_error(span, message=message, error_type="415")
                return JSONResponse(http.error_body(415, message, param=None), status_code=415)
            try:
                raw = await read_json_parts(body_parts(request.receive), self.bounds())
                request.scope[BODY_READ] = True
                body = (ChatCompletionRequest if chat else CompletionRequest).model_validate(raw)
            except pydantic.ValidationError as exc:
                raise validation_error(exc) from None
            return await self._generate(request, body, chat, span)
        except BodyTooLarge as exc:
            tracing.set_error(span, exc)
            return JSONResponse(http.error_body(413, str(exc)), status_code=413)
        except ClientDisconnect as exc:
            tracing.set_error(span, exc)
            return Response(status_code=400)  # NOTE: nobody is listening: uvicorn drops it
        except (KVMeshError, ValueError) as exc:
            tracing.set_error(span, exc)
            return error_response(exc, chat)
        except Exception as exc:  # noqa: BLE001 - a bug: a 500 with an error object, the traceback in the log
            tracing.set_error(span, exc)
            return error_response(exc, chat)

    async def _generate(self, request: Request, body: ChatCompletionRequest | CompletionRequest,
                        chat: bool, span: Any) -> Response:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        if len(rid) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"the x-request-id header has {len(rid)} characters; at most {MAX_REQUEST_ID_CHARS}")
        model, adapter = self.frontend.target(body.model)
        inp = replace(body.to_input(rid), objectives=objectives_from_headers(request.headers,
                                                                              self.config.default_objectives()),
                      adapter=adapter)
        outputs = self.frontend.generate(model, inp, None, span)
        response_id = ("chatcmpl-" if chat else "cmpl-") + rid
        created = int(time.time())
        name = adapter or model.model_id  # NOTE: as vLLM, an adapter's answer names the adapter
        if not body.stream:
            return await self._whole(outputs, response_id, created, name, chat, body.return_token_ids)
        # NOTE: the first output is awaited before the 200 goes out, so a request refused before its
        # first token (bad input, unknown model, overload) gets its real status, not a broken stream.
        try:
            first = await outputs.__anext__()
        except StopAsyncIteration:
            raise RuntimeError("the request path ended without output") from None
        return StreamingResponse(
            self._stream(first, outputs, response_id, created, name, chat, body, span),
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
                      body: ChatCompletionRequest | CompletionRequest, span: Any = None) -> AsyncIterator[str]:
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

        # NOTE: events that are ready together go out in one write (each write is a trip through h11
        # and the socket): the chat's role event with the first token's, the usage with [DONE].
        held = _sse(chunk(None, role=True)) if chat else ""
        tail = ""
        try:
            out: GenerateOutput | None = first
            last = first
            while out is not None:
                last = out
                # NOTE: one event per worker message (one token each by default), sent at once;
                # a token that completes no character yet (UTF-8 held back) sends nothing.
                if out.text or out.finish_reason is not None or (body.return_token_ids and out.token_ids):
                    yield held + _sse(chunk(out))
                    held = ""
                elif held:
                    yield held
                    held = ""
                out = await anext_or_none(outputs)
            if body.include_usage:
                tail = _sse({**head, "choices": [], "usage": usage_json(last.usage)})
        except (KVMeshError, ValueError) as exc:
            tracing.set_error(span, exc)
            status, message = http.status_for(exc)
            tail = _sse(http.error_body(status, message, param=public_param(http.param_of(exc), chat)))
        except Exception as exc:  # noqa: BLE001 - the stream is open: end it with an error event
            tracing.set_error(span, exc)
            log.error("unhandled error in an HTTP stream", exc_info=exc)
            tail = _sse(http.error_body(500, f"internal error ({type(exc).__name__}); see the server log"))
        else:
            tracing.set_ok(span)
        finally:
            # NOTE: shielded: the client may be gone and this task cancelled; closing the request path
            # frees its in-flight share and cancels the worker call.
            with anyio.CancelScope(shield=True):
                await outputs.aclose()  # type: ignore[attr-defined]
            if span is not None:
                span.end()
        yield held + tail + SSE_DONE


async def body_parts(receive: Any) -> AsyncIterator[tuple[bytes, bool]]:
    """An ASGI request's body as ``(chunk, last)`` (Starlette's ``Request.stream`` hides ``more_body``,
    which lets a body that arrives in one message be read whole)."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        more = message.get("more_body", False)
        yield message.get("body", b""), not more
        if not more:
            return


async def anext_or_none(it: AsyncIterator[GenerateOutput]) -> GenerateOutput | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


class HttpServer:
    """uvicorn serving :class:`OpenAIApi` on the calling event loop (the router's); TLS and the API
    token from kvmesh/transport/security.py, read timeouts and the unfinished-request cap from
    kvmesh/transport/http_guard.py. Build, ``start`` and ``stop`` it on that loop."""

    def __init__(self, frontend: Frontend, host: str, port: int, config: RouterConfig | None = None) -> None:
        config = config or RouterConfig()
        sec = security.current()
        self.api = OpenAIApi(frontend, sec.server_token, config)
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
        self.guard = ReadGuard(config.http_header_timeout_s, config.http_body_timeout_s, config.http_max_unfinished,
                               config.http_linger_bytes, config.http_linger_time_s)
        uv = uvicorn.Config(self.api.app, interface="asgi3", http=self.guard.protocol(), lifespan="off", log_config=None,
                            access_log=False, server_header=False, timeout_keep_alive=config.http_keep_alive_s,
                            **kwargs)
        self._server = uvicorn.Server(uv)
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
