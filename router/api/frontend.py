"""What the gRPC adapter (router/api/grpc_api.py) and the OpenAI HTTP adapter (router/api/openai_api.py) both
call: pick the request's model, admit the stream under ``--max-streams``, run that model's request
path and count the outcome. Both protocols thus share one stream limit, one set of metrics and
one validation path; an adapter only converts messages.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from kvmesh.contract.errors import ResourceExhausted
from kvmesh.router.api.body_bounds import BodyBounds
from kvmesh.router.config import RouterConfig
from kvmesh.router.generate_types import GenerateInput, GenerateOutput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.models import ModelSet, ServedModel


class Frontend:
    """Args:
    models: the models served.
    max_streams: streams open at once over both protocols; one more is refused (RESOURCE_EXHAUSTED).
    metrics: the server's metrics.
    """

    def __init__(self, models: ModelSet, max_streams: int, metrics: RouterMetrics) -> None:
        self.models = models
        self.max_streams = max_streams
        self.metrics = metrics
        self.streams = 0
        """Generate streams open now (a stream is a coroutine on the loop, not a thread)."""

    def prompt_bounds(self) -> tuple[int, int]:
        """(tokens, bytes): the largest prompt any served model accepts now; 0 = unbounded (a model
        without that bound)."""
        limits = [m.router.limits() for m in self.models.all()]
        tokens = 0 if not limits or any(not lim.max_tokens for lim in limits) else max(lim.max_tokens for lim in limits)
        nbytes = 0 if not limits or any(not lim.max_bytes for lim in limits) else max(lim.max_bytes for lim in limits)
        return tokens, nbytes

    def body_bounds(self, config: RouterConfig) -> BodyBounds:
        """The bounds of an OpenAI body now (both HTTP-speaking fronts: the API and the endpoint picker):
        the flags, and the largest prompt any served model accepts."""
        tokens, nbytes = self.prompt_bounds()
        # NOTE: twice the largest prompt: these bound the work a body costs; a prompt over its own model's
        # bound (but under these) gets the request path's message, which names the limit and the flag.
        return BodyBounds(config.max_body_bytes, config.max_messages, config.max_content_parts,
                          max_prompt_ids=2 * tokens + 16 if tokens else 0,
                          max_token_bytes=6 * nbytes + 1024 if nbytes else 0)

    def admit(self) -> None:
        """Counts one more open stream, or refuses it past ``max_streams`` (ResourceExhausted); the
        caller ends it with :meth:`release`. (:meth:`generate` does both itself.)"""
        if self.streams >= self.max_streams:
            self.metrics.refused.inc()
            raise ResourceExhausted(f"this router has {self.max_streams} streams open (--max-streams); "
                                    "retry later or on another router")
        self.streams += 1
        self.metrics.inflight.inc()

    def release(self, outcome: str) -> None:
        """An admitted stream ended: ``ok``, ``error`` or ``cancelled``."""
        self.streams -= 1
        self.metrics.inflight.dec()
        self.metrics.requests.labels(outcome).inc()

    def model(self, name: str) -> ServedModel:
        """Raises NotFound / InvalidArgument (router/models.py)."""
        return self.models.resolve(name)

    def target(self, name: str) -> tuple[ServedModel, str]:
        """The model a request names and the LoRA adapter it runs under ("" = none); raises as :meth:`model`."""
        return self.models.target(name)

    async def generate(self, model: ServedModel, inp: GenerateInput, request_id: str | None = None,
                       span: Any = None) -> AsyncIterator[GenerateOutput]:
        """The model's request path under the stream limit; raises what ModelRouter.generate raises.
        ``request_id``: the id ``model.router.request_id_for(inp)`` made (None: made on the way); ``span``:
        the request's span, opened (and ended) by the adapter (None: the request path opens one)."""
        self.admit()
        outcome = "error"
        try:
            # NOTE: aclosing: an adapter that stops reading (client gone) closes this generator, and
            # the request path's finally blocks (in-flight share, worker call) run now, not at GC.
            async with aclosing(model.router.generate(inp, request_id, span)) as outputs:
                async for out in outputs:
                    if out.finish_reason is not None:
                        outcome = "ok"
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            if outcome != "ok":
                outcome = "cancelled"  # the client went away (or the call's deadline passed)
            raise
        finally:
            self.release(outcome)
