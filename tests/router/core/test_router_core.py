"""router/core/routing.py: the decision part of the router on an injected clock (no threads, no grpc)."""

from __future__ import annotations

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.index_protocol import (
    IndexUnavailable,
    Pending,
    Reservation,
    ReservationAnswer,
    WorkerMatch,
    anchors_of,
)
from kvmesh.contract.types import Load, ModelSpec
from kvmesh.router.core.decide import plan_now
from kvmesh.router.core.observer import CountingObserver
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import WorkerEndpoint

SPEC = ModelSpec("m", 4, "sha256_128")
PROMPT = list(range(1, 33))  # 8 blocks of 4
CHAIN = BlockHasher("m", 4).hash_prompt(PROMPT)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Index:
    def __init__(self, matches: list[WorkerMatch] | None = None) -> None:
        self.matches = matches or []
        self.down = False
        self.calls = 0

    def lookup(self, model_id: str, chain) -> list[WorkerMatch]:
        self.calls += 1
        if self.down:
            raise IndexUnavailable("deadline exceeded")
        return self.matches


def core(policy: str = "kv-aware", ttl: float = 2.0) -> tuple[RoutingCore, Clock, CountingObserver]:
    clock, obs = Clock(), CountingObserver()
    return RoutingCore(make_policy(policy, PolicyConfig(seed=0)), speculative_ttl_s=ttl, index_retry_s=1.0,
                       clock=clock, observer=obs), clock, obs


EPS = [WorkerEndpoint("w1", "a:1"), WorkerEndpoint("w2", "a:2")]


def test_breaker_skips_the_index_for_retry_s_of_the_injected_clock():
    c, clock, obs = core(ttl=0)
    index = Index()
    index.down = True
    assert not plan_now(c, SPEC, PROMPT, EPS, index).query.index_ok
    index.down = False
    clock.t += 0.9
    assert not plan_now(c, SPEC, PROMPT, EPS, index).query.index_ok  # breaker open: not asked
    assert (index.calls, obs.fallbacks) == (1, {"lookup_failed": 1, "index_down": 1})
    clock.t += 0.2
    assert plan_now(c, SPEC, PROMPT, EPS, index).query.index_ok
    assert index.calls == 2 and obs.lookups == 1


def test_lookup_answer_sets_matches_and_fresher_load_and_adopts_new_workers_only_when_discovering():
    load = Load(num_running=3)
    index = Index([WorkerMatch("w2", "a:2", 5, load), WorkerMatch("w3", "a:3", 8, Load())])
    c, _, _ = core()
    plan = plan_now(c, SPEC, PROMPT, EPS, index, adopt=True)
    got = {x.worker_id: (x.matched_blocks, x.load.num_running) for x in plan.candidates}
    assert got == {"w1": (0, 0), "w2": (5, 3), "w3": (8, 0)}
    c, _, _ = core()
    plan = plan_now(c, SPEC, PROMPT, EPS, index, adopt=False)
    assert sorted(x.worker_id for x in plan.candidates) == ["w1", "w2"]


def test_pick_records_speculative_entries_that_expire_on_the_clock_and_counts_reasons():
    c, clock, obs = core()
    plan = plan_now(c, SPEC, PROMPT, EPS, Index())
    d = c.pick(plan)
    assert obs.decisions == {"load": 1}
    again = plan_now(c, SPEC, PROMPT, EPS, Index())
    assert again.candidate(d.worker_id).matched_blocks == 8
    clock.t += 2.5
    assert all(x.matched_blocks == 0 for x in plan_now(c, SPEC, PROMPT, EPS, Index()).candidates)


def test_inflight_accounting_charges_uncached_tokens_until_the_first_token():
    index = Index([WorkerMatch("w1", "a:1", 6, Load())])
    c, _, _ = core()
    plan = plan_now(c, SPEC, PROMPT, EPS, index)
    ticket = c.start(plan, "w1")
    assert c.inflight.view("w1") == (1, 32 - 6 * 4)
    c.prefilled(ticket)
    assert c.inflight.view("w1") == (1, 0)
    c.finish(ticket)
    c.finish(ticket)
    assert c.inflight.view("w1") == (0, 0)


