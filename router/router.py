"""The request path: validate, tokenize, hash, look up, pick, forward, stream back.

The gRPC adapter (router/server.py) turns a GenerateRequest into a :class:`GenerateInput`, iterates
:meth:`Router.generate` and turns each :class:`GenerateOutput` into a GenerateResponse. Workers and
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
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from kvmesh.contract.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvmesh.contract.types import DEFAULT_MAX_TOKENS, SamplingParams, Usage
from kvmesh.router.config import RouterConfig
from kvmesh.router.core import RoutePlan, RoutingCore
from kvmesh.router.detokenize import IncrementalDetokenizer
from kvmesh.router.inflight import InFlight
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.policy import Decision, PolicyConfig, RouterPolicy, make_policy
from kvmesh.router.speculative import SpeculativeIndex
from kvmesh.router.upstream import (
    RETRIABLE,
    AsyncPrefixIndex,
    Failure,
    IndexMatch,
    IndexUnavailable,
    WorkerEndpoint,
    WorkerError,
    WorkerPool,
    WorkerRequest,
)

log = logging.getLogger("kvmesh.router")

TOKENIZE_IN_THREAD_CHARS = 2048
"""Texts longer than this are tokenized on a worker thread (about 0.5 ms of the loop and up)."""


@dataclass(slots=True, frozen=True)
class GenerateInput:
    """A client request, already converted from protobuf; exactly one of text / token_ids is set."""

    text: str | None
    token_ids: Sequence[int] | None
    sampling: SamplingParams
    cache_salt: str = ""
    request_id: str = ""
    timeout_s: float | None = None
    """Time the client has left (its gRPC deadline); None = no client deadline."""


@dataclass(slots=True, frozen=True)
class GenerateOutput:
    token_ids: Sequence[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    served_by: str = ""


class Router:
    """The request path; one per process, on the server's event loop.

    Args:
        config: the router's flags.
        pool: the workers of the model (router/discovery.py).
        index: the kv_service Lookup, or None to route without an index.
        tokenizer: the model's tokenizer, or None (clients must then send token ids).
        metrics: where to count (the server's, served on /metrics); default: a private registry.
    """

    def __init__(self, config: RouterConfig, pool: WorkerPool, index: AsyncPrefixIndex | None,
                 tokenizer: Tokenizer | None = None, policy: RouterPolicy | None = None,
                 speculative: SpeculativeIndex | None = None, metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.tokenizer = tokenizer
        self.metrics = metrics or RouterMetrics()
        policy = policy or make_policy(config.policy, PolicyConfig(
            decode_cost_tokens=config.decode_cost_tokens, overlap_weight=config.overlap_weight,
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
        if inp.text is None:
            raise InvalidArgument("the request sets no input: set text or token_ids")
        if not inp.text:
            raise InvalidArgument("text is empty: send a non-empty prompt")
        if self.tokenizer is None:
            raise InvalidArgument("this router has no tokenizer (start it with --model DIR): send token_ids")
        # NOTE: add_special_tokens=True, as the worker's offline path encodes, so both hash the same ids.
        if len(inp.text) > TOKENIZE_IN_THREAD_CHARS:
            # The Rust tokenizer releases the GIL: the loop keeps serving the other streams.
            return (await asyncio.to_thread(self.tokenizer.encode, inp.text, add_special_tokens=True)).ids
        return self.tokenizer.encode(inp.text, add_special_tokens=True).ids

    async def plan(self, token_ids: list[int], cache_salt: str = "") -> RoutePlan:
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
                          adopt=self.pool.discovers_from_index, healthy=self.pool.healthy)

    async def decide(self, inp: GenerateInput) -> tuple[RoutePlan, Decision]:
        """Tokenize + hash + lookup + pick, and the speculative record: all the server does
        before forwarding (benchmarks/router_overhead.py times exactly this)."""
        t0 = time.perf_counter()
        token_ids = await self.tokenize(inp)
        self._check_limits(len(token_ids), inp.sampling.max_tokens)
        plan = await self.plan(token_ids, inp.cache_salt)
        if not plan.candidates:
            raise Unavailable(self._no_worker_message())
        decision = self.core.pick(plan)
        self.metrics.decision_latency_s.observe(time.perf_counter() - t0)
        return plan, decision

    def _check_limits(self, prompt_tokens: int, max_tokens: int | None) -> None:
        cfg = self.config
        if cfg.max_prompt_tokens and prompt_tokens > cfg.max_prompt_tokens:
            raise ResourceExhausted(f"the prompt has {prompt_tokens} tokens; this router accepts at most "
                                    f"{cfg.max_prompt_tokens} (--max-prompt-tokens)")
        if cfg.max_tokens_limit and (max_tokens or DEFAULT_MAX_TOKENS) > cfg.max_tokens_limit:
            raise ResourceExhausted(f"max_tokens {max_tokens or DEFAULT_MAX_TOKENS} is over this router's limit of "
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
                async for out in self._stream(endpoint, plan, request, left):
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
                      timeout_s: float) -> AsyncIterator[GenerateOutput]:
        """One attempt. Raises WorkerError only before the first chunk has been yielded."""
        ticket = self.core.start(plan, endpoint.worker_id)
        detok = IncrementalDetokenizer(self._decode) if self.tokenizer is not None else None
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
                text = detok.push(chunk.token_ids) if detok is not None else ""
                if chunk.finish_reason is not None:
                    if detok is not None:
                        text += detok.flush()
                    yield GenerateOutput(chunk.token_ids, text, chunk.finish_reason, chunk.usage,
                                         chunk.worker_id or endpoint.worker_id)
                    return
                yield GenerateOutput(chunk.token_ids, text)
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

    def _decode(self, ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
