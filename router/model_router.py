"""The request path: validate, tokenize, hash, look up, pick, forward, stream back.

The gRPC adapter (router/api/grpc_api.py) and the OpenAI HTTP adapter (router/api/openai_api.py) turn a
request into a :class:`GenerateInput`, iterate :meth:`ModelRouter.generate` (through router/api/frontend.py,
which picks the model's ModelRouter) and turn each :class:`GenerateOutput` into their messages (the
types: router/generate_types.py). Workers and
the index are reached through router/core/upstream.py's protocols, so this module imports neither
grpc nor redis; errors are kvmesh.contract.errors, mapped to status codes by kvmesh/transport/.

Everything here runs on the router's event loop. The decisions (chain, candidates, pick, in-flight
accounting) are router/core/routing.py's synchronous code; only I/O is awaited: the Lookup, the worker's
stream, and tokenizing a long text (router/text/prompt.py: on a thread of the tokenizer pool, within
the prompt bounds). A client that goes away cancels the request's task; the cancellation reaches
the open worker call at its await, and the ``finally`` blocks free its in-flight share.

Every request is validated here (router/text/prompt.py), whichever front end built it, before any work
is spent on it. Public messages name no worker and no address (a client has no use for the mesh's
topology): the details go to this router's log, under the request's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from tokenizers import Tokenizer

from kvmesh.contract.errors import (
    InvalidArgument,
    KVMeshError,
    RequestTooLarge,
    Unavailable,
)
from kvmesh.contract.index_protocol import IndexUnavailable, WorkerMatch
from kvmesh.contract.kv_transfer import KVSource
from kvmesh.contract.types import DEFAULT_MAX_TOKENS, SamplingParams, Usage
from kvmesh.router.config import RouterConfig
from kvmesh.router.core.attempts import Attempts
from kvmesh.router.core.audit import MissAudit, predicted_blocks
from kvmesh.router.core.inflight import InFlight
from kvmesh.router.core.pd import PDDecider, PDDecision, disaggregated_fleet, split_roles
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import Decision, RouterPolicy
from kvmesh.router.core.reservation_loop import ReservationLoop
from kvmesh.router.core.routing import RoutePlan, RoutingCore
from kvmesh.router.core.speculative import SpeculativeIndex
from kvmesh.router.core.upstream import (
    AsyncPrefixIndex,
    Failure,
    WorkerChunk,
    WorkerEndpoint,
    WorkerError,
    WorkerPool,
    WorkerRequest,
)
from kvmesh.router.generate_types import ChatInput, GenerateInput, GenerateOutput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.text.chat_template import ChatTemplate
from kvmesh.router.text.detokenize import IncrementalDetokenizer
from kvmesh.router.text.prompt import (
    RENDER_ON_LOOP_MESSAGES,
    TOKENIZE_ON_LOOP_CHARS,
    PromptLimits,
    PromptTokenizer,
    check_input,
    check_message_count,
    check_prompt_ids,
)
from kvmesh.router.text.stop_strings import StopStrings, check_stop_strings
from kvmesh.transport import tracing

log = logging.getLogger("kvmesh.router")

ABORT_DRAIN_S = 2.0
"""After a stop string, how long the worker's final message (with the request's usage) is awaited."""


class ModelRouter:
    """The request path of one model, on the server's event loop.

    One ModelRouter serves one model (router/models.py keeps one per model): its own pool, tokenizer,
    chat template, speculative map and in-flight view, so models never share routing state.

    Args:
        config: the router's flags.
        pool: the workers of the model (router/workers/discovery.py).
        index: the kv_service Lookup, or None to route without an index.
        tokenizer: the model's tokenizer, or None (clients must then send token ids).
        metrics: where to count (the server's, served on /metrics); default: a private registry.
        chat_template: the model's chat template, or None (chat requests are refused).
        context_len: the model's context length (from its config.json), the default prompt bound.
        vocab_size: token ids at or past it are refused before routing (None: the workers judge).
    """

    def __init__(self, config: RouterConfig, pool: WorkerPool, index: AsyncPrefixIndex | None,
                 tokenizer: Tokenizer | None = None, policy: RouterPolicy | None = None,
                 speculative: SpeculativeIndex | None = None, metrics: RouterMetrics | None = None,
                 chat_template: ChatTemplate | None = None, context_len: int | None = None,
                 vocab_size: int | None = None) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.metrics = metrics or RouterMetrics()
        self.prompts = (PromptTokenizer(tokenizer, self.metrics.tokenized_chars.inc, self.metrics.tokenizing.inc)
                        if tokenizer is not None else None)
        routing = config.routing
        policy = policy or make_policy(routing.policy, routing.policy_config)
        self.core = RoutingCore(policy, speculative_ttl_s=routing.speculative_ttl_s,
                                index_retry_s=routing.index_retry_s, observer=self.metrics,
                                shared_view=routing.shared_view and index is not None,
                                router_id=f"router-{uuid.uuid4().hex[:12]}", reservation_attempts=routing.reservation_attempts,
                                fold_reserve=routing.fold_reserve)
        if speculative is not None:
            self.core.speculative = speculative
        self.audit = MissAudit(config.audit_window, config.audit_miss_rate)
        # NOTE: one step-cost fit for the pick and the P/D decision when the policy learns one (kv-aware).
        self._tasks: set[asyncio.Task] = set()
        self.pd = PDDecider(routing.pd, cost=getattr(policy, "cost", None),
                            default_step_tokens=routing.policy_config.default_step_tokens)
        self._pd_decisions = 0

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
    async def tokenize(self, inp: GenerateInput, limits: PromptLimits | None = None) -> Sequence[int]:
        """The prompt's token ids within the prompt bounds; raises InvalidArgument on an empty or
        missing prompt, InvalidArgument / ResourceExhausted past a bound (router/text/prompt.py)."""
        limits = limits or self.limits()
        if inp.token_ids is not None:
            if not inp.token_ids:
                raise InvalidArgument("token_ids is empty: send at least one prompt token", param="token_ids")
            try:
                limits.check_tokens(len(inp.token_ids))
            except KVMeshError:
                self._refused("tokens")
                raise
            check_prompt_ids(inp.token_ids, "token_ids", self.vocab_size or 0,
                            self.pool.model_spec().model_id if self.vocab_size else "")
            # NOTE: as it came (a protobuf repeated field, a JSON list): the chain hashes it through
            # numpy and the worker request copies it in C; a list() of 4,096 ids cost ~0.25 ms.
            return inp.token_ids
        if inp.chat is not None:
            with tracing.span("router.render"):
                text = await self._render(inp.chat)
            return await self._encode(text, limits, add_special_tokens=False)
        if inp.text is None:
            raise InvalidArgument("the request sets no input: set text, token_ids or chat")
        if not inp.text:
            raise InvalidArgument("text is empty: send a non-empty prompt", param="prompt")
        # NOTE: add_special_tokens=True, as the worker's offline path encodes, so both hash the same ids.
        return await self._encode(inp.text, limits, add_special_tokens=True)

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

    async def _render(self, chat: ChatInput) -> str:
        """:meth:`render_chat`, on the tokenizer pool for a long conversation (router/text/prompt.py)."""
        small = len(chat.messages) <= RENDER_ON_LOOP_MESSAGES and sum(
            len(m.get("content") or "") for m in chat.messages) <= TOKENIZE_ON_LOOP_CHARS
        if small or self.prompts is None:
            return self.render_chat(chat)
        return await self.prompts.run(self.render_chat, chat)

    async def _encode(self, text: str, limits: PromptLimits, add_special_tokens: bool) -> list[int]:
        """``text`` tokenized within ``limits`` (bytes first, then tokens), refusals counted."""
        if self.prompts is None:
            raise InvalidArgument("this router has no tokenizer (start it with --model DIR): send token_ids")
        try:
            limits.check_bytes(text)
        except KVMeshError:
            self._refused("bytes")
            raise
        try:
            return await self.prompts.encode(text, limits, add_special_tokens=add_special_tokens)
        except KVMeshError:
            self._refused("tokens")
            raise

    async def plan(self, token_ids: Sequence[int], cache_salt: str = "", max_tokens: int = 0,
                   request_id: str = "") -> RoutePlan:
        """Hashes the prompt, asks the index at most once and builds the candidates: router/core/routing.py's
        ``prepare`` / ``complete`` around the awaited Lookup. With ``request_id`` (and the shared view) the
        Lookup carries the pick this router would make from its own view, reserved in the same call
        (``RoutingCore.tentative``: the Reserve folded into the Lookup)."""
        core, spec = self.core, self.pool.model_spec()
        with tracing.span("router.hash"):
            pending = core.prepare(spec, token_ids, self.index is not None, cache_salt=cache_salt,
                                   max_tokens=max_tokens)
        outcome: list[WorkerMatch] | IndexUnavailable | None = None
        folded = core.tentative(pending, self.pool.endpoints(), request_id, healthy=self.pool.healthy) \
            if request_id else None
        reserved = False
        t0 = time.perf_counter()
        if pending.lookup is not None:
            assert self.index is not None
            try:
                with tracing.span("router.lookup", kind="client"):
                    if folded is not None:
                        outcome, reserved = await self.index.lookup_reserve(spec.model_id, pending.lookup, folded)
                    else:
                        outcome = await self.index.lookup(spec.model_id, pending.lookup)
            except IndexUnavailable as exc:
                outcome = exc
        return core.complete(pending, self.pool.endpoints(), outcome, time.perf_counter() - t0,
                             adopt=self.pool.discovers_from_index, healthy=self.pool.healthy, folded=folded,
                             folded_reserved=reserved)

    async def reserve(self, plan: RoutePlan, decision: Decision, request_id: str) -> Decision:
        """Reserves the pick in the kv_service (the shared router view), picking again while another
        router got there first; the pick to forward. A kv_service that does not answer leaves the
        pick as it is (the request is not held up for the view). router/core/reservation_loop.py's
        ``ReservationLoop`` is the loop; this awaits its reservations."""
        loop = ReservationLoop(self.core, plan, decision, request_id)
        if loop.folded:
            self.metrics.reservations.labels("folded").inc()
        while (reservation := loop.next()) is not None:
            assert self.index is not None
            try:
                answer = await self.index.reserve(reservation)
            except IndexUnavailable as exc:
                self.metrics.reservations.labels("failed").inc()
                log.debug("reserve failed, forwarding unreserved: %s", exc)
                loop.unanswered()
                break
            self.metrics.reservations.labels("reserved" if loop.answered(answer) else "conflict").inc()
        return loop.decision

    async def decide(self, inp: GenerateInput, request_id: str = "",
                     only: Callable[[str, str], bool] | None = None) -> tuple[RoutePlan, Decision]:
        """Tokenize + hash + lookup + pick (+ its reservation in the shared view), and the speculative
        record: all the server does before forwarding (benchmarks/router_overhead.py times exactly
        this). ``request_id``: the id the worker will see (the reservation names it); ``only(worker id,
        address)``: the workers the pick may choose (a gateway's subset hint; Unavailable when none is
        left). Each stage is a span of the request's trace while tracing is on (docs/tracing.md)."""
        t0 = time.perf_counter()
        if inp.stop:
            try:
                check_stop_strings(inp.stop)
            except ValueError as exc:
                raise InvalidArgument(str(exc), param="stop") from None
            if self.tokenizer is None:
                raise InvalidArgument("stop strings need the model's tokenizer at the router (--model DIR); "
                                      "use stop_token_ids", param="stop")
        if inp.chat is not None:
            check_message_count(len(inp.chat.messages), self.config.max_messages)
        check_input(inp.request_id, inp.cache_salt)
        with tracing.span("router.tokenize"):
            token_ids = await self.tokenize(inp)
        self._check_limits(inp.sampling.max_tokens)
        request_id = request_id or self.request_id_for(inp)
        plan = await self.plan(token_ids, inp.cache_salt, inp.sampling.max_tokens or DEFAULT_MAX_TOKENS, request_id)
        if only is not None and plan.candidates:
            plan.candidates = [c for c in plan.candidates if only(c.worker_id, c.address)]
            if not plan.candidates:
                raise Unavailable("no ready worker is in the gateway's subset of endpoints")
        if not plan.candidates:
            raise Unavailable(self._no_worker_message())
        roles = {w: e.role for w, e in plan.endpoints.items()}
        mode = self.config.routing.pd.pd_mode
        pd_fleet = disaggregated_fleet(list(roles.values()), mode)
        if pd_fleet:
            # NOTE: decode first: the pick, its reservation and any retry are among the workers that decode.
            plan.candidates, plan.prefill_candidates = split_roles(plan.candidates, roles, mode == "dynamic")
            if not plan.candidates:
                raise Unavailable(f"no decode worker is available for model {self.pool.model_spec().model_id!r} "
                                  "(only prefill workers are live)")
        with tracing.span("router.pick"):
            decision = self.core.pick(plan, count=False)
        if plan.versions is not None:
            with tracing.span("router.reserve"):
                decision = await self.reserve(plan, decision, request_id)
        self.core.commit(plan, decision)
        if pd_fleet:
            plan.pd = self._decide_pd(plan, decision)
            context = self.context_len or getattr(self.pool, "max_model_len", 0)
            want = inp.sampling.max_tokens or 0
            if plan.pd.prefill_worker is not None and context and len(token_ids) + want > context:
                # NOTE: the decode worker would refuse it: refused here, before a prefill leg and any KV moves
                raise InvalidArgument(f"max_tokens is {want}, but the prompt's {len(token_ids)} tokens leave room "
                                      f"for {context - len(token_ids)} of the model's context ({context}); ask for at "
                                      f"most {context - len(token_ids)}", param="max_tokens")
        self.metrics.decision_latency_s.observe(time.perf_counter() - t0)
        return plan, decision

    def _decide_pd(self, plan: RoutePlan, decision: Decision) -> PDDecision:
        """Whether a prefill worker takes the prompt (router/core/pd.py), counted with its inputs."""
        pd = self.pd.decide(plan.query, plan.candidate(decision.worker_id), plan.prefill_candidates, plan.candidates)
        m = self.metrics
        m.pd_decisions.labels(pd.reason).inc()
        m.pd_uncached_tokens.labels("yes" if pd.prefill_worker else "no").observe(pd.uncached_tokens)
        if pd.local_s or pd.remote_s:
            m.pd_predicted_s.labels("local").observe(pd.local_s)
            m.pd_predicted_s.labels("remote").observe(pd.remote_s)
        self._pd_decisions += 1
        if plan.prefill_candidates and self.pd.cost.learned and self._pd_decisions % 16 == 1:
            # NOTE: a bisection of ~20 predictions: every 16th decision keeps the gauge fresh enough
            m.pd_threshold_tokens.set(self.pd.threshold(plan.query, plan.candidate(decision.worker_id),
                                                        plan.prefill_candidates[0]))
        return pd

    async def _prefill_leg(self, plan: RoutePlan, pd: PDDecision, request: WorkerRequest,
                           deadline: float, route: dict[str, object]) -> KVSource | None:
        """The prefill leg on ``pd.prefill_worker`` (one token, its KV held for the decode worker); the
        KV source, or None when it failed (the decode worker then prefills the prompt itself)."""
        assert pd.prefill_worker is not None
        endpoint = plan.endpoints[pd.prefill_worker]
        c = next(c for c in plan.prefill_candidates if c.worker_id == pd.prefill_worker)
        q = plan.query
        ticket = self.core.inflight.start(endpoint.worker_id, max(0, q.prompt_len - c.matched_blocks * q.block_size),
                                          -(-q.prompt_len // q.block_size) if q.block_size else 0)
        leg = replace(request, sampling=SamplingParams(max_tokens=1, ignore_eos=True), prefill_leg=True)
        call = None
        try:
            timeout = deadline - time.monotonic()
            first_token_s = self.config.routing.first_token_timeout_s
            call = self.pool.generate(endpoint, leg, min(timeout, first_token_s) if first_token_s > 0 else timeout)
            async for chunk in call:
                if chunk.finish_reason is not None:
                    route["prefill_cached"] = chunk.usage.cached_tokens if chunk.usage is not None else 0
                    route["prefill"] = endpoint.worker_id
                    if chunk.kv_source is None:
                        raise WorkerError(Failure.OTHER, "the prefill leg ended without a KV source")
                    return chunk.kv_source
            raise WorkerError(Failure.OTHER, "the prefill leg's stream ended without a finish reason")
        except WorkerError as exc:
            if exc.failure is Failure.CANCELLED:
                raise asyncio.CancelledError() from None
            if exc.failure in (Failure.UNAVAILABLE, Failure.TIMEOUT):
                self.pool.mark_unhealthy(endpoint.worker_id)
            self.metrics.pd_prefill_failures.labels(exc.failure.value).inc()
            log.warning("request %s: prefill leg on %s at %s failed (%s: %s); the decode worker prefills it",
                        request.request_id, endpoint.worker_id, endpoint.address, exc.failure.value, exc)
            return None
        finally:
            self.core.inflight.finish(ticket)
            if call is not None:
                call.cancel()

    def _release_kv(self, plan: RoutePlan, source: KVSource) -> None:
        """The decode leg never took the prefill leg's KV (it failed, or the client left): the prefill
        worker frees its hold now rather than at its ttl."""
        endpoint = plan.endpoints.get(source.worker_id)
        release = getattr(self.pool, "release_kv", None)
        if endpoint is not None and release is not None:
            task = asyncio.get_running_loop().create_task(release(endpoint, source.request_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _check_limits(self, max_tokens: int | None) -> None:
        cfg = self.config
        if cfg.max_tokens_limit and (max_tokens or DEFAULT_MAX_TOKENS) > cfg.max_tokens_limit:
            raise RequestTooLarge(f"max_tokens {max_tokens or DEFAULT_MAX_TOKENS} is over this router's limit of "
                                  f"{cfg.max_tokens_limit} (--max-tokens-limit)", param="max_tokens")

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
        # NOTE: the request's span is current only around awaits that do not yield (the decision in
        # _generate): an async generator's context may be closed from another task.
        route["span"] = tracing.start("router.request", inp.trace_parent, {"kvmesh.request_id": rid}, kind="server")
        try:
            async for out in self._generate(inp, rid, route):
                if out.finish_reason is not None:
                    u = out.usage or Usage()
                    pd = (f", P/D {route['pd']}" + (f" via {route['prefill']}, KV {route.get('kv', 'not taken')}"
                                                    if "prefill" in route else "")) if "pd" in route else ""
                    log.info("request %s: %s on %s (%s, %s of %s blocks matched%s): prompt %d cached %d completion %d "
                             "tokens", rid, out.finish_reason, out.served_by, route.get("reason"),
                             route.get("matched"), route.get("blocks"), pd, u.prompt_tokens, u.cached_tokens,
                             u.completion_tokens)
                yield out
        except KVMeshError as exc:
            log.info("request %s: %s: %s", rid, type(exc).__name__, exc)
            raise
        except asyncio.CancelledError:
            log.info("request %s: cancelled (the client went away or its deadline passed)", rid)
            raise
        finally:
            if route["span"] is not None:
                route["span"].end()

    async def _generate(self, inp: GenerateInput, rid: str, route: dict[str, object]) -> AsyncIterator[GenerateOutput]:
        with tracing.current(route["span"]):
            plan, decision = await self.decide(inp, rid)
        budget = self.config.routing.request_timeout_s if inp.timeout_s is None else min(inp.timeout_s,
                                                                                 self.config.routing.request_timeout_s)
        deadline = time.monotonic() + budget
        request = WorkerRequest(rid, plan.token_ids, inp.sampling, inp.cache_salt)
        pd = plan.pd if isinstance(plan.pd, PDDecision) else None
        source: KVSource | None = None
        if pd is not None:
            route["pd"] = pd.reason
            if pd.prefill_worker is not None:
                source = await self._prefill_leg(plan, pd, request, deadline, route)
                if source is not None:
                    request = replace(request, kv_source=source)
        try:
            async for out in self._attempts(plan, decision, request, deadline, inp, rid, route):
                yield out
        finally:
            if source is not None and not route.get("kv_taken"):
                self._release_kv(plan, source)

    async def _attempts(self, plan: RoutePlan, decision: Decision, request: WorkerRequest, deadline: float,
                        inp: GenerateInput, rid: str, route: dict[str, object]) -> AsyncIterator[GenerateOutput]:
        attempts = Attempts(self.core, plan, decision, self.config.routing.max_attempts, deadline, self.pool.mark_unhealthy)
        first = True
        while (decision := attempts.next(time.monotonic())) is not None:
            endpoint = plan.endpoints[decision.worker_id]
            route.update(reason=decision.reason, matched=plan.candidate(decision.worker_id).matched_blocks,
                         blocks=len(plan.query.block_hashes))
            try:
                async for out in self._stream(endpoint, plan, request, deadline - time.monotonic(), inp, route):
                    if first:
                        out, first = replace(out, request_id=rid), False
                    yield out
                return
            except WorkerError as exc:  # only ever raised before the first token
                if exc.failure is Failure.CANCELLED:
                    return
                # NOTE: an INVALID failure raises with the worker's own words, without who said it.
                if not attempts.failed(endpoint.worker_id, exc.failure, f"{endpoint.address}: {exc}", exc.details):
                    break
                self.metrics.retries.labels(exc.failure.value).inc()
                log.info("request %s: worker %s at %s %s before the first token (%s); trying another",
                         rid, endpoint.worker_id, endpoint.address, exc.failure.value, exc)
        if attempts.failures:
            log.warning("request %s: no worker took it: %s", rid,
                        "; ".join(f"{w}: {f.value} ({m})" for w, f, m in attempts.failures))
        raise attempts.error()

    async def _stream(self, endpoint: WorkerEndpoint, plan: RoutePlan, request: WorkerRequest,
                      timeout_s: float, inp: GenerateInput,
                      route: dict[str, object] | None = None) -> AsyncIterator[GenerateOutput]:
        """One attempt. Raises WorkerError only before the first chunk has been yielded."""
        ticket = self.core.start(plan, endpoint.worker_id)
        forward = None
        if tracing.ON:
            forward = tracing.start("router.forward", tracing.context_of((route or {}).get("span")),
                                    {"kvmesh.worker_id": endpoint.worker_id}, kind="client")
            with tracing.current(forward):
                request = replace(request, traceparent=tracing.current_traceparent() or "")
        detok = IncrementalDetokenizer(self._decode) if self.tokenizer is not None else None
        stops = StopStrings(inp.stop, inp.include_stop_str_in_output) if inp.stop and detok is not None else None
        completion = 0
        started = False
        call = None
        try:
            call = self.pool.generate(endpoint, request, timeout_s)
            chunks = call.__aiter__()
            first_token_s = self.config.routing.first_token_timeout_s
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
            if forward is not None:
                forward.add_event("first_token")
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
                    self._audit(plan, endpoint.worker_id, usage)
                    yield GenerateOutput(ids, text, "stop", usage, endpoint.worker_id)
                    return
                if chunk.finish_reason is not None:
                    if request.kv_source is not None:
                        chunk = self._decode_leg_done(endpoint, request, chunk, route if route is not None else {})
                    finish = chunk.finish_reason
                    if detok is not None:
                        tail = detok.flush()
                        if stops is not None:
                            tail = stops.push(tail)
                            finish = "stop" if stops.matched is not None else finish
                            tail += stops.flush()
                        text += tail
                    self._audit(plan, endpoint.worker_id, chunk.usage, chunk.kv_blocks_pulled)
                    usage = chunk.usage
                    if usage is not None and chunk.kv_blocks_pulled and route is not None and "prefill_cached" in route:
                        # NOTE: the pulled blocks were computed for this request (on the prefill worker): what
                        # the mesh served from a cache is what the prefill worker's cache served.
                        usage = replace(usage, cached_tokens=int(route["prefill_cached"]))  # type: ignore[call-overload]
                    yield GenerateOutput(ids, text, finish, usage, chunk.worker_id or endpoint.worker_id)
                    return
                yield GenerateOutput(ids, text)
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
            self.core.finish(ticket, completion)
            if call is not None:
                call.cancel()  # a no-op once the call has ended; frees it when the client left
            if forward is not None:
                forward.set_attribute("kvmesh.completion_tokens", completion)
                forward.end()

    # -- a request another front forwards (kvmesh epp) ----------------------------------------
    def fallbacks(self, plan: RoutePlan, decision: Decision, n: int) -> list[str]:
        """The workers a retry would try after ``decision``, in order, at most ``n``: the policy's next
        picks among the candidates left, leaving the policy's state as it was (RouterPolicy.fallbacks)."""
        left = [c for c in plan.candidates if c.worker_id != decision.worker_id]
        return self.core.policy.fallbacks(plan.query, left, n) if left and n else []

    def hand_off(self, plan: RoutePlan, decision: Decision, request_id: str) -> Handoff:
        """The pick goes to a front that forwards it itself (the gateway behind ``kvmesh epp``): its
        in-flight share is held until :class:`Handoff` hears how it ended, as ``_stream`` holds it."""
        return Handoff(self, plan, decision, request_id)

    def _decode_leg_done(self, endpoint: WorkerEndpoint, request: WorkerRequest, chunk: WorkerChunk,
                         route: dict[str, object]) -> WorkerChunk:
        """A decode leg's last chunk: how its KV came, learned (the link) and counted."""
        route["kv_taken"] = True
        route["kv"] = f"{chunk.kv_transport or 'local'} {chunk.kv_blocks_pulled} blocks"
        self.metrics.pd_transfers.labels(chunk.kv_transport or "local").inc()
        if chunk.kv_blocks_pulled:
            self.pd.link.observe(endpoint.worker_id, chunk.kv_blocks_pulled, chunk.kv_pull_s)
        return chunk

    def _audit(self, plan: RoutePlan, worker_id: str, usage: Usage | None, pulled_blocks: int = 0) -> None:
        """The miss audit of a finished request (router/core/audit.py): the index's prediction for the
        worker that served it against the engine's cached tokens (less the blocks a decode leg pulled from
        a prefill worker: those the index could not predict, and they are no miss)."""
        if not plan.answered or usage is None or not usage.prompt_tokens:
            return
        bs = plan.query.block_size
        c = plan.candidate(worker_id)
        predicted = predicted_blocks(c.indexed_blocks, len(plan.token_ids), bs, c.load.cache_block_tokens)
        cached = usage.cached_tokens // bs - pulled_blocks
        self.metrics.audited(worker_id, predicted, cached)
        alarm = self.audit.observe(worker_id, predicted, cached)
        if alarm is not None:
            log.warning("miss audit: %s", alarm.message())

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


class Handoff:
    """A request this router picked a worker for and another front forwards (docs/epp.md): the same
    in-flight accounting, policy hooks and miss audit as a request the router forwards itself, fed by
    what that front learns from the response path. Every method is idempotent past the end."""

    __slots__ = ("router", "plan", "worker_id", "request_id", "ticket", "_ended")

    def __init__(self, router: ModelRouter, plan: RoutePlan, decision: Decision, request_id: str) -> None:
        self.router = router
        self.plan = plan
        self.worker_id = decision.worker_id
        self.request_id = request_id
        self.ticket = router.core.start(plan, decision.worker_id)
        self._ended = False

    def served_by(self, worker_id: str) -> None:
        """The worker that served was another than the pick (the gateway went down the fallbacks)."""
        if not self._ended and worker_id != self.worker_id and worker_id in self.plan.endpoints:
            self.worker_id = worker_id
            self.ticket = self.router.core.start(self.plan, worker_id)

    def first_token(self) -> None:
        if not self._ended:
            self.router.core.prefilled(self.ticket)

    def finished(self, usage: Usage | None = None, outcome: str = "ok") -> None:
        """It ended: ``usage`` from the response (None: not seen, not audited), ``outcome`` for the log."""
        if self._ended:
            return
        self._ended = True
        completion = usage.completion_tokens if usage is not None else 0
        self.router.core.finish(self.ticket, completion)
        if usage is not None:
            self.router._audit(self.plan, self.worker_id, usage)
        u = usage or Usage()
        log.info("request %s: %s on %s (handed off): prompt %d cached %d completion %d tokens", self.request_id,
                 outcome, self.worker_id, u.prompt_tokens, u.cached_tokens, u.completion_tokens)
