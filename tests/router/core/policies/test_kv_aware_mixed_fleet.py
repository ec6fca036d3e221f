"""kv-aware on a fleet of mixed GPUs (issue 51): what a request costs the others is priced at the worker's pace.

A worker three times slower than another prefills the same prompt in three times the seconds. The request's
own time to first token is in the worker's seconds (that is its latency). What it costs the others (the delay
to the requests decoding beside it, the capacity its prefill takes from the mesh) is a share of that worker's
time: in the worker's seconds it would make every slow worker look three times as costly for the same prompt,
and kv-aware sent the long prompts to the fast workers until their queues missed the objective while the slow
ones idled (the mixed fleet's no-reuse: 0.915 of least-loaded). Priced at the fleet's mean pace (the worker's
seconds over its relative speed), a slow worker costs the others what a fast one does for the same work.
"""

from __future__ import annotations

from kvmesh.contract.types import Load
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.kv_aware import KvAwarePolicy
from tests.support.step_cost import linear_reports

BS = 16
FAST = dict(step_s=0.002, prefill_token_s=40e-6, prefill_pair_s=0.0, decode_seq_s=50e-6, decode_context_token_s=0.0)
SLOW = {k: 3 * v for k, v in FAST.items()}


def policy(fleet: dict[str, dict[str, float]]) -> KvAwarePolicy:
    p = KvAwarePolicy(PolicyConfig(seed=0))
    for seed, (w, cost) in enumerate(fleet.items()):
        for load in linear_reports(cost, 12, seed):
            p.cost.observe(w, load)
    assert p.cost.learned
    return p


def cand(w: str, queued: int, running: int) -> Candidate:
    return Candidate(w, f"{w}:1", 0, Load(num_running=running, max_num_batched_tokens=8192, num_total_blocks=10_000,
                                          num_free_blocks=10_000, queued_prefill_tokens=queued))


def test_a_slow_worker_with_the_sooner_first_token_and_fewer_decoders_takes_the_prompt():
    p = policy({"fast": FAST, "slow": SLOW})
    assert p.cost.relative_speed("slow") > 2 * p.cost.relative_speed("fast")
    q = RouteQuery(4000, BS, [bytes([i]) * 16 for i in range(250)], True, 64)
    fast, slow = cand("fast", queued=20_000, running=40), cand("slow", queued=0, running=20)
    (ttft_fast, _), (ttft_slow, _) = p.predictions(q, [fast, slow])
    assert ttft_slow < ttft_fast  # the slow worker's first token comes sooner, and it has half the decoders
    assert p.pick(q, [fast, slow]).worker_id == "slow"


def test_on_identical_workers_the_pace_changes_nothing(monkeypatch):
    """Identical GPUs read a pace of 1 give or take the fit's residual: within PACE_TOLERANCE it is 1 exactly."""
    p = policy({"a": FAST, "b": FAST})
    q = RouteQuery(4000, BS, [bytes([i]) * 16 for i in range(250)], True, 64)
    cands = [cand("a", queued=2000, running=30), cand("b", queued=0, running=40)]
    scores = p.scores(q, cands)
    monkeypatch.setattr(p.cost, "relative_speeds", lambda worker_ids: [1.0] * len(worker_ids))
    assert p.scores(q, cands) == scores
    monkeypatch.setattr(p.cost, "relative_speeds", lambda worker_ids: [1.03, 0.97][:len(worker_ids)])
    assert p.scores(q, cands) == scores
    monkeypatch.setattr(p.cost, "relative_speeds", lambda worker_ids: [1.5, 0.5][:len(worker_ids)])
    assert p.scores(q, cands) != scores
