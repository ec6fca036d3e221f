"""The request path: validate, tokenize, hash, look up, pick, forward, stream back.

The gRPC adapter (router/server.py) turns a GenerateRequest into a :class:`GenerateInput`, iterates
:meth:`Router.generate` and turns each :class:`GenerateOutput` into a GenerateResponse. Workers and
the index are reached through router/upstream.py's protocols, so this module imports neither
grpc nor redis; errors are kvmesh.contract.errors, mapped to status codes by kvmesh/transport/rpc.py.

Everything here runs on the router's event loop. The decisions (chain, candidates, pick, in-flight
accounting) are router/core.py's synchronous code; only I/O is awaited: the Lookup, the worker's
stream, and tokenizing a long text (router/prompt.py: on a thread of the tokenizer pool, within
the prompt bounds). A client that goes away cancels the request's task; the cancellation reaches
the open worker call at its await, and the ``finally`` blocks free its in-flight share.

Every request is validated here (router/prompt.py), whichever front end built it, before any work
is spent on it. Public messages name no worker and no address (a client has no use for the mesh's
topology): the details go to this router's log, under the request's id.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from tokenizers import Tokenizer

from kvmesh.contract.errors import InvalidArgument, KVMeshError, ResourceExhausted, Unavailable
from kvmesh.contract.limits import MAX_CHAIN_BLOCKS
from kvmesh.contract.types import DEFAULT_MAX_TOKENS, SamplingParams, Usage
from kvmesh.router.config import RouterConfig
from kvmesh.router.core import RoutePlan, RoutingCore
from kvmesh.router.detokenize import IncrementalDetokenizer
from kvmesh.router.inflight import InFlight
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.policy import Decision, PolicyConfig, RouterPolicy, make_policy
from kvmesh.router.prompt import PromptLimits, PromptTokenizer, check_input
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
    request_id: str = ""
    """On the first output only: the id the request has in the router's and the worker's logs."""


class Router:
    """The request path; one per process, on the server's event loop.

    Args:
        config: the router's flags.
        pool: the workers of the model (router/discovery.py).
        index: the kv_service Lookup, or None to route without an index.
        tokenizer: the model's tokenizer, or None (clients must then send token ids).
        metrics: where to count (the server's, served on /metrics); default: a private registry.
        context_len: the model's context length (from its config.json), the default prompt bound.
    """

    def __init__(self, config: RouterConfig, pool: WorkerPool, index: AsyncPrefixIndex | None,
                 tokenizer: Tokenizer | None = None, policy: RouterPolicy | None = None,
                 speculative: SpeculativeIndex | None = None, metrics: RouterMetrics | None = None,
                 context_len: int | None = None) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.metrics = metrics or RouterMetrics()
        self.prompts = (PromptTokenizer(tokenizer, self.metrics.tokenized_chars.inc, self.metrics.tokenizing.inc)
                        if tokenizer is not None else None)
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

    def close(self) -> None:
        """Stops the tokenizer pool (the server's stop)."""
        if self.prompts is not None:
            self.prompts.close()

    # -- validation --------------------------------------------------------------------------
    def limits(self) -> PromptLimits:
        """The prompt bounds now: the flags over the model's context (its config.json, or the
        smallest max_model_len static workers report)."""
        cfg = self.config
        context = self.context_len or getattr(self.pool, "max_model_len", 0) or None
        try:
            block_size = self.pool.model_spec().block_size
        except Unavailable:
            block_size = cfg.block_size
        return PromptLimits.resolve(cfg.max_prompt_tokens, cfg.max_prompt_bytes, context, block_size)

    def request_id_for(self, inp: GenerateInput) -> str:
        """The id the request has from here on (worker, logs, the client's first message): the
        client's id with a random suffix, or a random one. Raises InvalidArgument on a bad id."""
        check_input(inp.request_id, inp.cache_salt)
        # NOTE: the client's id is only unique to that client; clients (or routers) sharing a
        # worker may reuse one, so the worker gets it with a random suffix, as vLLM's engine does.
        return f"{inp.request_id}-{uuid.uuid4().hex[:12]}" if inp.request_id else uuid.uuid4().hex

    def _refused(self, limit: str) -> None:
        self.metrics.prompts_refused.labels(limit).inc()

    # -- decision path (tokenize + hash + lookup + pick) ------------------------------------
    async def tokenize(self, inp: GenerateInput, limits: PromptLimits | None = None) -> list[int]:
        """The prompt's token ids within the prompt bounds; raises InvalidArgument on an empty or
        missing prompt, InvalidArgument / ResourceExhausted past a bound (router/prompt.py)."""
        limits = limits or self.limits()
        if inp.token_ids is not None:
            if not inp.token_ids:
                raise InvalidArgument("token_ids is empty: send at least one prompt token")
            try:
                limits.check_tokens(len(inp.token_ids))
            except KVMeshError:
                self._refused("tokens")
                raise
            return list(inp.token_ids)
        if inp.text is None:
            raise InvalidArgument("the request sets no input: set text or token_ids")
        if not inp.text:
            raise InvalidArgument("text is empty: send a non-empty prompt")
        if self.prompts is None:
            raise InvalidArgument("this router has no tokenizer (start it with --model DIR): send token_ids")
        try:
            limits.check_bytes(inp.text)
        except KVMeshError:
            self._refused("bytes")
            raise
        try:
            # NOTE: add_special_tokens=True, as the worker's offline path encodes, so both hash the same ids.
            return await self.prompts.encode(inp.text, limits)
        except KVMeshError:
            self._refused("tokens")
            raise

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
                    # NOTE: the index answers at most MAX_CHAIN_BLOCKS blocks; a longer prompt
                    # (--max-prompt-tokens 0) is looked up by its leading ones, never refused.
                    answer = await self.index.lookup(spec.model_id, chain[:MAX_CHAIN_BLOCKS])
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
        check_input(inp.request_id, inp.cache_salt)
        token_ids = await self.tokenize(inp)
        self._check_limits(inp.sampling.max_tokens)
        plan = await self.plan(token_ids, inp.cache_salt)
        if not plan.candidates:
            raise Unavailable(self._no_worker_message())
        decision = self.core.pick(plan)
        self.metrics.decision_latency_s.observe(time.perf_counter() - t0)
        return plan, decision

    def _check_limits(self, max_tokens: int | None) -> None:
        cfg = self.config
        if cfg.max_tokens_limit and (max_tokens or DEFAULT_MAX_TOKENS) > cfg.max_tokens_limit:
            raise ResourceExhausted(f"max_tokens {max_tokens or DEFAULT_MAX_TOKENS} is over this router's limit of "
                                    f"{cfg.max_tokens_limit} (--max-tokens-limit)")

    def _no_worker_message(self) -> str:
        spec = self.pool.model_spec()
        why = self.pool.problem or "none has a live lease in kv_service (or answers in --workers)"
        return f"no worker is available for model {spec.model_id!r}: {why}"

    # -- forwarding ---------------------------------------------------------------------------
    async def generate(self, inp: GenerateInput, request_id: str | None = None) -> AsyncIterator[GenerateOutput]:
        """Routes the request and streams the worker's tokens back.

        Before the first token a worker that is down, busy or too slow is replaced by the next pick
        (up to ``max_attempts``); after it, a worker failure ends the stream with Unavailable.
        Cancelling the consuming task (the client went away) cancels the worker call. The first
        output carries the request's id; one log line at the default level says how it ended.

        Args:
            request_id: the id :meth:`request_id_for` made (a front end that wants it before the
                first output, e.g. for trailers); None = made here.

        Raises:
            InvalidArgument: the request is bad (here or at the worker).
            Unavailable: no worker could take it, or the worker failed mid-stream.
            ResourceExhausted: every worker tried was at capacity, or the prompt is over a limit.
        """
        rid = request_id or self.request_id_for(inp)
        route: dict[str, object] = {}
        try:
            async for out in self._generate(inp, rid, route):
                if out.finish_reason is not None:
                    u = out.usage or Usage()
                    log.info("request %s: %s on %s (%s, %s of %s blocks matched): prompt %d cached %d completion %d "
                             "tokens", rid, out.finish_reason, out.served_by, route.get("reason"),
                             route.get("matched"), route.get("blocks"), u.prompt_tokens, u.cached_tokens,
                             u.completion_tokens)
                yield out
        except KVMeshError as exc:
            log.info("request %s: %s: %s", rid, type(exc).__name__, exc)
            raise
        except asyncio.CancelledError:
            log.info("request %s: cancelled (the client went away or its deadline passed)", rid)
            raise

    async def _generate(self, inp: GenerateInput, rid: str, route: dict[str, object]) -> AsyncIterator[GenerateOutput]:
        plan, decision = await self.decide(inp)
        budget = self.config.request_timeout_s if inp.timeout_s is None else min(inp.timeout_s,
                                                                                 self.config.request_timeout_s)
        deadline = time.monotonic() + budget
        request = WorkerRequest(rid, plan.token_ids, inp.sampling, inp.cache_salt)
        remaining = list(plan.candidates)
        failures: list[tuple[WorkerEndpoint, WorkerError]] = []
        first = True
        for attempt in range(self.config.max_attempts):
            if attempt:
                if not remaining:
                    break
                decision = self.core.pick(plan, remaining)
            remaining = [c for c in remaining if c.worker_id != decision.worker_id]
            endpoint = plan.endpoints[decision.worker_id]
            route.update(reason=decision.reason, matched=plan.candidate(decision.worker_id).matched_blocks,
                         blocks=len(plan.query.block_hashes))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                async for out in self._stream(endpoint, plan, request, left):
                    if first:
                        out, first = replace(out, request_id=rid), False
                    yield out
                return
            except WorkerError as exc:  # only ever raised before the first token
                if exc.failure is Failure.CANCELLED:
                    return
                if exc.failure is Failure.INVALID:
                    # NOTE: the worker's own words about the request, without who said it.
                    raise InvalidArgument(exc.details) from None
                failures.append((endpoint, exc))
                if exc.failure not in RETRIABLE:
                    break
                if exc.failure is Failure.UNAVAILABLE:
                    self.pool.mark_unhealthy(endpoint.worker_id)
                self.metrics.retries.labels(exc.failure.value).inc()
                log.info("request %s: worker %s at %s %s before the first token (%s); trying another",
                         rid, endpoint.worker_id, endpoint.address, exc.failure.value, exc)
        if failures:
            log.warning("request %s: no worker took it: %s", rid,
                        "; ".join(f"{e.worker_id} at {e.address}: {x.failure.value} ({x})" for e, x in failures))
        kinds = ", ".join(x.failure.value for _, x in failures) or "the deadline passed"
        if failures and all(x.failure is Failure.BUSY for _, x in failures):
            raise ResourceExhausted(f"every worker tried is at capacity ({len(failures)} attempt(s)): retry later")
        raise Unavailable(f"no worker could take the request after {len(failures)} attempt(s) ({kinds}): "
                          "retry later")

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
                raise WorkerError(Failure.OTHER, "the stream ended without a finish reason") from None
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
                    raise WorkerError(Failure.OTHER, "the stream ended without a finish reason") from None
        except WorkerError as exc:
            if not started or exc.failure is Failure.CANCELLED:
                raise
            log.warning("request %s: worker %s at %s failed mid-stream: %s (%s)", request.request_id,
                        endpoint.worker_id, endpoint.address, exc.failure.value, exc)
            raise Unavailable(f"the worker serving the request failed mid-stream ({exc.failure.value}); "
                              "the tokens already sent stand") from None
        finally:
            self.core.finish(ticket)
            if call is not None:
                call.cancel()  # a no-op once the call has ended; frees it when the client left

    def _decode(self, ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
