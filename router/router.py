"""The request path: validate, tokenize, hash, look up, pick, forward, stream back.

The gRPC adapter (router/server.py) and the OpenAI HTTP adapter (router/openai_api.py) turn a
request into a :class:`GenerateInput`, iterate :meth:`Router.generate` (through router/frontend.py,
which picks the model's Router) and turn each :class:`GenerateOutput` into their messages. Workers and
the index are reached through router/upstream.py's protocols, so this module imports neither
grpc nor redis; errors are kvmesh.contract.errors, mapped to status codes by kvmesh/transport/rpc.py.

Everything here runs on the router's event loop. The decisions (chain, candidates, pick, in-flight
accounting) are router/core.py's synchronous code; only I/O is awaited: the Lookup, the worker's
stream, and tokenizing a long text (on a worker thread: ~3 ms per 1k tokens would hold up every
other stream on the loop). A client that goes away cancels the request's task; the cancellation
reaches the open worker call at its await, and the ``finally`` blocks free its in-flight share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from kvmesh.contract.errors import InvalidArgument, RequestTooLarge, ResourceExhausted, Unavailable
from kvmesh.contract.types import DEFAULT_MAX_TOKENS, SamplingParams, Usage
from kvmesh.router.chat_template import ChatTemplate
from kvmesh.router.config import RouterConfig
from kvmesh.router.core import RoutePlan, RoutingCore
from kvmesh.router.detokenize import IncrementalDetokenizer
from kvmesh.router.inflight import InFlight
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.policy import Decision, PolicyConfig, RouterPolicy, make_policy
from kvmesh.router.speculative import SpeculativeIndex
from kvmesh.router.stop_strings import StopStrings, check_stop_strings
from kvmesh.router.upstream import (
    RETRIABLE,
    AsyncPrefixIndex,
    Failure,
    IndexMatch,
    IndexUnavailable,
    WorkerChunk,
    WorkerEndpoint,
    WorkerError,
    WorkerPool,
    WorkerRequest,
)

log = logging.getLogger("kvmesh.router")

TOKENIZE_IN_THREAD_CHARS = 2048
"""Texts longer than this are tokenized on a worker thread (about 0.5 ms of the loop and up)."""
ABORT_DRAIN_S = 2.0
"""After a stop string, how long the worker's final message (with the request's usage) is awaited."""


@dataclass(slots=True, frozen=True)
class ChatInput:
    """A conversation for the model's chat template (router/chat_template.py)."""

    messages: Sequence[Mapping[str, Any]]
    """``{"role", "content"[, "name"]}`` each, content as text."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra template variables (vLLM's ``chat_template_kwargs``)."""


@dataclass(slots=True, frozen=True)
class GenerateInput:
    """A client request, already converted from protobuf or JSON; exactly one of text / token_ids /
    chat is set."""

    text: str | None
    token_ids: Sequence[int] | None
    sampling: SamplingParams
    cache_salt: str = ""
    request_id: str = ""
    timeout_s: float | None = None
    """Time the client has left (its gRPC deadline); None = no client deadline."""
    chat: ChatInput | None = None
    stop: Sequence[str] = ()
    """Stop strings (router/stop_strings.py); they need the model's tokenizer."""
    include_stop_str_in_output: bool = False


