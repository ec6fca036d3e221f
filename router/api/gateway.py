"""The endpoint picker's request life cycle, without its protocol (docs/epp.md).

A gateway (Envoy and the Gateway API Inference Extension) hands kvmesh one HTTP request at a time:
its headers, its OpenAI body (whole or in chunks), later its response. :class:`GatewayRequest` turns
that into the router's own request path: the body is parsed as it arrives by router/api/request_body.py
(refused at the first element past a bound), validated by router/api/openai_protocol.py, and routed by
the model's :class:`ModelRouter` (tokenize, hash, Lookup, pick, Reserve: ``decide``, the very code a
request through ``kvmesh router`` runs), then handed off (:class:`Handoff`: the in-flight share, the
policy hooks, the miss audit). Its answer is a :class:`Pick` (the endpoints, the picked one first, then
the fallbacks a retry would try) or a :class:`Refusal` (an HTTP status and an OpenAI error body).

router/api/ext_proc.py speaks Envoy's ext_proc v3 around it. This module imports neither grpc nor redis.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import pydantic

from kvmesh.contract.errors import InvalidArgument, KVMeshError, NotFound, Unavailable
from kvmesh.contract.types import Usage
from kvmesh.router.api.body_bounds import BodyTooLarge
from kvmesh.router.api.frontend import Frontend
from kvmesh.router.api.objectives import objectives_from_headers
from kvmesh.router.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    public_param,
    validation_error,
)
from kvmesh.router.api.request_body import BodyParser
from kvmesh.router.config import EppConfig, RouterConfig
from kvmesh.router.request.handoff import Handoff
from kvmesh.transport import http, tracing

log = logging.getLogger("kvmesh.epp")

MAX_REQUEST_ID_CHARS = 128
RESPONSE_TAIL_BYTES = 64 * 1024
"""Bytes of a response's end kept to read its usage (the last event of a stream, or a whole JSON answer)."""


@dataclass(slots=True, frozen=True)
class Pick:
    """Where the gateway sends the request: ``endpoints[0]``, then the others in order."""

    endpoints: list[str]
    headers: dict[str, str] = field(default_factory=dict)
    """Request headers to set besides the destination (the trace's ``traceparent``)."""

    @property
    def value(self) -> str:
        """The destination header's and metadata's value: ``ip:port[,ip:port...]``."""
        return ",".join(self.endpoints)


@dataclass(slots=True, frozen=True)
class Refusal:
    """An immediate answer to the client instead of a pick."""

    status: int
    body: bytes

    @classmethod
    def of(cls, exc: BaseException, chat: bool | None = None) -> Refusal:
        status, message = (413, str(exc)) if isinstance(exc, BodyTooLarge) else http.status_for(exc)
        if status == 500:
            log.error("unhandled error picking an endpoint", exc_info=exc)
        code = {404: "model_not_found"}.get(status)
        body = http.error_body(status, message, param=public_param(http.param_of(exc), chat), code=code)
        return cls(status, json.dumps(body, separators=(",", ":")).encode())


def endpoint_of(address: str, target_port: int | None = None) -> str:
    """A worker's address as the gateway's ``ip:port``: a URL's host and port (an engine served over the
    OpenAI API, behind its bridge), a kvmesh worker's host:port; ``target_port`` replaces the port (the
    InferencePool's target port: the pod's OpenAI server)."""
    if "://" in address:
        u = urlsplit(address)
        host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    else:
        host, _, p = address.rpartition(":")
        port = int(p) if p.isdigit() else 0
    if target_port:
        port = target_port
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{port}"


def usage_of(tail: bytes, streamed: bool) -> Usage | None:
    """The usage an OpenAI answer reports (``usage`` with ``prompt_tokens_details.cached_tokens``):
    the last server-sent event that has one, or the JSON object; None when there is none."""
    try:
        if streamed:
            for line in reversed(tail.split(b"\n")):
                line = line.strip()
                if line.startswith(b"data:") and b'"usage"' in line:
                    obj = json.loads(line[5:])
                    if obj.get("usage"):
                        return _usage(obj["usage"])
            return None
        obj = json.loads(tail)
        return _usage(obj["usage"]) if isinstance(obj, dict) and obj.get("usage") else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _usage(u: Mapping[str, Any]) -> Usage:
    details = u.get("prompt_tokens_details") or {}
    return Usage(int(u.get("prompt_tokens") or 0), int(details.get("cached_tokens") or 0),
                 int(u.get("completion_tokens") or 0))


