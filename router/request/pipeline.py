"""The request path of one model, read top to bottom::

    admit -> tokenize -> decide -> [prefill leg ->] forward (relay per attempt) -> settle

Each stage is a small type in this folder; a :class:`RequestContext` made at the front door carries the
request through them. What differs between fleets is chosen here, when the pipeline is built: a model
whose workers may have roles gets the prefill-leg operator around the forward stage; tracing, when on,
wraps the index client, the worker pool, the decide sequence and the stages (traced.py). Nothing inside a
stage asks which fleet or whether tracing is on.

Everything runs on the router's event loop; only I/O is awaited (the Lookup and Reserve, the worker's
stream, tokenizing a long text on the tokenizer pool). A client that goes away cancels the request's task;
the cancellation reaches the open worker call at its await, and the ``finally`` blocks free its in-flight
share. Public messages name no worker and no address: the details go to this router's log, under the
request's id.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.contract.errors import KVMeshError
from kvmesh.router.core.decide import Decided
from kvmesh.router.core.upstream import WorkerRequest
from kvmesh.router.generate_types import GenerateInput, GenerateOutput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.request.context import RequestContext
from kvmesh.router.request.decide import Decide
from kvmesh.router.request.forward import Forward
from kvmesh.router.request.prefill_leg import PrefillLeg
from kvmesh.router.request.settle import Settle
from kvmesh.router.request.traced import traced
from kvmesh.transport import tracing

log = logging.getLogger("kvmesh.router")

Stage = Callable[..., Awaitable[None]]


@dataclass(slots=True)
class Stages:
    """The stages before forwarding, in order (each ``await stage(ctx)``; decide also takes ``only``)."""

    admit: Stage
    tokenize: Stage
    decide: Stage


class Pipeline:
    """Args:
    stages: admit, tokenize, decide.
    forward: the forward stage, or the prefill-leg operator around it.
    settle: the finished request's log line (the audit runs where the usage arrives, relay.py).
    metrics: the decision's latency.
    request_timeout_s: ``--request-timeout``: a request's whole budget, the client's deadline if shorter.
    """

    def __init__(self, stages: Stages, forward: Forward | PrefillLeg, settle: Settle, metrics: RouterMetrics,
                 request_timeout_s: float) -> None:
        self.stages = stages
        self.forward = forward
        self.settle = settle
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s

    @classmethod
    def build(cls, *, admit: Stage, tokenize: Stage, decide: Decide, forward: Forward, prefill_leg: PrefillLeg | None,
              settle: Settle, metrics: RouterMetrics, request_timeout_s: float) -> Pipeline:
        """The pipeline for a fleet: with the prefill-leg operator when one is given (workers may have roles),
        each stage in its span while tracing is on."""
        stages = Stages(admit, tokenize, decide)
        if tracing.ON:
            stages = Stages(admit, traced(tokenize, "router.tokenize"), decide)
        return cls(stages, prefill_leg if prefill_leg is not None else forward, settle, metrics, request_timeout_s)

    async def decide(self, ctx: RequestContext, only: Callable[[str, str], bool] | None = None) -> Decided:
        """Admit, tokenize, decide: all the router does before forwarding (benchmarks/router_overhead.py times
        exactly this); ``only(worker id, address)``: the workers the pick may choose (a gateway's subset)."""
        t0 = time.perf_counter()
        s = self.stages
        await s.admit(ctx)
        await s.tokenize(ctx)
        await s.decide(ctx, only)
        self.metrics.decision_latency_s.observe(time.perf_counter() - t0)
        assert ctx.decided is not None
        return ctx.decided

    async def generate(self, inp: GenerateInput, request_id: str, span: Any = None) -> AsyncIterator[GenerateOutput]:
        """Routes the request and streams the worker's tokens back (ModelRouter.generate's contract). ``span``:
        the request's span, opened by the front that checked the request (it ends it, with its status);
        None: one is opened here (while tracing is on), under ``inp.trace``, and ended with its status."""
        ctx = RequestContext(inp, request_id)
        # NOTE: the request's span is current only around awaits that do not yield (the decision): an async
        # generator's context may be closed from another task.
        own = span is None
        ctx.span = tracing.start("router.request", inp.trace, kind="server") if own else span
        if ctx.span is not None:
            ctx.span.set_attribute("kvmesh.request_id", request_id)
        try:
            with tracing.current(ctx.span):
                await self.decide(ctx)
            budget = self.request_timeout_s if inp.timeout_s is None else min(inp.timeout_s, self.request_timeout_s)
            ctx.deadline = time.monotonic() + budget
            request = WorkerRequest(request_id, ctx.token_ids, inp.sampling, inp.cache_salt,
                                    trace=tracing.carrier_of(ctx.span), adapter=inp.adapter)
            async for out in self.forward.stream(ctx, request):
                if out.finish_reason is not None:
                    self.settle.log(ctx, out.finish_reason, out.served_by, out.usage)
                yield out
        except KVMeshError as exc:
            log.info("request %s: %s: %s", request_id, type(exc).__name__, exc)
            if own:
                tracing.set_error(ctx.span, exc)
            raise
        except asyncio.CancelledError:
            log.info("request %s: cancelled (the client went away or its deadline passed)", request_id)
            raise
        except Exception as exc:
            if own:
                tracing.set_error(ctx.span, exc)
            raise
        else:
            if own:
                tracing.set_ok(ctx.span)
        finally:
            if own and ctx.span is not None:
                ctx.span.end()
