"""What the request path needs from the outside, as plain types and protocols.

router/model_router.py (the request path) talks to workers and the prefix index only through these.
They are implemented over the network by router/workers/worker_pool.py (``WorkerPool``: gRPC
workers, router/workers/worker_calls.py, and engines served over the OpenAI API,
router/workers/openai_worker.py) and kvmesh/kv_client/router_client.py (``AsyncPrefixIndex``: the
kv_service's Lookup and Reserve); in one process by the simulator (kvmesh/sim/). The index
protocol's records (``WorkerMatch``, ``Reservation``, ``ReservationAnswer``, ``IndexUnavailable``)
are kvmesh/contract/index_protocol.py's, shared with the kv_service. Keeping the request path free
of grpc lets the tests drive it with fakes, and keeps the reading of gRPC status codes in the
adapters.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.contract.errors import FailedPrecondition
from kvmesh.contract.index_protocol import Reservation, ReservationAnswer, WorkerMatch
from kvmesh.contract.kv_transfer import KVSource
from kvmesh.contract.types import Load, ModelSpec, SamplingParams, TraceContext, Usage


@dataclass(slots=True)
class WorkerEndpoint:
    """A worker the router may send to."""

    worker_id: str
    address: str
    load: Load = field(default_factory=Load)
    role: str = "both"
    """prefill, decode or both (kvmesh/contract/kv_transfer.py): which legs of a request it takes."""
    epoch: int = 0
    """The worker process's registration epoch (0: not known, a static ``--workers`` address)."""


@dataclass(slots=True, frozen=True)
class WorkerRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    cache_salt: str = ""
    prefill_leg: bool = False
    """Prefill/decode disaggregation: compute the prompt (max_tokens 1) and hold its KV for a decode
    worker (vLLM's do_remote_decode); the last chunk carries the :class:`KVSource`."""
    kv_source: KVSource | None = None
    """A decode leg: take the prompt's KV from there (the prefill leg's answer)."""
    trace: TraceContext | None = None
    """The trace context of the router's forward span (None = tracing off): the worker's spans join the
    request's trace (docs/tracing.md)."""
    adapter: str = ""
    """The LoRA adapter to run it under ("" = the base model)."""


@dataclass(slots=True, frozen=True)
class WorkerChunk:
    """One streamed message of a worker; the last carries finish_reason and usage."""

    token_ids: Sequence[int]
    finish_reason: str | None = None
    """"stop", "length" or "abort" on the last message; None before."""
    usage: Usage | None = None
    worker_id: str = ""
    kv_source: KVSource | None = None
    """A prefill leg's last chunk: where its KV is held."""
    kv_transport: str = ""
    """A decode leg's last chunk: nixl, grpc, or local (it prefilled itself)."""
    kv_blocks_pulled: int = 0
    kv_bytes_pulled: int = 0
    kv_pull_s: float = 0.0


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

    async def change_adapter(self, endpoint: WorkerEndpoint, name: str, path: str, load: bool) -> None:
        """Loads (or unloads) a LoRA adapter on the worker (docs/adapters.md); raises its refusal."""
        raise FailedPrecondition("this pool's workers take no LoRA adapters at run time")

    async def abort(self, endpoint: WorkerEndpoint, request_id: str) -> bool:
        """Asks the worker to end the request now; its stream then ends with finish_reason "abort"
        and the request's usage. False when the worker did not know it (or could not be asked)."""
        ...


class PrefixIndex(Protocol):
    """A Lookup answered at once (the simulator's in-process index; router/core/routing.py's ``plan``)."""

    def lookup(self, model_id: str, block_hashes: Sequence[bytes]) -> list[WorkerMatch]:
        """Raises IndexUnavailable when the answer cannot be had within the lookup deadline."""
        ...

    def lookup_reserve(self, model_id: str, block_hashes: Sequence[bytes],
                       reservation: Reservation) -> tuple[list[WorkerMatch], bool]:
        """The Lookup with ``reservation`` made in the same step (AsyncPrefixIndex.lookup_reserve)."""
        ...


class AsyncPrefixIndex(Protocol):
    """The kv_service's Lookup (and Reserve) over the network (the live router awaits them)."""

    async def lookup(self, model_id: str, block_hashes: Sequence[bytes]) -> list[WorkerMatch]:
        """Raises IndexUnavailable when the answer cannot be had within the lookup deadline."""
        ...

    async def lookup_reserve(self, model_id: str, block_hashes: Sequence[bytes],
                             reservation: Reservation) -> tuple[list[WorkerMatch], bool]:
        """The Lookup with ``reservation`` made in the same call, after the answer is read: (the answer,
        whether it was reserved). Raises IndexUnavailable as ``lookup`` does."""
        ...

    async def reserve(self, reservation: Reservation) -> ReservationAnswer:
        """Raises IndexUnavailable when the answer cannot be had within the lookup deadline."""
        ...
