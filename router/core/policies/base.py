"""What every routing policy sees and returns, and the helpers they share.

A policy sees one :class:`RouteQuery` (the prompt's length and block chain) and the live
:class:`Candidate` workers, and returns a :class:`Decision`. Policies are pure: no grpc, no I/O,
no clock; randomness comes from a seedable ``random.Random`` so tests pin every pick.

kv-aware scores each candidate by the request's predicted time to first token there plus what
its prefill costs the others (``KvAwarePolicy``; docs/router.md). The field's policies are in
router/core/policies/field.py. Queued work in tokens (least-loaded, the rendezvous fallback's bound):

    reported = load.queued_prefill_tokens + decode_cost * (load.num_running + load.num_waiting)
             + pending.prefill_tokens + decode_cost * pending.requests
    own      = inflight_prefill_tokens + decode_cost * inflight_requests
    queued   = max(reported, own)

``pending`` is the routers' picks of the worker its reports do not cover yet (the shared router
view, docs/router.md "Several routers"): zero for a policy that does not read it.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import abc
import hashlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kvmesh.contract.index_protocol import NO_PENDING, Pending
from kvmesh.contract.settings import code_only, flag
from kvmesh.contract.types import Load
from kvmesh.router.core.inflight import Ticket

STEP_COST_FITS = ("worker", "pooled")


@dataclass(slots=True)
class PolicyConfig:
    """Knobs shared by the policies (one set per router); `kvmesh router` and `kvmesh simulate` flags."""

    decode_cost_tokens: int = flag(32, name="decode-cost")
    """Tokens of work charged per running or queued request for its decode steps."""
    overlap_weight: float = 1.0
    """dynamo: weight of the uncached prefill blocks against the decode blocks (Dynamo's overlap score weight)."""
    decode_harm_weight: float = 0.5
    """kv-aware: weight of the delay a request's prefill adds to the requests decoding on the worker, against
    its own predicted time to first token."""
    work_weight: float = 1.0
    """kv-aware: weight of the prefill work a request adds to the mesh (capacity a recomputed prefix costs),
    against its own predicted time to first token."""
    step_cost_fit: str = "worker"
    """kv-aware: fit each worker's step cost from its own reports (worker; the pooled fit answers until a
    worker has enough) or one fit over every worker's reports (pooled) (docs/benchmarks.md)."""
    temperature: float = flag(0.0, name="router-temperature")
    """kv-aware: 0 = the best predicted worker wins; > 0 = softmax sampling over the scores normalized to [0, 1]
    at this temperature (Dynamo's --router-temperature), so several routers spread a burst (docs/router.md)."""
    balance_factor: float = 2.0
    """Hot-spot test of the rendezvous fallback: a worker queued over this x the mean and over the least loaded
    by --balance-min-tokens is skipped."""
    balance_min_tokens: int = 2048
    """The rendezvous fallback's hot-spot margin in tokens."""
    fallback_prefix_blocks: int = 4
    """Without the index: leading blocks whose rendezvous hash picks the worker."""
    adapter_cpu_load_s: float = 0.0034
    """kv-aware: seconds to copy a LoRA adapter from a worker's CPU memory into a GPU slot until the workers' load
    reports taught it (rank 16 on Llama-3-8B, 84 MB over PCIe at ~25 GB/s; docs/adapters.md)."""
    adapter_disk_load_s: float = 0.065
    """kv-aware: seconds to read a LoRA adapter from disk into a GPU slot until the workers' load reports taught it
    (84 MB at ~2 GB/s, ~20 ms to open it, the copy; docs/adapters.md)."""
    default_step_tokens: int = 2048
    """A worker's token budget per step when its load does not report one (an older worker)."""
    seed: int | None = None
    """Seeds the policy's tie-break RNG (tests); none = nondeterministic."""
    clock: Callable[[], float] = code_only(time.monotonic)
    """Monotonic seconds, for policies with a time window (the simulator's virtual clock)."""

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if not self.overlap_weight >= 0:
            raise ValueError(f"--overlap-weight must be >= 0, got {self.overlap_weight}")
        if not self.decode_harm_weight >= 0 or not self.work_weight >= 0:
            raise ValueError(f"--decode-harm-weight and --work-weight must be >= 0, got {self.decode_harm_weight}, "
                             f"{self.work_weight}")
        if self.step_cost_fit not in STEP_COST_FITS:
            raise ValueError(f"--step-cost-fit must be one of {', '.join(STEP_COST_FITS)}, got {self.step_cost_fit!r}")
        if not self.temperature >= 0:
            raise ValueError(f"--router-temperature must be >= 0, got {self.temperature}")
        if not (self.adapter_cpu_load_s >= 0 and self.adapter_disk_load_s >= 0):
            raise ValueError(f"--adapter-cpu-load-s and --adapter-disk-load-s must be >= 0, got "
                             f"{self.adapter_cpu_load_s}, {self.adapter_disk_load_s}")
        if self.balance_factor < 1.0:
            raise ValueError(f"--balance-factor must be >= 1.0, got {self.balance_factor}")


@dataclass(slots=True)
class Candidate:
    """One live worker as the router sees it for one request."""

    worker_id: str
    address: str
    matched_blocks: int = 0
    """Leading blocks of the prompt the worker holds (index answer or speculative, the max)."""
    load: Load = field(default_factory=Load)
    """The worker's last reported load (heartbeat via kv_service, or its GetLoad)."""
    inflight_requests: int = 0
    """Requests this router sent to the worker that have not finished."""
    inflight_prefill_tokens: int = 0
    """Uncached prompt tokens of this router's requests to the worker not yet past prefill."""
    inflight_waiting: int = 0
    """This router's requests to the worker not yet past their first token."""
    inflight_blocks: int = 0
    """KV blocks the prompts of this router's unfinished requests to the worker take."""
    indexed_blocks: int = 0
    """Leading blocks of the prompt the index alone says the worker holds (no speculative map): what a peer
    that reads only its KV-event index sees (dynamo, llm-d)."""
    pending: Pending = NO_PENDING
    """Every router's picks of the worker that its reports do not cover yet (the shared router view;
    this router's own among them); zero when the policy does not read it or the view is off."""
    host_blocks: int = 0
    """Blocks of the prompt past ``matched_blocks`` that the worker's host KV tier holds (the index's
    answer): the worker loads them back instead of recomputing them (docs/engine.md, Host KV tier)."""
    indexed_host_blocks: int = 0
    """The index's host continuation past ``indexed_blocks`` (what a peer that reads only its index sees)."""


@dataclass(slots=True, frozen=True)
class Objectives:
    """A request's latency objectives, in seconds (0 = none): llm-d's ``x-slo-ttft-ms`` and ``x-slo-tpot-ms``
    headers, the gRPC request's fields, or the router's default flags (docs/router.md "Latency objectives")."""

    ttft_s: float = 0.0
    """Time to first token."""
    tpot_s: float = 0.0
    """Time per output token after the first."""

    def __bool__(self) -> bool:
        return self.ttft_s > 0 or self.tpot_s > 0


NO_OBJECTIVES = Objectives()


@dataclass(slots=True, frozen=True)
class ObjectiveMiss:
    """A policy's word that no candidate is predicted to meet a request's objectives (the refusal's message)."""

    objective: str
    """``ttft`` or ``tpot``."""
    target_s: float
    best_s: float
    """The best prediction among the candidates (for a TTFT missed only beside the TPOT: among those that meet it)."""

    def __str__(self) -> str:
        return (f"no worker is predicted to meet the request's {self.objective.upper()} objective of "
                f"{self.target_s * 1000:g} ms (the best predicted is {self.best_s * 1000:.3g} ms)")


@dataclass(slots=True, frozen=True)
class RouteQuery:
    """What a policy sees of a request."""

    prompt_len: int
    block_size: int
    block_hashes: Sequence[bytes]
    index_ok: bool = True
    """False when the prefix index could not be asked: matched_blocks are not to be trusted."""
    max_tokens: int = 0
    """The request's max_tokens (0 = not known): what its decode may cost."""
    objectives: Objectives = NO_OBJECTIVES
    """The request's latency objectives (none by default)."""
    adapter: str = ""
    """The LoRA adapter the request runs under ("" = the base model): its blocks are keyed by it, and only the
    workers that serve it (``Load.adapters``) are candidates (docs/adapters.md)."""


@dataclass(slots=True, frozen=True)
class Decision:
    worker_id: str
    reason: str
    """Why: prefix, load, balance, fallback, round_robin, least_loaded, prefix_hash."""
    score: int = 0


def queued_tokens(c: Candidate, decode_cost: int) -> int:
    """Work already waiting at the worker, in tokens.

    NOTE: the max, not the sum, of the two views: the worker's report already counts this
    router's requests once its heartbeat catches up, so a sum would charge them twice. The router's
    own view is fresh but blind to other routers; the report is complete but a heartbeat old. The max
    is the best lower bound of the truth that both give.
    """
    p = c.pending
    reported = (c.load.queued_prefill_tokens + p.prefill_tokens
                + decode_cost * (c.load.num_running + c.load.num_waiting + p.requests))
    own = c.inflight_prefill_tokens + decode_cost * c.inflight_requests
    return max(reported, own)


def uncached_tokens(c: Candidate, q: RouteQuery) -> int:
    """Prompt tokens the worker would compute: neither on its device nor loaded back from its host tier."""
    return max(0, q.prompt_len - (c.matched_blocks + c.host_blocks) * q.block_size)


class RouterPolicy(abc.ABC):
    """Picks one candidate for a request. Implementations must be thread-safe.

    Besides :meth:`pick`, a policy may keep its own record of the requests it routed: the router calls
    :meth:`started`, :meth:`prefilled` and :meth:`finished` for every attempt (router/core/routing.py, from the
    live request path and the simulator alike). Two optional multi-router capabilities are driven from
    outside (the simulator drives both; a live router drives neither): replica sync (:attr:`replica_sync`)
    and load scrapes (:attr:`scrape_interval_s`).
    """

    name: ClassVar[str]
    uses_index: ClassVar[bool] = False
    """Whether the router should ask the prefix index (Lookup) before calling :meth:`pick`."""
    shares_view: ClassVar[bool] = False
    """Whether the policy reads the routers' shared view (``Candidate.pending``): the router then
    reserves each pick in the kv_service (docs/router.md, "Several routers"). The field's policies
    keep their own systems' multi-router behaviour instead."""
    replica_sync: ClassVar[bool] = False
    """Whether the policy has a replica-sync mode: each router publishes the events of its own requests and
    applies its peers' (Dynamo's ``--router-replica-sync``). The driver turns it on with
    :meth:`sync_replicas` and hands each peer's batch to :meth:`apply_replica_events`."""
    replica_batch: ClassVar[tuple[float, int]] = (0.0, 1)
    """With replica sync: (seconds, events) a router's events wait to be sent together, at most."""
    scrape_interval_s: ClassVar[float] = 0.0
    """> 0: the original reads the workers' load from its own periodic scrapes (llm-d: every 50 ms); a driver
    that models them hands each one to :meth:`scraped`. Without scrapes the policy reads the index's load."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self._prefer: int | None = None
        """The index of the candidate that wins a tie (:meth:`pick_preferring`)."""

    pick_records: ClassVar[bool] = False
    """A pick changes the policy's own state (a rotation, a tree insert): :meth:`fallbacks` ranks by queued
    work instead of picking again."""

    @abc.abstractmethod
    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        """Returns the chosen worker; ``candidates`` is never empty."""

    def pick_preferring(self, query: RouteQuery, candidates: Sequence[Candidate], worker_id: str | None) -> Decision:
        """:meth:`pick`, ``worker_id`` winning a tie it is part of instead of a random draw (the worker a
        Lookup's folded reservation holds, router/core/routing.py: of equals, keep the one reserved)."""
        self._prefer = next((i for i, c in enumerate(candidates) if c.worker_id == worker_id), None)
        try:
            return self.pick(query, candidates)
        finally:
            self._prefer = None

    def fallbacks(self, query: RouteQuery, candidates: Sequence[Candidate], n: int) -> list[str]:
        """The workers a retry would try, best first, at most ``n``: the policy's next picks among
        ``candidates``, the policy left as it was (its random state restored), so listing fallbacks
        changes no later pick (kvmesh epp lists them for the gateway)."""
        if self.pick_records:
            return [c.worker_id for c in sorted(candidates, key=lambda c: (self._queued(c), c.worker_id))[:n]]
        with self._lock:
            state = self._rng.getstate()
        left, out = list(candidates), []
        try:
            while left and len(out) < n:
                w = self.pick(query, left).worker_id
                out.append(w)
                left = [c for c in left if c.worker_id != w]
        finally:
            with self._lock:
                self._rng.setstate(state)
        return out

    def objective_miss(self, query: RouteQuery, candidates: Sequence[Candidate]) -> ObjectiveMiss | None:
        """None when some candidate is predicted to meet the query's latency objectives, or the policy
        predicts no latency (the default); else which objective none meets (``--slo-refuse``)."""
        return None

    def meets_objectives(self, query: RouteQuery, candidates: Sequence[Candidate]) -> bool:
        return self.objective_miss(query, candidates) is None

    # -- the policy's record of its requests (optional) -----------------------------------
    def started(self, ticket: Ticket, query: RouteQuery, chosen: Candidate) -> None:  # noqa: B027 - optional hook
        """The request was sent to ``chosen`` (after every pick that is tried, retries included)."""

    def prefilled(self, ticket: Ticket) -> None:  # noqa: B027 - optional hook
        """The request's first token arrived (once per ticket)."""

    def finished(self, ticket: Ticket, output_tokens: int) -> None:  # noqa: B027 - optional hook
        """The request ended, however it ended (once per ticket); ``output_tokens``: how many it generated
        (0 when it failed or is not known)."""

    # -- multi-router capabilities (optional) ---------------------------------------------
    def sync_replicas(self, replica_id: str, publish: Callable[[object], None]) -> None:
        """Turns replica sync on: from now on every event of this router's requests goes to ``publish``;
        ``replica_id`` names this router in them."""
        raise NotImplementedError(f"{self.name} has no replica-sync mode")

    def apply_replica_events(self, events: Sequence[object]) -> None:
        """A batch of a peer router's events (in the order it published them)."""
        raise NotImplementedError(f"{self.name} has no replica-sync mode")

    def scraped(self, worker_id: str, load: Load) -> None:  # noqa: B027 - optional hook
        """A scrape of the worker's load (only called when :attr:`scrape_interval_s` > 0)."""

    # -- helpers shared by the policies ---------------------------------------------------
    def _choice_index(self, tied: Sequence[int]) -> int:
        if len(tied) == 1:
            return tied[0]
        if self._prefer is not None and self._prefer in tied:
            return self._prefer
        with self._lock:  # one RNG shared by the server's threads
            return tied[self._rng.randrange(len(tied))]

    def _argmin(self, candidates: Sequence[Candidate], key: Callable[[Candidate], int]) -> tuple[Candidate, int]:
        """The candidate with the least key, ties broken at random."""
        scores = [key(c) for c in candidates]
        best = min(scores)
        i = self._choice_index([i for i, s in enumerate(scores) if s == best])
        return candidates[i], best

    def _queued(self, c: Candidate) -> int:
        return queued_tokens(c, self.config.decode_cost_tokens)

    def overloaded(self, queued: int, all_queued: Sequence[int]) -> bool:
        """The hot-spot test: the rendezvous fallback skips an overloaded worker.

        NOTE: the least loaded worker is never overloaded (queued - min == 0), so a walk that
        skips overloaded workers always ends on one.
        """
        mean = sum(all_queued) / len(all_queued)
        return queued > self.config.balance_factor * mean and queued - min(all_queued) > self.config.balance_min_tokens

    def least_loaded(self, candidates: Sequence[Candidate], reason: str = "least_loaded") -> Decision:
        c, q = self._argmin(candidates, self._queued)
        return Decision(c.worker_id, reason, q)

    def rendezvous(self, query: RouteQuery, candidates: Sequence[Candidate], reason: str) -> Decision:
        """Highest-random-weight hash of the prompt's leading blocks, skipping overloaded workers.

        Prompts without a full block have no key; they go to the least loaded worker.
        """
        if not query.block_hashes:
            return self.least_loaded(candidates, reason)
        n = max(1, min(self.config.fallback_prefix_blocks, len(query.block_hashes)))
        # NOTE: block hashes are chained, so the n-th one names the whole n-block prefix.
        key = query.block_hashes[n - 1]
        queued = [self._queued(c) for c in candidates]
        order = sorted(range(len(candidates)), key=lambda i: rendezvous_weight(key, candidates[i].worker_id),
                       reverse=True)
        for i in order:
            if not self.overloaded(queued[i], queued):
                return Decision(candidates[i].worker_id, reason, queued[i])
        raise AssertionError("unreachable: the least loaded worker is never overloaded")


def rendezvous_weight(key: bytes, worker_id: str) -> int:
    """The worker's weight for ``key``; the highest weight wins. Stable across processes."""
    return int.from_bytes(hashlib.blake2b(key + worker_id.encode(), digest_size=8).digest(), "big")


def queued_prefill(c: Candidate) -> int:
    """Prompt tokens waiting for prefill at the worker: its report (plus the picks it does not cover
    yet) or this router's view, the larger."""
    return max(c.load.queued_prefill_tokens + c.pending.prefill_tokens, c.inflight_prefill_tokens)


def busy_requests(c: Candidate) -> int:
    """Requests at the worker (running or waiting): its report (plus the picks it does not cover
    yet) or this router's view, the larger."""
    return max(c.load.num_running + c.load.num_waiting + c.pending.requests, c.inflight_requests)


def waiting_requests(c: Candidate) -> int:
    """Requests at the worker not yet past prefill: its report (plus the picks it does not cover
    yet) or this router's view, the larger."""
    return max(c.load.num_waiting + c.pending.requests, c.inflight_waiting)


def used_blocks(c: Candidate) -> int:
    """KV blocks held by the worker's requests: its report (plus the picks it does not cover yet)
    or this router's view, the larger."""
    reported = c.load.num_total_blocks - c.load.num_free_blocks if c.load.num_total_blocks else 0
    return max(reported + c.pending.blocks, c.inflight_blocks)
