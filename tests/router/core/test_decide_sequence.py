"""router/core/decide.py: the steps every front takes, in order, and what they guarantee on their own."""

from __future__ import annotations

import pytest

from kvmesh.contract.index_protocol import Pending, ReservationAnswer, WorkerMatch
from kvmesh.contract.kv_transfer import DECODE, PREFILL
from kvmesh.contract.types import Load, ModelSpec
from kvmesh.router.core.decide import DecideSequence, Fleet, NoWorker
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import WorkerEndpoint

SPEC = ModelSpec("m", 4, "sha256_128")
PROMPT = list(range(1, 33))
ROLES = {"p": PREFILL, "d1": DECODE, "d2": DECODE}
EPS = [WorkerEndpoint(w, f"{w}:1", role=r) for w, r in ROLES.items()]
IDLE, BUSY = Load(num_free_blocks=100, num_total_blocks=100), Load(num_running=8, num_waiting=4,
                                                                    queued_prefill_tokens=4000,
                                                                    num_free_blocks=100, num_total_blocks=100)


def core() -> RoutingCore:
    return RoutingCore(make_policy("kv-aware", PolicyConfig(seed=0)), shared_view=True, fold_reserve=True,
                       clock=lambda: 0.0)


def answer(**matched: int) -> list[WorkerMatch]:
    # NOTE: the prefill worker is idle and holds the prompt: a pick among every worker would take it
    return [WorkerMatch(w, f"{w}:1", matched.get(w, 0), IDLE if w == "p" else BUSY, pending=Pending(0, 0, 0, 1))
            for w in ROLES]


def run(c: RoutingCore, rid: str, fleet: Fleet | None, matched: dict[str, int]) -> DecideSequence:
    seq = DecideSequence(c, SPEC, PROMPT, EPS, request_id=rid, fleet=fleet)
    call = seq.lookup()
    assert call is not None
    seq.answered(answer(**matched), 0.0, reserved=call.folded is not None)
    seq.pick()
    while seq.reservation() is not None:
        seq.reserved(ReservationAnswer(True))
    seq.commit()
    return seq


def test_the_tentative_pick_is_among_the_workers_that_decode():
    c = core()
    run(c, "r1", Fleet(ROLES), {"p": 8})  # the answer the next tentative pick is made on
    seq = DecideSequence(c, SPEC, PROMPT, EPS, request_id="r2", fleet=Fleet(ROLES))
    call = seq.lookup()
    assert call is not None and call.folded is not None
    assert call.folded.worker_id in ("d1", "d2")


def test_without_roles_the_same_view_picks_the_idle_holder():
    # the test above would pass with no role split at all if the idle holder were never picked: it is
    c = core()
    run(c, "r1", None, {"p": 8})
    seq = DecideSequence(c, SPEC, PROMPT, EPS, request_id="r2")
    call = seq.lookup()
    assert call is not None and call.folded is not None and call.folded.worker_id == "p"


def test_a_fleet_of_prefill_workers_only_has_no_decode_worker():
    c = core()
    seq = DecideSequence(c, SPEC, PROMPT, EPS[:1], request_id="r1", fleet=Fleet({"p": PREFILL, "d1": DECODE}))
    seq.lookup()
    with pytest.raises(NoWorker) as e:
        seq.answered([WorkerMatch("p", "p:1", 0, IDLE)])
    assert e.value.kind == "decode"


def test_a_gateway_subset_that_leaves_no_worker_is_refused():
    seq = DecideSequence(core(), SPEC, PROMPT, EPS[1:], only=lambda w, _a: w == "gone")
    seq.lookup()
    with pytest.raises(NoWorker) as e:
        seq.answered(answer())
    assert e.value.kind == "subset"


def test_the_decision_of_a_fleet_with_roles_names_its_prefill_worker_only_from_the_prefill_candidates():
    seen = []

    class Decider:
        def decide(self, q, decode, prefills, decodes=()):
            seen.append((decode.worker_id, [c.worker_id for c in prefills], [c.worker_id for c in decodes]))
            from kvmesh.router.core.pd import PDDecision
            return PDDecision(prefills[0].worker_id, "disaggregated", q.prompt_len)

    c = core()
    seq = DecideSequence(c, SPEC, PROMPT, EPS, request_id="r1", fleet=Fleet(ROLES), decider=Decider())
    seq.lookup()
    seq.answered(answer(p=8))
    seq.pick()
    while seq.reservation() is not None:
        seq.reserved(ReservationAnswer(True))
    d = seq.commit()
    assert d.pd is not None and d.pd.prefill_worker == "p"
    assert d.decision.worker_id in ("d1", "d2")
    assert seen == [(d.decision.worker_id, ["p"], ["d1", "d2"])]


def test_a_folded_reservation_is_released_after_a_lookup_that_failed_after_it_may_have_landed():
    """Catches the folded reservation never released (issue 50): the Lookup carrying r2's tentative pick timed
    out while the index answered another call (late: the reservation may have been made), and the pick moved
    (the guessed worker failed meanwhile). The pick's Reserve, made blind, drops the guess where it may be."""
    from kvmesh.contract.index_protocol import IndexUnavailable

    t = [0.0]
    c = RoutingCore(make_policy("kv-aware", PolicyConfig(seed=0)), shared_view=True, fold_reserve=True,
                    clock=lambda: t[0])
    run(c, "r1", None, {})  # the answer the tentative pick is made on
    failed: set[str] = set()
    seq = DecideSequence(c, SPEC, PROMPT, EPS, request_id="r2", healthy=lambda w: w not in failed)
    t[0] = 1.0
    call = seq.lookup()
    assert call is not None and call.folded is not None
    t[0] = 2.0
    c.lookup_succeeded(0.001)  # another request's Lookup answered meanwhile
    t[0] = 3.0
    failed.add(call.folded.worker_id)
    seq.answered(IndexUnavailable("DEADLINE_EXCEEDED"), 2.0)
    assert seq.pick().worker_id != call.folded.worker_id
    r = seq.reservation()
    assert r is not None and r.seen_version is None
    assert r.release_worker_id == call.folded.worker_id
