"""What the request path needs from the outside, as plain types and protocols.

router/router.py (the request path) talks to workers and the prefix index only through these;
router/adapters/discovery.py implements them over gRPC. Keeping the request path free of grpc lets the
tests drive it with fakes and keeps one place (discovery.py) that reads gRPC status codes.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.contract.types import NO_PENDING, Load, ModelSpec, Pending, SamplingParams, Usage


@dataclass(slots=True)
class WorkerEndpoint:
    """A worker the router may send to."""

    worker_id: str
    address: str
    load: Load = field(default_factory=Load)


@dataclass(slots=True, frozen=True)
class IndexMatch:
    """One worker of a Lookup answer."""

    worker_id: str
    address: str
    matched_blocks: int
    load: Load
    pending: Pending = NO_PENDING
    """Routers' picks of the worker its reports do not cover yet (the shared router view)."""


@dataclass(slots=True, frozen=True)
class Claim:
    """A pick to reserve in the kv_service before the request is forwarded (the shared router view)."""

    worker_id: str
    request_id: str
    """The id the worker sees the request under: its admission retires the pick."""
    prefill_tokens: int
    blocks: int
    seen_version: int | None
    """The worker's reservation count in this router's Lookup; None = reserve unconditionally."""


@dataclass(slots=True, frozen=True)
class ClaimAnswer:
    reserved: bool
    pending: dict[str, Pending] = field(default_factory=dict)
    """When refused: every live worker's pending picks now."""


@dataclass(slots=True, frozen=True)
class WorkerRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    cache_salt: str = ""


@dataclass(slots=True, frozen=True)
class WorkerChunk:
    """One streamed message of a worker; the last carries finish_reason and usage."""

    token_ids: Sequence[int]
    finish_reason: str | None = None
    """"stop", "length" or "abort" on the last message; None before."""
    usage: Usage | None = None
    worker_id: str = ""


class Failure(enum.Enum):
    """Why a worker call failed, as far as the request path cares."""

    INVALID = "invalid"
    """The request is bad; every worker would refuse it. Never retried."""
    UNAVAILABLE = "unavailable"
    """The worker is down or unreachable. Retried elsewhere; the worker is marked unhealthy."""
    BUSY = "busy"
    """The worker is at capacity (RESOURCE_EXHAUSTED). Retried elsewhere."""
    TIMEOUT = "timeout"
    """The call's deadline passed."""
    CANCELLED = "cancelled"
    """This router cancelled the call (the client went away)."""
    OTHER = "other"
    """Any other failure (a worker bug). Not retried: it would likely repeat."""


RETRIABLE = frozenset({Failure.UNAVAILABLE, Failure.BUSY, Failure.TIMEOUT})


class WorkerError(Exception):
    """A worker call failed; ``failure`` says how, the message says what happened (for logs).

    ``details`` is the worker's own message about the request (the status details, without who
    said it): what a client may be shown of an INVALID failure.
    """

    def __init__(self, failure: Failure, message: str, details: str | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.details = message if details is None else details


class IndexUnavailable(Exception):
    """The prefix index (kv_service) could not answer; route without it."""

    def __init__(self, message: str, cause: str = "lookup_failed") -> None:
        super().__init__(message)
        self.cause = cause
        """lookup_failed (the index is down or too slow: the breaker opens), lookup_invalid (it
        refused this Lookup as malformed: this request routes without it, the index stays in use)
        or index_down (skipped: a recent call failed)."""


class WorkerCall(Protocol):
    """A streaming Generate in progress (read on the router's event loop)."""

    def __aiter__(self) -> AsyncIterator[WorkerChunk]:
        """Chunks in order; raises WorkerError on failure."""
        ...

    def cancel(self) -> None: ...


class WorkerPool(Protocol):
    """The workers of one model and a way to call them."""

    discovers_from_index: bool
    """True when the worker set comes from kv_service: a Lookup may name workers not yet polled."""
    problem: str
    """Why the worker set is empty or stale, for error messages ("" when fine)."""

    def endpoints(self) -> list[WorkerEndpoint]: ...

    def model_spec(self) -> ModelSpec:
        """Raises kvmesh.contract.errors.Unavailable when the spec is not known yet."""
        ...

    def healthy(self, worker_id: str) -> bool: ...

    def mark_unhealthy(self, worker_id: str) -> None: ...

    def generate(self, endpoint: WorkerEndpoint, request: WorkerRequest, timeout_s: float) -> WorkerCall: ...

    async def abort(self, endpoint: WorkerEndpoint, request_id: str) -> bool:
        """Asks the worker to end the request now; its stream then ends with finish_reason "abort"
        and the request's usage. False when the worker did not know it (or could not be asked)."""
        ...


class PrefixIndex(Protocol):
    """A Lookup answered at once (the simulator's in-process index; router/core.py's ``plan``)."""

    def lookup(self, model_id: str, block_hashes: Sequence[bytes]) -> list[IndexMatch]:
        """Raises IndexUnavailable when the answer cannot be had within the lookup deadline."""
        ...


class AsyncPrefixIndex(Protocol):
    """The kv_service's Lookup (and Reserve) over the network (the live router awaits them)."""

    async def lookup(self, model_id: str, block_hashes: Sequence[bytes]) -> list[IndexMatch]:
        """Raises IndexUnavailable when the answer cannot be had within the lookup deadline."""
        ...

    async def reserve(self, model_id: str, router_id: str, claim: Claim) -> ClaimAnswer:
        """Raises IndexUnavailable when the answer cannot be had within the lookup deadline."""
        ...
