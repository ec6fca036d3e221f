"""The request path: validate, tokenize, hash, look up, pick, forward, stream back.

The gRPC adapter (router/server.py) turns a GenerateRequest into a :class:`GenerateInput`, calls
:meth:`Router.generate` and turns each :class:`GenerateOutput` into a GenerateResponse. Workers and
the index are reached through router/upstream.py's protocols, so this module imports neither
grpc nor redis; errors are kvmesh.contract.errors, mapped to status codes by kvmesh/rpc.py.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from tokenizers import Tokenizer

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvmesh.contract.types import DEFAULT_MAX_TOKENS, ModelSpec, SamplingParams, Usage
from kvmesh.router import metrics
from kvmesh.router.config import RouterConfig
from kvmesh.router.detokenize import IncrementalDetokenizer
from kvmesh.router.inflight import InFlight
from kvmesh.router.policy import (
    Candidate,
    Decision,
    PolicyConfig,
    RouteQuery,
    RouterPolicy,
    make_policy,
    uncached_tokens,
)
from kvmesh.router.speculative import SpeculativeIndex
from kvmesh.router.upstream import (
    RETRIABLE,
    Failure,
    IndexUnavailable,
    PrefixIndex,
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


@dataclass(slots=True)
class RoutePlan:
    """A request's tokens, chain and candidates; the first pick and every retry choose from it."""

    token_ids: list[int]
    query: RouteQuery
    candidates: list[Candidate]
    endpoints: dict[str, WorkerEndpoint]