def test_the_policy_hears_each_attempt_start_first_token_and_end_once_with_the_index_overlap():
    from kvmesh.router.core.policies.kv_aware import KvAwarePolicy

    class Recording(KvAwarePolicy):
        def __init__(self) -> None:
            super().__init__(PolicyConfig(seed=0))
            self.calls: list[tuple] = []

        def started(self, ticket, query, chosen):
            self.calls.append(("started", ticket.serial, chosen.worker_id, chosen.matched_blocks,
                               chosen.indexed_blocks, len(query.block_hashes)))

        def prefilled(self, ticket):
            self.calls.append(("prefilled", ticket.serial))

        def finished(self, ticket, output_tokens):
            self.calls.append(("finished", ticket.serial, output_tokens))

    policy = Recording()
    c = RoutingCore(policy, speculative_ttl_s=2.0, clock=Clock())
    index = Index([WorkerMatch("w1", "a:1", 3, Load())])
    c.pick(plan_now(c, SPEC, PROMPT, EPS, index))  # the speculative map now says w1 or w2 holds all 8 blocks
    plan = plan_now(c, SPEC, PROMPT, EPS, index)
    first = c.start(plan, "w1")
    c.prefilled(first)
    c.prefilled(first)
    c.finish(first, 7)
    c.finish(first, 7)
    retry = c.start(plan, "w2")
    c.finish(retry)  # failed before its first token
    w1 = plan.candidate("w1")
    assert policy.calls == [("started", first.serial, "w1", w1.matched_blocks, 3, 8), ("prefilled", first.serial),
                            ("finished", first.serial, 7), ("started", retry.serial, "w2",
                                                            plan.candidate("w2").matched_blocks, 0, 8),
                            ("finished", retry.serial, 0)]
    assert first.serial != retry.serial


def test_unhealthy_workers_are_skipped_unless_all_are():
    c, _, _ = core("round-robin")
    plan = plan_now(c, SPEC, PROMPT, EPS, None, healthy=lambda w: w != "w1")
    assert [x.worker_id for x in plan.candidates] == ["w2"]
    plan = plan_now(c, SPEC, PROMPT, EPS, None, healthy=lambda w: False)
    assert len(plan.candidates) == 2


# -- the shared router view ------------------------------------------------------------------------
def shared_core(policy: str = "kv-aware", attempts: int = 3) -> RoutingCore:
    return RoutingCore(make_policy(policy, PolicyConfig(seed=0)), speculative_ttl_s=2.0, clock=Clock(),
                       shared_view=True, router_id="ra", reservation_attempts=attempts)


def test_reservations_only_for_a_policy_that_reads_the_view_and_only_with_an_index_answer():
    answer = [WorkerMatch("w1", "a:1", 0, Load(), pending=Pending(1, 40, 10, 7)), WorkerMatch("w2", "a:2", 0, Load())]
    c = shared_core()
    plan = plan_now(c, SPEC, PROMPT, EPS, Index(answer))
    assert plan.versions == {"w1": 7, "w2": 0}
    assert plan.candidate("w1").pending == Pending(1, 40, 10, 7)
    down = Index(answer)
    down.down = True
    assert plan_now(c, SPEC, PROMPT, EPS, down).versions is None  # no answer: nothing to reserve against
    for other in (shared_core("round-robin"), shared_core("dynamo"),
                  RoutingCore(make_policy("kv-aware", PolicyConfig(seed=0)), shared_view=False)):
        p = plan_now(other, SPEC, PROMPT, EPS, Index(answer))
        assert p.versions is None and p.candidate("w1").pending == Pending()
        assert other.reservation(p, other.pick(p), "r1", 0) is None


def test_a_reservation_is_in_flight_at_once_and_a_refusal_moves_it_with_the_fresh_view():
    # w1 holds the prompt: the first pick; w2 is idle.
    answer = [WorkerMatch("w1", "a:1", 8, Load()), WorkerMatch("w2", "a:2", 0, Load())]
    c = shared_core()
    plan = plan_now(c, SPEC, PROMPT, EPS, Index(answer))
    first = c.pick(plan, count=False)
    assert first.worker_id == "w1"
    reservation = c.reservation(plan, first, "req-1", 0)
    assert reservation == Reservation("m", "w1", "ra", "req-1", 0, 8, 0, anchors_of(CHAIN))
    assert c.inflight.of("w1").requests == 1  # this router's next pick sees it while it is reserved
    # Another router got there first: w1 is now swamped by others' picks.
    again = c.reservation_answered(plan, ReservationAnswer(False, {"w1": Pending(40, 100_000, 400, 3), "w2": Pending(0, 0, 0, 1)}))
    assert again is not None and again.worker_id == "w2"
    assert plan.versions == {"w1": 3, "w2": 1}
    assert (c.inflight.of("w1").requests, c.inflight.of("w2").requests) == (0, 0)
    reservation2 = c.reservation(plan, again, "req-1", 1)
    assert reservation2 == Reservation("m", "w2", "ra", "req-1", 32, 8, 1, anchors_of(CHAIN))
    assert (c.inflight.of("w1").requests, c.inflight.of("w2").requests) == (0, 1)
    assert c.reservation_answered(plan, ReservationAnswer(True)) is None
    # The forwarded attempt takes over the reserved ticket (one request in flight, not two).
    assert c.start(plan, "w2") is plan.ticket and c.inflight.of("w2").requests == 1