class GatewayRequest:
    """One HTTP request the gateway asks about, from its headers to its response's end.

    Args:
        frontend: the models served, the stream limit and the metrics (shared with any other front).
        config: the router's flags (body bounds).
        epp: the endpoint picker's flags (fallbacks, target port).
    """

    def __init__(self, frontend: Frontend, config: RouterConfig, epp: EppConfig) -> None:
        self.frontend = frontend
        self.config = config
        self.epp = epp
        self.headers: dict[str, str] = {}
        self.subset: set[str] | None = None
        self.chat: bool | None = None
        self._parser: BodyParser | None = None
        self._seen = 0
        self._admitted = False
        self._outcome = "cancelled"
        self.handoff: Handoff | None = None
        self.picked: Pick | None = None
        self._endpoints: dict[str, str] = {}
        """endpoint -> worker id of the plan's workers (to learn who served)."""
        self._tail = bytearray()
        self._streamed = False
        self._status = 0
        self._span: Any = None
        self._pool: Any = None
        """The picked model's worker pool (a pick the gateway could not reach is marked down there)."""

    # -- the request ------------------------------------------------------------------------------
    def on_headers(self, headers: Mapping[str, str], subset: Sequence[str] | None, end_of_stream: bool
                   ) -> Pick | Refusal | None:
        """The request's headers; a bodyless request (``end_of_stream``) is answered at once (the least
        loaded worker); else None: the body decides."""
        self.headers = {k.lower(): v for k, v in headers.items()}
        self.subset = set(subset) if subset is not None else None
        if tracing.ON:
            self._span = tracing.start("epp.request", tracing.extract(self.headers),
                                       {"http.route": self.headers.get(":path", "")}, kind="server")
        try:
            self.frontend.admit()
            self._admitted = True
            path = self.headers.get(":path", "").split("?", 1)[0].rstrip("/")
            if end_of_stream:
                return self._bodyless()
            if path.endswith("/chat/completions"):
                self.chat = True
            elif path.endswith("/completions"):
                self.chat = False
            else:
                raise NotFound(f"no route {path[:80]!r} for a request with a body: the endpoint picker routes "
                               "POST /v1/chat/completions and /v1/completions")
            self._parser = BodyParser(self.frontend.body_bounds(self.config))
        except (KVMeshError, ValueError) as exc:
            return self._refuse(exc)
        return None

    async def on_body(self, chunk: bytes, end_of_stream: bool) -> Pick | Refusal | None:
        """A piece of the body; the pick (or the refusal) once it is whole, None before."""
        if self._parser is None:
            return None
        try:
            self._seen += len(chunk)
            if self._seen > self.config.max_body_bytes:
                raise BodyTooLarge(self.config.max_body_bytes)
            if chunk:
                await self._parser.feed(chunk, end_of_stream)
            if not end_of_stream:
                return None
            raw = self._parser.close()
            self._parser = None
            return await self._route(raw)
        except pydantic.ValidationError as exc:
            return self._refuse(validation_error(exc))
        except (KVMeshError, ValueError, BodyTooLarge) as exc:
            return self._refuse(exc)

    async def _route(self, raw: dict[str, Any]) -> Pick:
        body = (ChatCompletionRequest if self.chat else CompletionRequest).model_validate(raw)
        rid = self.headers.get("x-request-id", "")
        if len(rid) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"the x-request-id header has {len(rid)} characters; at most {MAX_REQUEST_ID_CHARS}")
        served, adapter = self.frontend.target(body.model)
        router = served.router
        inp = replace(body.to_input(rid), objectives=objectives_from_headers(self.headers,
                                                                              self.config.default_objectives()),
                      adapter=adapter)
        rid = router.request_id_for(inp)
        if self._span is not None:
            self._span.set_attribute("kvmesh.request_id", rid)  # the id the worker and the logs know it by
        only = self._only()
        with tracing.current(self._span):
            plan, decision = await router.decide(inp, rid, only)
        target = self.epp.target_port
        self._endpoints = {endpoint_of(e.address, target): w for w, e in plan.endpoints.items()}
        workers = [decision.worker_id, *router.fallbacks(plan, decision, self.epp.fallbacks)]
        self.handoff = router.hand_off(plan, decision, rid)
        self._pool = served.pool
        headers: dict[str, str] = {}
        if self._span is not None:
            self._span.set_attribute("kvmesh.worker_id", decision.worker_id)
            with tracing.current(self._span):
                tracing.inject(headers)  # the engine's own spans (vLLM's OpenTelemetry) join the trace
        return self._pick([endpoint_of(plan.endpoints[w].address, target) for w in workers], headers)

    def _only(self) -> Callable[[str, str], bool] | None:
        subset = self.subset
        if subset is None:
            return None
        target = self.epp.target_port
        return lambda _w, address: endpoint_of(address, target) in subset

    def _bodyless(self) -> Pick:
        """A request without a body (a GET through the pool): the default model's least loaded worker."""
        served = self.frontend.models.default()
        endpoints = served.pool.endpoints() if served is not None else []
        target = self.epp.target_port
        ok = [e for e in endpoints if self.subset is None or endpoint_of(e.address, target) in self.subset]
        if not ok:
            raise Unavailable("no ready endpoint" + (" in the gateway's subset" if self.subset is not None else ""))
        best = min(ok, key=lambda e: (e.load.num_running + e.load.num_waiting, e.worker_id))
        return self._pick([endpoint_of(best.address, target)], {})

    def _pick(self, endpoints: list[str], headers: dict[str, str]) -> Pick:
        self.picked = Pick(endpoints, headers)
        self._outcome = "ok"
        tracing.set_ok(self._span)
        return self.picked

    def _refuse(self, exc: BaseException) -> Refusal:
        self._outcome = "error"
        refusal = Refusal.of(exc, self.chat)
        log.info("request %s: refused with %d: %s", self.headers.get("x-request-id", "-"), refusal.status, exc)
        if self._span is not None:
            self._span.set_attribute("http.response.status_code", refusal.status)
            tracing.set_error(self._span, exc)
        return refusal

    # -- the response path ---------------------------------------------------------------------------
    def on_response_headers(self, headers: Mapping[str, str]) -> None:
        """The response's headers (its status and whether it streams)."""
        h = {k.lower(): v for k, v in headers.items()}
        status = h.get(":status", "")
        self._status = int(status) if status.isdigit() else 0
        self._streamed = "text/event-stream" in h.get("content-type", "")

    def on_served(self, endpoint: str) -> None:
        """The endpoint that served (the gateway's ``x-gateway-destination-endpoint-served``)."""
        if self.handoff is not None:
            worker = self._endpoints.get(endpoint.split(",", 1)[0].strip())
            picked = self.handoff.worker_id
            if worker is not None:
                self.handoff.served_by(worker)
            if worker is not None and worker != picked and self._pool is not None:
                # NOTE: the gateway went down the fallbacks: the pick did not answer it. Marked down here
                # and reported, so every front drops it (router/workers/down_reports.py).
                self._pool.mark_unhealthy(picked)

    def on_response_body(self, chunk: bytes, end_of_stream: bool) -> None:
        """A piece of the response: the first is the first token (as far as the gateway tells); the end
        carries the usage the miss audit reads."""
        h = self.handoff
        if h is None:
            return
        if chunk:
            h.first_token()
            self._tail += chunk
            if len(self._tail) > RESPONSE_TAIL_BYTES:
                del self._tail[:len(self._tail) - RESPONSE_TAIL_BYTES]
        if end_of_stream:
            usage = usage_of(bytes(self._tail), self._streamed) if self._status in (0, 200) else None
            h.finished(usage, "ok" if self._status in (0, 200) else f"HTTP {self._status}")

    def close(self) -> None:
        """The gateway's stream ended (the request is over, or the gateway gave up): frees what is held."""
        if self.handoff is not None:
            self.handoff.finished(None, "ended" if self._status else "no response seen")
        if self._admitted:
            self._admitted = False
            self.frontend.release(self._outcome)
        if self._span is not None:
            self._span.end()
            self._span = None