@dataclass(slots=True, frozen=True)
class GenerateOutput:
    token_ids: Sequence[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    served_by: str = ""


class Router:
    """The request path of one model, on the server's event loop.

    One Router serves one model (router/models.py keeps one per model): its own pool, tokenizer,
    chat template, speculative map and in-flight view, so models never share routing state.

    Args:
        config: the router's flags.
        pool: the workers of the model (router/discovery.py).
        index: the kv_service Lookup, or None to route without an index.
        tokenizer: the model's tokenizer, or None (clients must then send token ids).
        metrics: where to count (the server's, served on /metrics); default: a private registry.
        chat_template: the model's chat template, or None (chat requests are refused).
    """

    def __init__(self, config: RouterConfig, pool: WorkerPool, index: AsyncPrefixIndex | None,
                 tokenizer: Tokenizer | None = None, policy: RouterPolicy | None = None,
                 speculative: SpeculativeIndex | None = None, metrics: RouterMetrics | None = None,
                 chat_template: ChatTemplate | None = None) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.metrics = metrics or RouterMetrics()
        policy = policy or make_policy(config.policy, PolicyConfig(
            decode_cost_tokens=config.decode_cost_tokens, overlap_weight=config.overlap_weight,
            decode_harm_weight=config.decode_harm_weight, work_weight=config.work_weight,
            balance_factor=config.balance_factor,
            balance_min_tokens=config.balance_min_tokens, fallback_prefix_blocks=config.fallback_prefix_blocks,
            seed=config.seed))
        self.core = RoutingCore(policy, speculative_ttl_s=config.speculative_ttl_s,
                                index_retry_s=config.index_retry_s, observer=self.metrics)
        if speculative is not None:
            self.core.speculative = speculative

    @property
    def policy(self) -> RouterPolicy:
        return self.core.policy

    @property
    def speculative(self) -> SpeculativeIndex:
        return self.core.speculative

    @property
    def inflight(self) -> InFlight:
        return self.core.inflight

    # -- decision path (tokenize + hash + lookup + pick) ------------------------------------
    async def tokenize(self, inp: GenerateInput) -> list[int]:
        """The prompt's token ids; raises InvalidArgument on an empty or missing prompt."""
        if inp.token_ids is not None:
            if not inp.token_ids:
                raise InvalidArgument("token_ids is empty: send at least one prompt token")
            return list(inp.token_ids)
        if inp.chat is not None:
            return await self._encode(self.render_chat(inp.chat), add_special_tokens=False)
        if inp.text is None:
            raise InvalidArgument("the request sets no input: set text, token_ids or chat")
        if not inp.text:
            raise InvalidArgument("text is empty: send a non-empty prompt")
        # NOTE: add_special_tokens=True, as the worker's offline path encodes, so both hash the same ids.
        return await self._encode(inp.text, add_special_tokens=True)

    def render_chat(self, chat: ChatInput) -> str:
        """The conversation as prompt text, by the model's chat template.

        Raises:
            InvalidArgument: no tokenizer or template for the model, or the template refused the messages.
        """
        model = self.pool.model_spec().model_id
        if self.tokenizer is None:
            raise InvalidArgument(f"this router has no tokenizer for model {model!r} (start it with --model DIR): "
                                  "chat needs the model's tokenizer and chat template; send token_ids instead")
        if self.chat_template is None:
            raise InvalidArgument(f"model {model!r} has no chat template (chat_template in its tokenizer_config.json "
                                  "or a chat_template.jinja): send text or token_ids instead")
        return self.chat_template.render(chat.messages, add_generation_prompt=chat.add_generation_prompt,
                                         continue_final_message=chat.continue_final_message,
                                         extra=chat.template_kwargs)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgument("this router has no tokenizer (start it with --model DIR): send token_ids")
        if len(text) > TOKENIZE_IN_THREAD_CHARS:
            # The Rust tokenizer releases the GIL: the loop keeps serving the other streams.
            return (await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    async def plan(self, token_ids: list[int], cache_salt: str = "", max_tokens: int = 0) -> RoutePlan:
        """Hashes the prompt, asks the index at most once and builds the candidates: router/core.py's
        ``plan`` with the Lookup awaited."""
        core, spec = self.core, self.pool.model_spec()
        chain = core.chain(spec, token_ids, cache_salt)
        answer: list[IndexMatch] | None = None
        index_ok = True
        if core.wants_index(chain):
            index_ok = core.index_allowed(self.index is not None)
            if index_ok:
                assert self.index is not None
                t0 = time.perf_counter()
                try:
                    answer = await self.index.lookup(spec.model_id, chain)
                except IndexUnavailable as exc:
                    core.lookup_failed(exc)
                    index_ok = False
                else:
                    core.lookup_succeeded(time.perf_counter() - t0)
        return core.build(spec, token_ids, chain, self.pool.endpoints(), answer, index_ok,
                          adopt=self.pool.discovers_from_index, healthy=self.pool.healthy, max_tokens=max_tokens)

    async def decide(self, inp: GenerateInput) -> tuple[RoutePlan, Decision]:
        """Tokenize + hash + lookup + pick, and the speculative record: all the server does
        before forwarding (benchmarks/router_overhead.py times exactly this)."""
        t0 = time.perf_counter()
        if inp.stop:
            try:
                check_stop_strings(inp.stop)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            if self.tokenizer is None:
                raise InvalidArgument("stop strings need the model's tokenizer at the router (--model DIR); "
                                      "use stop_token_ids")
        token_ids = await self.tokenize(inp)
        self._check_limits(len(token_ids), inp.sampling.max_tokens)
        plan = await self.plan(token_ids, inp.cache_salt, inp.sampling.max_tokens or DEFAULT_MAX_TOKENS)
        if not plan.candidates:
            raise Unavailable(self._no_worker_message())
        decision = self.core.pick(plan)
        self.metrics.decision_latency_s.observe(time.perf_counter() - t0)
        return plan, decision

    def _check_limits(self, prompt_tokens: int, max_tokens: int | None) -> None:
        cfg = self.config
        if cfg.max_prompt_tokens and prompt_tokens > cfg.max_prompt_tokens:
            raise RequestTooLarge(f"the prompt has {prompt_tokens} tokens; this router accepts at most "
                                    f"{cfg.max_prompt_tokens} (--max-prompt-tokens)")
        if cfg.max_tokens_limit and (max_tokens or DEFAULT_MAX_TOKENS) > cfg.max_tokens_limit:
            raise RequestTooLarge(f"max_tokens {max_tokens or DEFAULT_MAX_TOKENS} is over this router's limit of "
                                    f"{cfg.max_tokens_limit} (--max-tokens-limit)")

    def _no_worker_message(self) -> str:
        spec = self.pool.model_spec()
        why = self.pool.problem or "none has a live lease in kv_service (or answers in --workers)"
        return f"no worker is available for model {spec.model_id!r}: {why}"

    # -- forwarding ---------------------------------------------------------------------------
    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateOutput]:
        """Routes the request and streams the worker's tokens back.

        Before the first token a worker that is down, busy or too slow is replaced by the next pick
        (up to ``max_attempts``); after it, a worker failure ends the stream with Unavailable.
        Cancelling the consuming task (the client went away) cancels the worker call.

        Raises:
            InvalidArgument: the request is bad (here or at the worker).
            Unavailable: no worker could take it, or the worker failed mid-stream.
            ResourceExhausted: every worker tried was at capacity.
        """
        plan, decision = await self.decide(inp)
        budget = self.config.request_timeout_s if inp.timeout_s is None else min(inp.timeout_s,
                                                                                 self.config.request_timeout_s)
        deadline = time.monotonic() + budget
        # NOTE: the client's id is only unique to that client; clients (or routers) sharing a
        # worker may reuse one, so the worker gets it with a random suffix, as vLLM's engine does.
        worker_rid = f"{inp.request_id}-{uuid.uuid4().hex[:12]}" if inp.request_id else uuid.uuid4().hex
        request = WorkerRequest(worker_rid, plan.token_ids, inp.sampling, inp.cache_salt)
        remaining = list(plan.candidates)
        failures: list[tuple[str, WorkerError]] = []
        for attempt in range(self.config.max_attempts):
            if attempt:
                if not remaining:
                    break
                decision = self.core.pick(plan, remaining)
            remaining = [c for c in remaining if c.worker_id != decision.worker_id]
            endpoint = plan.endpoints[decision.worker_id]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                async for out in self._stream(endpoint, plan, request, left, inp):
                    yield out
                return
            except WorkerError as exc:  # only ever raised before the first token
                if exc.failure is Failure.CANCELLED:
                    return
                if exc.failure is Failure.INVALID:
                    raise InvalidArgument(str(exc)) from None
                failures.append((endpoint.worker_id, exc))
                if exc.failure not in RETRIABLE:
                    break
                if exc.failure is Failure.UNAVAILABLE:
                    self.pool.mark_unhealthy(endpoint.worker_id)
                self.metrics.retries.labels(exc.failure.value).inc()
                log.info("request %s: worker %s %s before the first token (%s); trying another",
                         request.request_id, endpoint.worker_id, exc.failure.value, exc)
        detail = "; ".join(f"{w}: {e.failure.value} ({e})" for w, e in failures) or "deadline passed"
        if failures and all(e.failure is Failure.BUSY for _, e in failures):
            raise ResourceExhausted(f"every worker tried is at capacity, retry later: {detail}")
        raise Unavailable(f"no worker could take the request after {len(failures)} attempt(s): {detail}")

    async def _stream(self, endpoint: WorkerEndpoint, plan: RoutePlan, request: WorkerRequest,
                      timeout_s: float, inp: GenerateInput) -> AsyncIterator[GenerateOutput]:
        """One attempt. Raises WorkerError only before the first chunk has been yielded."""
        ticket = self.core.start(plan, endpoint.worker_id)
        detok = IncrementalDetokenizer(self._decode) if self.tokenizer is not None else None
        stops = StopStrings(inp.stop, inp.include_stop_str_in_output) if inp.stop and detok is not None else None
        completion = 0
        started = False
        call = None
        try:
            call = self.pool.generate(endpoint, request, timeout_s)
            chunks = call.__aiter__()
            first_token_s = self.config.first_token_timeout_s
            try:
                if 0 < first_token_s < timeout_s:
                    # NOTE: a worker that sits on a request is given up on while there is still
                    # time to retry elsewhere; the call's own deadline is the whole request budget.
                    chunk = await asyncio.wait_for(chunks.__anext__(), first_token_s)
                else:
                    chunk = await chunks.__anext__()
            except asyncio.TimeoutError:  # noqa: UP041 - TimeoutError only from Python 3.11
                raise WorkerError(Failure.TIMEOUT, f"no first token within {first_token_s:g}s "
                                                   "(--first-token-timeout)") from None
            except StopAsyncIteration:
                raise WorkerError(Failure.OTHER, f"worker {endpoint.worker_id} ended the stream without a "
                                                 "finish reason") from None
            started = True
            self.core.prefilled(ticket)
            while True:
                if stops is None:
                    ids = chunk.token_ids
                    text = detok.push(ids) if detok is not None else ""
                else:
                    assert detok is not None
                    # NOTE: token by token, so the output ends at the token that completed the stop.
                    ids, text = [], ""
                    for t in chunk.token_ids:
                        ids.append(t)
                        text += stops.push(detok.push([t]))
                        if stops.matched is not None:
                            break
                completion += len(ids)
                if stops is not None and stops.matched is not None:
                    usage = await self._end_at_stop(endpoint, request, chunks, completion)
                    yield GenerateOutput(ids, text, "stop", usage, endpoint.worker_id)
                    return
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                    if detok is not None:
                        tail = detok.flush()
                        if stops is not None:
                            tail = stops.push(tail)
                            finish = "stop" if stops.matched is not None else finish
                            tail += stops.flush()
                        text += tail
                    yield GenerateOutput(ids, text, finish, chunk.usage, chunk.worker_id or endpoint.worker_id)
                    return
                yield GenerateOutput(ids, text)
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    raise WorkerError(Failure.OTHER, f"worker {endpoint.worker_id} ended the stream without a "
                                                     "finish reason") from None
        except WorkerError as exc:
            if not started or exc.failure is Failure.CANCELLED:
                raise
            raise Unavailable(f"worker {endpoint.worker_id} failed mid-stream: {exc.failure.value} ({exc})") from None
        finally:
            self.core.finish(ticket)
            if call is not None:
                call.cancel()  # a no-op once the call has ended; frees it when the client left

    async def _end_at_stop(self, endpoint: WorkerEndpoint, request: WorkerRequest,
                           chunks: AsyncIterator[WorkerChunk], completion: int) -> Usage:
        """A stop string ended the text: the worker is told to abort, and its last message (which
        carries the prompt's cached tokens) is awaited for at most ABORT_DRAIN_S."""
        usage = None
        if await self.pool.abort(endpoint, request.request_id):
            async def last() -> Usage | None:
                async for c in chunks:
                    if c.finish_reason is not None:
                        return c.usage
                return None

            with contextlib.suppress(asyncio.TimeoutError, WorkerError):  # noqa: UP041 - 3.10's TimeoutError
                usage = await asyncio.wait_for(last(), ABORT_DRAIN_S)
        prompt = len(request.prompt_token_ids)
        return Usage(prompt, usage.cached_tokens if usage is not None else 0, completion)

    def _decode(self, ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