class CancelScope:
    """Lets the adapter cancel whatever upstream call the request path has open (client gone)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._hook: Callable[[], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def attach(self, hook: Callable[[], None] | None) -> None:
        with self._lock:
            self._hook = hook
            run_now = self._cancelled and hook is not None
        if run_now:
            hook()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            hook = self._hook
        if hook is not None:
            hook()


class Router:
    """The router's core; one per process, shared by all server threads.

    Args:
        config: the router's flags.
        pool: the workers of the model (router/discovery.py).
        index: the kv_service Lookup, or None to route without an index.
        tokenizer: the model's tokenizer, or None (clients must then send token ids).
    """

    def __init__(self, config: RouterConfig, pool: WorkerPool, index: PrefixIndex | None,
                 tokenizer: Tokenizer | None = None, policy: RouterPolicy | None = None,
                 speculative: SpeculativeIndex | None = None) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.tokenizer = tokenizer
        self.policy = policy or make_policy(config.policy, PolicyConfig(
            decode_cost_tokens=config.decode_cost_tokens, overlap_weight=config.overlap_weight,
            balance_factor=config.balance_factor,
            balance_min_tokens=config.balance_min_tokens, fallback_prefix_blocks=config.fallback_prefix_blocks,
            seed=config.seed))
        self.speculative = speculative or SpeculativeIndex(config.speculative_ttl_s)
        self.inflight = InFlight()
        self._hashers: dict[ModelSpec, BlockHasher] = {}

    # -- decision path (tokenize + hash + lookup + pick) ------------------------------------
    def tokenize(self, inp: GenerateInput) -> list[int]:
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
        return self.tokenizer.encode(inp.text, add_special_tokens=True).ids

    def hasher(self, spec: ModelSpec) -> BlockHasher:
        h = self._hashers.get(spec)
        if h is None:
            h = self._hashers[spec] = BlockHasher(spec.model_id, spec.block_size, spec.hash_algorithm)
        return h

    def plan(self, token_ids: list[int], cache_salt: str = "") -> RoutePlan:
        """Hashes the prompt, asks the index once and builds the candidates."""
        spec = self.pool.model_spec()
        try:
            chain = self.hasher(spec).hash_prompt(token_ids, cache_salt)
        except ValueError as exc:
            raise InvalidArgument(f"token_ids: {exc}") from None
        endpoints = {e.worker_id: e for e in self.pool.endpoints()}
        matched: dict[str, int] = {}
        index_ok = True
        if self.policy.uses_index and chain:
            index_ok = self._lookup(spec.model_id, chain, endpoints, matched)
            for worker_id, n in self.speculative.matches(chain).items():
                if worker_id in endpoints and n > matched.get(worker_id, 0):
                    matched[worker_id] = n
        candidates = []
        for e in endpoints.values():
            requests, prefill = self.inflight.view(e.worker_id)
            candidates.append(Candidate(e.worker_id, e.address, matched.get(e.worker_id, 0), e.load, requests, prefill))
        healthy = [c for c in candidates if self.pool.healthy(c.worker_id)]
        # NOTE: unhealthy marks are hints: when every worker carries one, try them all anyway.
        return RoutePlan(token_ids, RouteQuery(len(token_ids), spec.block_size, chain, index_ok),
                         healthy or candidates, endpoints)

    def _lookup(self, model_id: str, chain: list[bytes], endpoints: dict[str, WorkerEndpoint],
                matched: dict[str, int]) -> bool:
        if self.index is None:
            metrics.FALLBACKS.labels("no_index").inc()
            return False
        t0 = time.perf_counter()
        try:
            answer = self.index.lookup(model_id, chain)
        except IndexUnavailable as exc:
            metrics.FALLBACKS.labels(exc.cause).inc()
            if exc.cause == "lookup_failed":
                log.warning("kv_service lookup failed, routing by rendezvous hash: %s", exc)
            return False
        metrics.LOOKUP_LATENCY.observe(time.perf_counter() - t0)
        adopt = self.pool.discovers_from_index
        for m in answer:
            known = endpoints.get(m.worker_id)
            if known is not None:
                # NOTE: the Lookup's load is fresher than the last discovery poll.
                endpoints[m.worker_id] = replace(known, load=m.load)
            elif adopt:  # registered since the last poll
                endpoints[m.worker_id] = WorkerEndpoint(m.worker_id, m.address, m.load)
            else:  # static --workers: a worker outside the list is not ours to use
                continue
            matched[m.worker_id] = m.matched_blocks
        return True

    def decide(self, inp: GenerateInput) -> tuple[RoutePlan, Decision]:
        """Tokenize + hash + lookup + pick, and the speculative record: all the server does
        before forwarding (benchmarks/router_overhead.py times exactly this)."""
        t0 = time.perf_counter()
        token_ids = self.tokenize(inp)
        self._check_limits(len(token_ids), inp.sampling.max_tokens)
        plan = self.plan(token_ids, inp.cache_salt)
        if not plan.candidates:
            raise Unavailable(self._no_worker_message())
        decision = self.policy.pick(plan.query, plan.candidates)
        self.speculative.record(plan.query.block_hashes, decision.worker_id)
        metrics.DECISIONS.labels(self.policy.name, decision.reason).inc()
        metrics.DECISION_LATENCY.observe(time.perf_counter() - t0)
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
    def generate(self, inp: GenerateInput, scope: CancelScope | None = None) -> Iterator[GenerateOutput]:
        """Routes the request and streams the worker's tokens back.

        Before the first token a worker that is down, busy or too slow is replaced by the next pick
        (up to ``max_attempts``); after it, a worker failure ends the stream with Unavailable.

        Raises:
            InvalidArgument: the request is bad (here or at the worker).
            Unavailable: no worker could take it, or the worker failed mid-stream.
            ResourceExhausted: every worker tried was at capacity.
        """
        scope = scope or CancelScope()
        plan, decision = self.decide(inp)
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
                if not remaining or scope.cancelled:
                    break
                decision = self.policy.pick(plan.query, remaining)
                self.speculative.record(plan.query.block_hashes, decision.worker_id)
                metrics.DECISIONS.labels(self.policy.name, decision.reason).inc()
            remaining = [c for c in remaining if c.worker_id != decision.worker_id]
            endpoint = plan.endpoints[decision.worker_id]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                yield from self._stream(endpoint, plan, request, left, scope)
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
                metrics.RETRIES.labels(exc.failure.value).inc()
                log.info("request %s: worker %s %s before the first token (%s); trying another",
                         request.request_id, endpoint.worker_id, exc.failure.value, exc)
        if scope.cancelled:
            return
        detail = "; ".join(f"{w}: {e.failure.value} ({e})" for w, e in failures) or "deadline passed"
        if failures and all(e.failure is Failure.BUSY for _, e in failures):
            raise ResourceExhausted(f"every worker tried is at capacity, retry later: {detail}")
        raise Unavailable(f"no worker could take the request after {len(failures)} attempt(s): {detail}")

    def _stream(self, endpoint: WorkerEndpoint, plan: RoutePlan, request: WorkerRequest, timeout_s: float,
                scope: CancelScope) -> Iterator[GenerateOutput]:
        """One attempt. Raises WorkerError only before the first chunk has been yielded."""
        cand = next(c for c in plan.candidates if c.worker_id == endpoint.worker_id)
        ticket = self.inflight.start(endpoint.worker_id, uncached_tokens(cand, plan.query))
        detok = IncrementalDetokenizer(self._decode) if self.tokenizer is not None else None
        started = False
        call = None
        timer: threading.Timer | None = None
        timed_out = threading.Event()
        try:
            call = self.pool.generate(endpoint, request, timeout_s)
            scope.attach(call.cancel)
            first_token_s = self.config.first_token_timeout_s
            if 0 < first_token_s < timeout_s:
                # NOTE: a worker that sits on a request is given up on while there is still time
                # to retry elsewhere; the call's own deadline is the whole request budget.
                timer = threading.Timer(first_token_s, lambda: (timed_out.set(), call.cancel()))
                timer.daemon = True
                timer.start()
            for chunk in call:
                if not started:
                    started = True
                    if timer is not None:
                        timer.cancel()
                    self.inflight.prefilled(ticket)
                text = detok.push(chunk.token_ids) if detok is not None else ""
                if chunk.finish_reason is not None:
                    if detok is not None:
                        text += detok.flush()
                    yield GenerateOutput(chunk.token_ids, text, chunk.finish_reason, chunk.usage,
                                         chunk.worker_id or endpoint.worker_id)
                    return
                yield GenerateOutput(chunk.token_ids, text)
            raise WorkerError(Failure.OTHER, f"worker {endpoint.worker_id} ended the stream without a finish reason")
        except WorkerError as exc:
            if timed_out.is_set() and not started and not scope.cancelled:
                raise WorkerError(Failure.TIMEOUT, f"no first token within {self.config.first_token_timeout_s:g}s "
                                                   "(--first-token-timeout)") from None
            if not started or exc.failure is Failure.CANCELLED:
                raise
            raise Unavailable(f"worker {endpoint.worker_id} failed mid-stream: {exc.failure.value} ({exc})") from None
        finally:
            if timer is not None:
                timer.cancel()
            scope.attach(None)
            self.inflight.finish(ticket)
            if call is not None and scope.cancelled:
                call.cancel()

    def _decode(self, ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
