"""Workers served over the OpenAI completions API (vLLM, SGLang behind a bridge): the router's calls.

A worker whose address is an ``http(s)://`` base URL (a bridge registered it: bridge/) gets the
request as **token ids** on ``POST /v1/completions`` with ``stream: true``, so the tokenizer that
hashed the prompt is the one that defines it. ``return_token_ids`` brings the generated ids back
(the router detokenizes and applies stop strings itself, as for its own workers) and the final
usage chunk the prompt's cached tokens (vLLM needs ``--enable-prompt-tokens-details`` for them;
without it they read 0). Closing the response is the abort: the engine drops a request whose client
went away.

HTTP answers map to the request path's failure kinds (router/core/upstream.py): 400/413/422 = the request is
bad (not retried), and so is an error event in the stream about the request (its code 400/413/422, or
a bad-request type: vLLM reports an out-of-vocabulary token id that way); 429 = busy and 503 =
unavailable (retried elsewhere before the first token); connection errors = unavailable; the
deadline = timeout; any other status or error event, or a stream that ends without a finish reason = other.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from kvmesh.contract.kv_transfer import KVSource
from kvmesh.contract.types import Usage
from kvmesh.router.core.upstream import Failure, WorkerChunk, WorkerEndpoint, WorkerError, WorkerRequest

MAX_EVENT_BYTES = 64 << 20
"""One server-sent event longer than this ends the call (the first one echoes the prompt's ids)."""
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_STATUS_FAILURE = {400: Failure.INVALID, 422: Failure.INVALID, 413: Failure.INVALID, 429: Failure.BUSY,
                   503: Failure.UNAVAILABLE, 502: Failure.UNAVAILABLE, 504: Failure.TIMEOUT}


def is_http(address: str) -> bool:
    """Whether a worker address is an OpenAI-API base URL rather than a gRPC host:port."""
    return address.startswith(("http://", "https://"))


VLLM = "vllm"
"""The transport a vLLM decode leg names: vLLM's own KV connector moved the blocks (NixlConnector)."""

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""A prefill leg's ``kv_transfer_params`` (vLLM's contract: its disaggregated-serving proxies send these)."""


def completion_body(request: WorkerRequest) -> dict[str, Any]:
    """The /v1/completions JSON of one request (no "model": the server's base model answers; a LoRA adapter's
    name as "model" runs it under that adapter, as vLLM serves --lora-modules).

    Prefill/decode disaggregation through vLLM's own contract: a prefill leg carries ``kv_transfer_params``
    with ``do_remote_decode``, ``max_tokens`` 1 and no streaming; its answer's ``kv_transfer_params`` go,
    unchanged, with the decode leg, whose vLLM connector (NixlConnector) then reads the blocks."""
    sp = request.sampling
    body: dict[str, Any] = {
        "prompt": list(request.prompt_token_ids),
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if sp.max_tokens is not None:
        body["max_tokens"] = sp.max_tokens
    if sp.top_k:
        body["top_k"] = sp.top_k
    if sp.seed is not None:
        body["seed"] = sp.seed
    if sp.stop_token_ids:
        body["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        body["ignore_eos"] = True
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    if request.adapter:
        body["model"] = request.adapter
    if request.prefill_leg:
        body.update(kv_transfer_params=dict(PREFILL_PARAMS), stream=False, max_tokens=1)
        del body["stream_options"]
    elif request.kv_source is not None and request.kv_source.engine_params:
        body["kv_transfer_params"] = json.loads(request.kv_source.engine_params)
    return body


def _error_text(raw: bytes) -> str:
    try:
        err = json.loads(raw)
        msg = err.get("error", err) if isinstance(err, dict) else err
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
        return str(msg)[:300]
    except ValueError:
        return raw[:300].decode("utf-8", "replace")


_INVALID_TYPES = frozenset({"BadRequestError", "BadRequest", "invalid_request_error", "ValidationError",
                            "VLLMValidationError", "NotFoundError"})


def _event_failure(error: Any) -> Failure:
    """What an error event in the stream means: its ``code`` read as an HTTP status (400 / 413 / 422 =
    INVALID: about the request, never retried; 429, 503 ... as the statuses), else a bad-request
    ``type`` = INVALID (vLLM's "Token id N is out of vocabulary"), else OTHER."""
    if not isinstance(error, dict):
        return Failure.OTHER
    code = error.get("code")
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and code in _STATUS_FAILURE:
        return _STATUS_FAILURE[code]
    return Failure.INVALID if error.get("type") in _INVALID_TYPES else Failure.OTHER


class OpenAIWorkerCall:
    """One streaming completion; iteration yields WorkerChunks and raises WorkerError."""

    def __init__(self, session: aiohttp.ClientSession, endpoint: WorkerEndpoint, request: WorkerRequest,
                 timeout_s: float) -> None:
        self._session = session
        self._endpoint = endpoint
        self._request = request
        self._timeout_s = timeout_s
        self._resp: aiohttp.ClientResponse | None = None

    async def __aiter__(self) -> AsyncIterator[WorkerChunk]:
        url = f"{self._endpoint.address}/v1/completions"
        try:
            async with self._session.post(url, json=completion_body(self._request),
                                          headers=self._headers(),
                                          timeout=aiohttp.ClientTimeout(total=self._timeout_s)) as resp:
                self._resp = resp
                if resp.status != 200:
                    text = _error_text(await resp.content.read(64 << 10))
                    failure = _STATUS_FAILURE.get(resp.status, Failure.OTHER)
                    raise WorkerError(failure, f"HTTP {resp.status}: {text}", text)
                if self._request.prefill_leg:
                    yield prefill_answer(await resp.read(), self._endpoint, self._request)
                    return
                async for chunk in self._chunks(resp):
                    if chunk.finish_reason is not None and self._request.kv_source is not None:
                        chunk = WorkerChunk(chunk.token_ids, chunk.finish_reason, chunk.usage, chunk.worker_id,
                                            kv_transport=VLLM)
                    yield chunk
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):  # noqa: UP041 - 3.10's TimeoutError
            raise WorkerError(Failure.TIMEOUT, f"no answer within {self._timeout_s:g}s") from None
        except aiohttp.ClientConnectorError as exc:
            raise WorkerError(Failure.UNAVAILABLE, f"cannot connect: {exc}") from None
        except aiohttp.ClientError as exc:
            raise WorkerError(Failure.UNAVAILABLE, f"{type(exc).__name__}: {exc}") from None

    def _headers(self) -> dict[str, str]:
        headers = {"X-Request-Id": self._request.request_id}
        if self._request.trace is not None:
            headers.update(self._request.trace.headers())  # an engine with OpenTelemetry joins the trace
        return headers

    async def _events(self, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The ``data:`` payloads of the server-sent events, in order, up to ``[DONE]`` (read: a
        response read to its end returns its connection to the pool; one left unread is closed)."""
        buf = b""
        async for piece in resp.content.iter_any():
            buf += piece
            while True:
                end = buf.find(b"\n")
                if end < 0:
                    break
                line, buf = buf[:end].rstrip(b"\r"), buf[end + 1:]
                if line.startswith(b"data:"):
                    yield line[5:].strip()
            if len(buf) > MAX_EVENT_BYTES:
                raise WorkerError(Failure.OTHER, f"a stream event over {MAX_EVENT_BYTES} bytes")

    async def _chunks(self, resp: aiohttp.ClientResponse) -> AsyncIterator[WorkerChunk]:
        held: list[int] = []
        finish: str | None = None
        completion = 0
        last: WorkerChunk | None = None
        wid = self._endpoint.worker_id
        async for data in self._events(resp):
            if data == b"[DONE]":
                break
            if last is not None:
                continue  # NOTE: nothing is expected between the usage and [DONE]
            try:
                msg = json.loads(data)
            except ValueError:
                raise WorkerError(Failure.OTHER, "a stream event that is not JSON") from None
            if "error" in msg:
                text = _error_text(data)
                raise WorkerError(_event_failure(msg["error"]), f"error event: {text}", text)
            usage = msg.get("usage")
            for choice in msg.get("choices") or ():
                ids = choice.get("token_ids") or []
                completion += len(ids)
                reason = choice.get("finish_reason")
                if reason is not None:
                    finish = _FINISH.get(reason, "stop")
                    held += ids
                elif ids:
                    yield WorkerChunk(ids, worker_id=wid)
            if usage is not None and finish is not None:
                details = usage.get("prompt_tokens_details") or {}
                # NOTE: held until [DONE] is read: the caller stops at the last chunk, and the
                # connection goes back to the pool only once the response is read to its end.
                last = WorkerChunk(held, finish, Usage(int(usage.get("prompt_tokens", 0)),
                                                       int(details.get("cached_tokens") or 0),
                                                       int(usage.get("completion_tokens", completion))), wid)
        if last is not None:
            yield last
        elif finish is not None:  # a server that sends no usage chunk
            yield WorkerChunk(held, finish, Usage(len(self._request.prompt_token_ids), 0, completion), wid)

    def cancel(self) -> None:
        """Closes the connection if the response is still open: the engine aborts the request."""
        if self._resp is not None and not self._resp.closed:
            self._resp.close()


def prefill_answer(raw: bytes, endpoint: WorkerEndpoint, request: WorkerRequest) -> WorkerChunk:
    """A vLLM prefill leg's (non-streamed) answer: its one token, its usage and its ``kv_transfer_params``
    as the KV source of the decode leg. Raises WorkerError (OTHER) when the answer carries no params: the
    server runs no KV connector (start it with --kv-transfer-config, docs/vllm.md)."""
    try:
        msg = json.loads(raw)
        choice = (msg.get("choices") or [{}])[0]
        ids = list(choice.get("token_ids") or [])
        usage = msg.get("usage") or {}
        params = msg.get("kv_transfer_params")
    except (ValueError, AttributeError, IndexError):
        raise WorkerError(Failure.OTHER, "a prefill answer that is not a completion's JSON") from None
    if not params:
        raise WorkerError(Failure.OTHER, "the prefill answer has no kv_transfer_params: the vLLM server runs no KV "
                                         "connector (--kv-transfer-config with kv_role kv_both, docs/vllm.md)")
    details = usage.get("prompt_tokens_details") or {}
    source = KVSource(request.request_id, endpoint.worker_id, endpoint.address, None, (), (VLLM,),
                      first_token=ids[0] if ids else None, engine_params=json.dumps(params))
    return WorkerChunk(ids, _FINISH.get(choice.get("finish_reason") or "length", "stop"),
                       Usage(int(usage.get("prompt_tokens", len(request.prompt_token_ids))),
                             int(details.get("cached_tokens") or 0), int(usage.get("completion_tokens", len(ids)))),
                       endpoint.worker_id, kv_source=source)


def new_session() -> aiohttp.ClientSession:
    """The router's one HTTP session (made on its loop): pooled keep-alive connections per server."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
                                 skip_auto_headers=("User-Agent",))
