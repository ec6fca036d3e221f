"""preble: exploit the allocation of a reused prefix, explore by windowed load plus eviction cost,
decode charged for live requests only, and the rebalancer's move and replicate after 50 x N requests."""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable

import pytest

from kvmesh.contract.types import Load
from kvmesh.router.core.inflight import InFlight, Ticket
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.preble import NOMINAL_PREFILL_TOKEN_S, NOMINAL_STEP_S, PreblePolicy

BS = 16


def blocks(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}.{i}".encode()).digest()[:16] for i in range(n)]


def prompt(*parts: list[bytes], max_tokens: int = 100) -> RouteQuery:
    chain = [h for p in parts for h in p]
    return RouteQuery(len(chain) * BS, BS, chain, True, max_tokens)


def workers(*ids: str, total_blocks: int = 10_000) -> list[Candidate]:
    return [Candidate(w, w, load=Load(num_total_blocks=total_blocks)) for w in ids]


class Driver:
    """Routes requests through the policy and replays their first tokens and ends on a virtual clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.policy = PreblePolicy(PolicyConfig(seed=0, clock=lambda: self.now))
        self.inflight = InFlight()
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0

    def route(self, q: RouteQuery, cands: list[Candidate], ttft: float | None = None, finish_after: float = 0.5,
              output_tokens: int = 1) -> tuple[str, Ticket]:
        d = self.policy.pick(q, cands)
        chosen = next(c for c in cands if c.worker_id == d.worker_id)
        ticket = self.inflight.start(d.worker_id, 0)
        self.policy.started(ticket, q, chosen)
        if ttft is not None:
            self._at(self.now + ttft, lambda: self.policy.prefilled(ticket))
            self._at(self.now + ttft + finish_after, lambda: self.policy.finished(ticket, output_tokens))
        return d.worker_id, ticket

    def _at(self, t: float, fn: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._events, (t, self._n, fn))

    def advance(self, t: float) -> None:
        while self._events and self._events[0][0] <= t:
            self.now, _, fn = heapq.heappop(self._events)
            fn()
        self.now = t


def nominal_prefill(tokens: int) -> float:
    return NOMINAL_STEP_S * 1 + NOMINAL_PREFILL_TOKEN_S * tokens


def test_exploits_the_allocation_of_a_reused_prefix_and_explores_otherwise():
    d = Driver()
    cands = workers("w0", "w1")
    p = d.policy
    shared = blocks("sys", 8)
    first = p.pick(prompt(shared, blocks("a", 1)), cands)
    assert (first.worker_id, first.reason) == ("w0", "explore")  # all zero: the first
    # 1 new block against 8 reused: exploit the prefix's allocation, although w1 is idle
    again = p.pick(prompt(shared, blocks("b", 1)), cands)
    assert (again.worker_id, again.reason) == ("w0", "exploit")
    # an unrelated prompt explores: w0 carries the window's load
    other = p.pick(prompt(blocks("z", 9)), cands)
    assert (other.worker_id, other.reason) == ("w1", "explore")
    # mostly new tokens (8 new against 8 reused is not fewer): explore
    assert p.pick(prompt(shared, blocks("c", 8)), cands).reason == "explore"


def test_decode_load_counts_live_requests_only_and_the_window_forgets_after_3_minutes():
    d = Driver()
    p = d.policy
    cands = workers("w0", "w1")
    q = prompt(blocks("a", 9), max_tokens=100)
    _, ticket = d.route(q, cands)
    prefill = 1.0 * 1 * nominal_prefill(9 * BS)  # miss rate 1, one request, one worker allocated
    assert p.loads(["w0", "w1"]) == {"w0": pytest.approx(prefill + 1 * 100 * 0.15), "w1": 0.0}
    p.prefilled(ticket)
    p.finished(ticket, 1)  # one token: no TPOT sample, the 0.15 s seed stays
    assert p.loads(["w0", "w1"]) == {"w0": pytest.approx(prefill), "w1": 0.0}
    # 3 minutes later the request has left the window: its node's load and allocation are gone
    d.now = 181.0
    p.pick(prompt(blocks("b", 9)), cands)
    assert p.loads(["w0"]) == {"w0": 0.0}


def test_eviction_cost_takes_the_workers_memory_as_full():
    d = Driver()
    p = d.policy
    cands = workers("w0", "w1")
    _, t = d.route(prompt(blocks("a", 9)), cands)
    p.finished(t, 0)
    # any new tokens on w0 would evict its only node, large, seen once with no hit
    assert p.eviction_cost("w0", 16) == pytest.approx(nominal_prefill(9 * BS))
    assert p.eviction_cost("w1", 16) == 0.0 and p.eviction_cost("w0", 0) == 0.0


def test_bookkeeping_eviction_keeps_a_workers_cached_tokens_within_its_capacity():
    d = Driver()
    p = d.policy
    one = workers("w0", total_blocks=12)  # 192 tokens
    _, t = d.route(prompt(blocks("a", 9)), one)
    p.finished(t, 0)
    assert p.cached_tokens("w0") == 144
    d.now = 1.0
    d.route(prompt(blocks("b", 9)), one)  # 288 > 192: the unused, older node stops counting as cached
    assert p.cached_tokens("w0") == 144
    assert p.eviction_cost("w0", 16) == pytest.approx(nominal_prefill(9 * BS) * 1)  # b's, live, ref 1


def _hot_prompt(d: Driver, cands: list[Candidate], ttft_after_50: float) -> list[str]:
    """100 requests of one 8-block system prompt + 1 private block, one a second, routed to the two workers."""
    shared = blocks("sys", 8)
    picks = []
    for i in range(101):
        d.advance(float(i))
        ttft = 1.0 if i < 50 else ttft_after_50
        w, _ = d.route(prompt(shared, blocks(f"u{i}", 1)), cands, ttft=ttft)
        picks.append(w)
    return picks


def test_a_hot_prefix_is_replicated_after_50n_requests_when_its_ttft_doubled():
    d = Driver()
    picks = _hot_prompt(d, workers("w0", "w1"), ttft_after_50=5.0)
    # 50 x 2 requests before any rebalancing: all on the prefix's worker
    assert picks[:100] == ["w0"] * 100
    # at the 100th the rebalancer sees w0 >= 1.5 x w1 with one hot node whose TTFT doubled: replicated
    assert picks[100] == "w1"


def test_a_hot_prefix_whose_ttft_holds_stays_on_its_worker():
    d = Driver()
    picks = _hot_prompt(d, workers("w0", "w1"), ttft_after_50=1.0)
    assert picks == ["w0"] * 101


def test_the_rebalancer_moves_the_cheapest_prefixes_to_a_new_worker():
    d = Driver()
    p = d.policy
    groups = [blocks(f"g{g}", 8) for g in range(3)]
    for i in range(99):  # one worker: every group is allocated to it
        d.advance(float(i))
        d.route(prompt(groups[i % 3], blocks(f"u{i}", 1)), workers("w0"), ttft=0.5)
    d.advance(99.0)
    both = workers("w0", "w1")
    # routed 99 < 50 x 2: a new worker gets nothing yet; the 100th rebalances after its own pick:
    # w0 (3 groups) against w1 (none): the cheapest group moves; 2 groups against 1 is within 1.5x
    assert d.route(prompt(groups[0], blocks("x", 1)), both, ttft=0.5)[0] == "w0"
    after = []
    for g in range(3):
        d.advance(100.0 + g)
        after.append(d.route(prompt(groups[g], blocks(f"y{g}", 1)), both, ttft=0.5)[0])
    assert sorted(after) == ["w0", "w0", "w1"]
    assert p.routed == 103
