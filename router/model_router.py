"""One model's request path, assembled: :class:`ModelRouter` owns the model's routing state (policy,
speculative map, in-flight view, miss audit, tokenizer pool) and builds the pipeline the request runs
through (router/request/pipeline.py: admit -> tokenize -> decide -> [prefill leg ->] forward -> settle).

The gRPC adapter (router/api/grpc_api.py) and the OpenAI HTTP adapter (router/api/openai_api.py) turn a
request into a :class:`GenerateInput` and iterate :meth:`ModelRouter.generate` (through router/api/frontend.py);
the endpoint picker (router/api/gateway.py) runs the same stages up to the decision (:meth:`ModelRouter.decide`)
and hands the pick to the gateway (:meth:`ModelRouter.hand_off`). Workers and the index are reached through
router/core/upstream.py's protocols, so this module imports neither grpc nor redis.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tokenizers import Tokenizer

from kvmesh.contract.errors import Unavailable
from kvmesh.router.config import RouterConfig
from kvmesh.router.core.audit import MissAudit
from kvmesh.router.core.decide import DecideSequence
from kvmesh.router.core.inflight import InFlight
from kvmesh.router.core.pd import PDDecider
from kvmesh.router.core.plan import RoutePlan
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import Decision, RouterPolicy
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.speculative import SpeculativeIndex
from kvmesh.router.core.upstream import AsyncPrefixIndex, WorkerPool
from kvmesh.router.generate_types import ChatInput, GenerateInput, GenerateOutput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.request.admit import Admit, request_id_for
from kvmesh.router.request.context import RequestContext
from kvmesh.router.request.decide import Decide
from kvmesh.router.request.forward import Forward
from kvmesh.router.request.handoff import Handoff
from kvmesh.router.request.pd_decision import CountedDecider
from kvmesh.router.request.pipeline import Pipeline
from kvmesh.router.request.prefill_leg import PrefillLeg
from kvmesh.router.request.relay import Relay
from kvmesh.router.request.settle import Settle
from kvmesh.router.request.tokenize import Tokenize
from kvmesh.router.request.traced import TracedIndex, TracedPool, TracedSequence
from kvmesh.router.text.chat_template import ChatTemplate
from kvmesh.router.text.prompt import PromptLimits, PromptTokenizer
from kvmesh.transport import tracing


class ModelRouter:
    """The request path of one model, on the server's event loop.

    One ModelRouter serves one model (router/models.py keeps one per model): its own pool, tokenizer, chat
    template, speculative map and in-flight view, so models never share routing state.

    Args:
        config: the router's flags.
        pool: the workers of the model (router/workers/discovery.py).
        index: the kv_service Lookup, or None to route without an index.
        tokenizer: the model's tokenizer, or None (clients must then send token ids).
        policy: the routing policy (default: ``config.routing.policy``).
        speculative: a speculative map to share (default: the core's own).
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
        self.metrics = m = metrics or RouterMetrics()
        self.prompts = (PromptTokenizer(tokenizer, m.tokenized_chars.inc, m.tokenizing.inc,
                                        threads=config.tokenizer_threads or None,
                                        cache_bytes=config.prompt_cache_bytes)
                        if tokenizer is not None else None)
        routing = config.routing
        policy = policy or make_policy(routing.policy, routing.policy_config)
        # NOTE: the policy's clock is the core's (the simulator's and the replay tests' virtual one)
        self.core = RoutingCore(policy, speculative_ttl_s=routing.speculative_ttl_s,
                                index_retry_s=routing.index_retry_s, clock=routing.policy_config.clock, observer=m,
                                shared_view=routing.shared_view and index is not None,
                                router_id=f"router-{uuid.uuid4().hex[:12]}",
                                reservation_attempts=routing.reservation_attempts, fold_reserve=routing.fold_reserve)
        if speculative is not None:
            self.core.speculative = speculative
        self.audit = MissAudit(config.audit_window, config.audit_miss_rate)
        # NOTE: one step-cost fit for the pick and the P/D decision when the policy learns one (kv-aware).
        self.pd = PDDecider(routing.pd, cost=getattr(policy, "cost", None),
                            default_step_tokens=routing.policy_config.default_step_tokens)
        self.settle = Settle(self.audit, m, self.pd.link)
        self.tokenize_stage = Tokenize(lambda: self.pool.model_spec().model_id, tokenizer, chat_template,
                                       self.prompts, self.limits, vocab_size or 0,
                                       lambda limit: m.prompts_refused.labels(limit).inc())
        self.pipeline = self._build()

    def _build(self) -> Pipeline:
        """The pipeline: stages over the pool and the index (traced while tracing is on), the prefill-leg
        operator unless ``--pd-mode never`` makes every worker serve whole requests."""
        routing, m = self.config.routing, self.metrics
        on = tracing.ON
        pool = TracedPool(self.pool) if on else self.pool
        index = TracedIndex(self.index) if on and self.index is not None else self.index
        decide = Decide(self.core, pool, index, routing.pd.pd_mode, CountedDecider(self.pd, m),
                        lambda outcome: m.reservations.labels(outcome).inc(),
                        TracedSequence if on else DecideSequence,
                        self.prompts.run if self.prompts is not None else None,
                        (lambda objective: m.slo_refusals.labels(objective).inc()) if self.config.slo_refuse else None)
        relay = Relay(self.core, pool, self.settle, self._decode if self.tokenizer is not None else None,
                      routing.first_token_timeout_s, routing.migration_max_seq_len)
        forward = Forward(self.core, pool, relay, routing.max_attempts, m, routing.migration_limit, decide)
        leg = (PrefillLeg(forward, self.core, pool, self._context, routing.first_token_timeout_s, m)
               if routing.pd.pd_mode != "never" else None)
        return Pipeline.build(admit=Admit(self.config, self.tokenizer is not None), tokenize=self.tokenize_stage,
                              decide=decide, forward=forward, prefill_leg=leg, settle=self.settle, metrics=m,
                              request_timeout_s=routing.request_timeout_s)

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

    def limits(self) -> PromptLimits:
        """The prompt bounds now: the flags over the model's context (its config.json, or the smallest
        max_model_len static workers report)."""
        cfg = self.config
        try:
            block_size = self.pool.model_spec().block_size
        except Unavailable:
            block_size = cfg.block_size
        return PromptLimits.resolve(cfg.max_prompt_tokens, cfg.max_prompt_bytes, self._context() or None, block_size)

    def _context(self) -> int:
        return self.context_len or getattr(self.pool, "max_model_len", 0) or 0

    request_id_for = staticmethod(request_id_for)

    async def tokenize(self, inp: GenerateInput, limits: PromptLimits | None = None) -> Sequence[int]:
        """The prompt's token ids within the prompt bounds (router/request/tokenize.py)."""
        return await self.tokenize_stage.token_ids(inp, limits or self.limits())

    def render_chat(self, chat: ChatInput) -> str:
        return self.tokenize_stage.render(chat)

    async def decide(self, inp: GenerateInput, request_id: str = "",
                     only: Callable[[str, str], bool] | None = None) -> tuple[RoutePlan, Decision]:
        """Admit + tokenize + decide (hash, Lookup, pick, its reservation in the shared view): all the server
        does before forwarding. ``request_id``: the id the worker will see; ``only(worker id, address)``: the
        workers the pick may choose (a gateway's subset; Unavailable when none is left)."""
        ctx = RequestContext(inp, request_id or request_id_for(inp))
        decided = await self.pipeline.decide(ctx, only)
        return decided.plan, decided.decision

    def generate(self, inp: GenerateInput, request_id: str | None = None,
                 span: Any = None) -> AsyncIterator[GenerateOutput]:
        """Routes the request and streams the worker's tokens back.

        Before the first token a worker that is down, busy or too slow is replaced by the next pick (up to
        ``max_attempts``); after it, a worker failure ends the stream with Unavailable. Cancelling the
        consuming task (the client went away) cancels the worker call. The first output carries the
        request's id; one log line at the default level says how it ended.

        Args:
            request_id: the id :meth:`request_id_for` made (a front end that wants it before the first
                output, e.g. for trailers); None = made here.
            span: the request's ``router.request`` span, opened by a front before it checked the request
                (the front ends it); None = opened here while tracing is on.

        Raises:
            InvalidArgument: the request is bad (here or at the worker).
            Unavailable: no worker could take it, or the worker failed mid-stream.
            ResourceExhausted: every worker tried was at capacity, or the prompt is over a limit.
        """
        return self.pipeline.generate(inp, request_id or request_id_for(inp), span)

    def fallbacks(self, plan: RoutePlan, decision: Decision, n: int) -> list[str]:
        """The workers a retry would try after ``decision``, in order, at most ``n``: the policy's next picks
        among the candidates left, leaving the policy's state as it was (RouterPolicy.fallbacks)."""
        left = [c for c in plan.candidates if c.worker_id != decision.worker_id]
        return self.core.policy.fallbacks(plan.query, left, n) if left and n else []

    def hand_off(self, plan: RoutePlan, decision: Decision, request_id: str) -> Handoff:
        """The pick goes to a front that forwards it itself (the gateway behind ``kvmesh epp``): its
        in-flight share is held until :class:`Handoff` hears how it ended."""
        return Handoff(self.core, self.settle, plan, decision, request_id)

    def _decode(self, ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