def test_the_last_reservation_is_unconditional_and_then_there_is_none():
    c = shared_core(attempts=2)
    plan = plan_now(c, SPEC, PROMPT, EPS, Index([WorkerMatch("w1", "a:1", 8, Load(), pending=Pending(0, 0, 0, 5)),
                                            WorkerMatch("w2", "a:2", 0, Load())]))
    d = c.pick(plan, count=False)
    assert c.reservation(plan, d, "r", 0).seen_version == 5
    assert c.reservation(plan, d, "r", 1).seen_version is None
    assert c.reservation(plan, d, "r", 2) is None


def test_other_routers_picks_weigh_on_kv_aware_like_its_own():
    """The view's pending picks count as load: with equal matches, the worker others just picked loses."""
    busy = Pending(6, 6 * 4096, 6 * 64, 9)
    c = shared_core()
    plan = plan_now(c, SPEC, PROMPT, EPS, Index([WorkerMatch("w1", "a:1", 0, Load(), pending=busy),
                                            WorkerMatch("w2", "a:2", 0, Load())]))
    assert c.pick(plan).worker_id == "w2"
    plan = plan_now(c, SPEC, PROMPT, EPS, Index([WorkerMatch("w1", "a:1", 0, Load()),
                                            WorkerMatch("w2", "a:2", 0, Load(), pending=busy)]))
    assert c.pick(plan).worker_id == "w1"


def test_a_late_lookup_keeps_the_breaker_closed_and_its_blind_pick_is_reserved_unconditionally():
    """Issue 35: on a busy host a burst's Lookups pass their deadline while the kv_service answers the
    others. Such a Lookup is late, not failed: the breaker stays closed (the next request asks the
    index) and the pick made without it is reserved unconditionally, so the other routers see it.
    A Lookup that fails while nothing is answered opens the breaker, as before."""
    clock, obs = Clock(), CountingObserver()
    c = RoutingCore(make_policy("kv-aware", PolicyConfig(seed=0)), speculative_ttl_s=2.0, index_retry_s=1.0,
                    clock=clock, observer=obs, shared_view=True, router_id="ra", reservation_attempts=3)
    answer = [WorkerMatch("w1", "a:1", 0, Load()), WorkerMatch("w2", "a:2", 0, Load())]
    late = c.prepare(SPEC, PROMPT, True)  # asked; its answer will not come in time
    clock.t += 0.01
    plan_now(c, SPEC, PROMPT, EPS, Index(answer))  # another request's Lookup is answered meanwhile
    clock.t += 0.05
    plan = c.complete(late, EPS, IndexUnavailable("deadline exceeded"), adopt=True)
    assert not plan.query.index_ok and (plan.versions, plan.conditional) == ({}, False)
    pick = c.pick(plan, count=False)
    assert c.reservation(plan, pick, "req-late", 0).seen_version is None
    assert obs.fallbacks == {"lookup_late": 1} and not c.breaker.open()
    # Down: nothing was answered since it was asked.
    down = c.prepare(SPEC, PROMPT, True)
    clock.t += 0.05
    plan = c.complete(down, EPS, IndexUnavailable("deadline exceeded"), adopt=True)
    assert plan.versions is None and c.breaker.open()
    assert obs.fallbacks == {"lookup_late": 1, "lookup_failed": 1}



def test_another_routers_copy_of_the_prefix_counts_as_held_in_the_lookup_and_in_a_refusal():
    """The shared speculative view (issue 35): a worker another router reserved this prompt's prefix on is
    scored as holding it (as this router's own speculative map would say of its own picks) — from the
    Lookup's pending_blocks, and from a refused reservation's anchored count."""
    c = shared_core()
    plan = plan_now(c, SPEC, PROMPT, EPS, Index([WorkerMatch("w1", "a:1", 0, Load(), pending_blocks=4),
                                            WorkerMatch("w2", "a:2", 0, Load())]))
    assert [(x.worker_id, x.matched_blocks, x.indexed_blocks) for x in plan.candidates] == [("w1", 4, 0), ("w2", 0, 0)]
    c = shared_core()
    plan = plan_now(c, SPEC, PROMPT, EPS, Index([WorkerMatch("w1", "a:1", 2, Load()), WorkerMatch("w2", "a:2", 0, Load())]))
    first = c.pick(plan, count=False)
    assert first.worker_id == "w1"
    c.reservation(plan, first, "r", 0)
    # Refused: others swamped w1 meanwhile, and one of them reserved all 8 blocks of this prompt on w2.
    again = c.reservation_answered(plan, ReservationAnswer(False, {"w1": Pending(9, 9 * 32, 72, 4), "w2": Pending(1, 32, 8, 1)},
                                              {"w2": 4}))
    assert again is not None and again.worker_id == "w2" and plan.candidate("w2").matched_blocks == 8
