"""A request's state on its way through the router: one typed object, made at the front door
(router/request/pipeline.py) and carried through every stage.

No grpc, no redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.contract.kv_transfer import KVSource
from kvmesh.router.core.decide import Decided
from kvmesh.router.core.plan import RoutePlan
from kvmesh.router.core.policies.base import Decision
from kvmesh.router.generate_types import GenerateInput
from kvmesh.router.text.prompt import PromptLimits


@dataclass(slots=True)
class PrefillOutcome:
    """A prefill leg that ran: where, what its cache served, and the KV it holds for the decode worker."""

    worker_id: str
    cached_tokens: int
    source: KVSource
    taken: bool = False
    """The decode leg took the KV (else the prefill worker is told to release it)."""
    transfer: str = ""
    """How the KV came (``nixl 12 blocks``), for the log line."""


@dataclass(slots=True)
class RequestContext:
    """One request, from the front door to its last output."""

    inp: GenerateInput
    request_id: str
    """The id the worker and the logs see (the client's with a random suffix, or a random one)."""
    span: Any = None
    """The request's span while tracing is on (router.request)."""
    limits: PromptLimits | None = None
    token_ids: Sequence[int] = ()
    decided: Decided | None = None
    deadline: float = 0.0
    """``time.monotonic()`` by which the request must have ended (the client's deadline or the router's)."""
    prefill: PrefillOutcome | None = None
    tried: Decision | None = None
    """The pick of the attempt in progress (its reason and matched blocks go to the log line)."""

    @property
    def plan(self) -> RoutePlan:
        assert self.decided is not None, "the decide stage runs first"
        return self.decided.plan
