"""kv-aware with a request's latency objectives (docs/router.md, "Latency objectives"; issue 51).

Two workers whose step cost the policy has learned exactly (tests/support/step_cost.py): ``a`` holds the
prompt's prefix but has a queue (or many decoders), ``b`` holds nothing and is idle. Without objectives
``a`` wins on its score; a TTFT objective only ``b`` is predicted to meet sends the request to ``b``; a TPOT
objective does not move the pick (it counts in the refusal).
"""

from __future__ import annotations

import hashlib
import random

import pytest

from kvmesh.contract.types import Load
from kvmesh.router.core.policies.base import Candidate, Objectives, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.kv_aware import KvAwarePolicy
from tests.support.step_cost import linear_reports

BS = 16
COST = dict(step_s=0.002, prefill_token_s=40e-6, prefill_pair_s=0.0, decode_seq_s=50e-6, decode_context_token_s=0.0)
PROMPT = 4160
"""Tokens: 256 blocks of prefix ``a`` holds, 4 of the request's own."""


def learned(seed: int = 0, cost: dict[str, float] = COST, **kw) -> KvAwarePolicy:
    p = KvAwarePolicy(PolicyConfig(seed=seed, **kw))
    for s, w in enumerate(("a", "b", "c", "d")):
        for load in linear_reports(cost, 12, s):
            p.cost.observe(w, load)
    assert p.cost.learned
    return p


def query(objectives: Objectives = Objectives(), prompt: int = PROMPT, tag: str = "p") -> RouteQuery:
    chain = [hashlib.sha256(f"{tag}{i}".encode()).digest()[:16] for i in range(prompt // BS)]
    return RouteQuery(prompt, BS, chain, True, 64, objectives)


def cand(wid: str, matched: int = 0, queued: int = 0, running: int = 0) -> Candidate:
    return Candidate(wid, f"{wid}:1", matched, Load(max_num_batched_tokens=8192, queued_prefill_tokens=queued,
                                                      num_running=running))


QUEUED = [cand("a", matched=256, queued=5000), cand("b")]
"""a: TTFT 40 us x (5,000 + 64) + 1 step = 0.2046 s, score + its own 64-token prefill ~0.207 s;
b: TTFT 40 us x 4,160 + 1 step = 0.1684 s, score + the same again as work ~0.337 s."""
DECODING = [cand("a", matched=256, running=60), cand("b")]
"""a: TPOT 2 ms + 61 x 50 us = 5.05 ms; b: 2 ms + 50 us = 2.05 ms; a's score is still the better."""


def test_predictions_are_the_step_cost_model_in_seconds():
    (ta, da), (tb, db) = learned().predictions(query(), QUEUED)
    assert ta == pytest.approx(40e-6 * 5064 + 0.002, rel=1e-6) and tb == pytest.approx(40e-6 * 4160 + 0.002, rel=1e-6)
    assert (da, db) == (pytest.approx(0.00205, rel=1e-6), pytest.approx(0.00205, rel=1e-6))
    (_, da), (_, db) = learned().predictions(query(), DECODING)
    assert (da, db) == (pytest.approx(0.00505, rel=1e-6), pytest.approx(0.00205, rel=1e-6))


def test_unlearned_policy_predicts_no_seconds_and_judges_no_objective():
    p = KvAwarePolicy(PolicyConfig(seed=0))
    q = query(Objectives(ttft_s=1e-6))
    assert p.predictions(q, QUEUED) is None
    assert p.objective_miss(q, QUEUED) is None and p.meets_objectives(q, QUEUED)
    assert p.pick(q, QUEUED).worker_id == p.pick(query(), QUEUED).worker_id == "a"


def test_a_candidate_missing_the_ttft_loses_to_one_that_meets_it_despite_its_better_score():
    assert learned().pick(query(), QUEUED).worker_id == "a"
    d = learned().pick(query(Objectives(ttft_s=0.19)), QUEUED)
    assert (d.worker_id, d.reason) == ("b", "load")
    assert d.score == learned().pick(query(), [QUEUED[1]]).score  # the meeting candidate's own score, unshifted
    # both meet it: the score decides as without objectives
    assert learned().pick(query(Objectives(ttft_s=0.3)), QUEUED).worker_id == "a"


def test_fallbacks_rank_every_meeting_candidate_before_the_misses():
    p = learned()
    cands = [cand("a", matched=256, queued=5000), cand("c", matched=256, queued=6000), cand("b"), cand("d")]
    q = query(Objectives(ttft_s=0.19))
    assert p.pick(q, cands).worker_id in ("b", "d")
    assert set(p.fallbacks(q, cands, 2)) == {"b", "d"}
    assert p.fallbacks(q, cands, 4)[2:] == ["a", "c"]


def test_the_tpot_objective_does_not_rank_the_candidates():
    # a is predicted to miss a 4 ms TPOT (60 decoders), b to meet it; the score still picks a: ranking by the
    # one-step TPOT prediction lost goodput where later prefills set the TPOT (kv_aware.KvAwarePolicy._meets)
    assert learned().pick(query(), DECODING).worker_id == "a"
    assert learned().pick(query(Objectives(tpot_s=0.004)), DECODING).worker_id == "a"
    # with a TTFT objective beside it, the TTFT alone ranks: both meet 1 s, so the score decides again
    assert learned().pick(query(Objectives(ttft_s=1.0, tpot_s=0.004)), DECODING).worker_id == "a"
    # ... and the refusal still judges the TPOT: no worker meets 1 ms
    assert learned().objective_miss(query(Objectives(tpot_s=0.001)), DECODING).objective == "tpot"
    # the TPOT counts the request's own prompt as context where the step cost reads context
    p = learned(cost=dict(COST, decode_context_token_s=1e-6))
    (_, tpot), = p.predictions(query(), [cand("a")])
    assert tpot == pytest.approx(0.00205 + 1e-6 * PROMPT, rel=1e-6)


def test_when_no_candidate_meets_them_the_score_decides_and_the_miss_is_named():
    p = learned()
    q = query(Objectives(ttft_s=0.1))
    assert p.pick(q, QUEUED).worker_id == "a"
    miss = p.objective_miss(q, QUEUED)
    assert miss is not None and (miss.objective, miss.target_s) == ("ttft", 0.1)
    assert miss.best_s == pytest.approx(40e-6 * 4160 + 0.002, rel=1e-6)  # b's, the least
    assert str(miss) == "no worker is predicted to meet the request's TTFT objective of 100 ms (the best predicted is 168 ms)"
    assert not p.meets_objectives(q, QUEUED)
    miss = p.objective_miss(query(Objectives(tpot_s=0.001)), DECODING)
    assert miss is not None and miss.objective == "tpot" and miss.best_s == pytest.approx(0.00205, rel=1e-6)


def test_objectives_met_apart_but_never_together_name_the_ttft_where_the_tpot_is_met():
    # a meets the TTFT (its prefix) but not the TPOT (60 decoders); b the TPOT but not the TTFT
    cands = [cand("a", matched=256, running=60), cand("b", queued=4000)]
    p = learned()
    q = query(Objectives(ttft_s=0.05, tpot_s=0.004))
    miss = p.objective_miss(q, cands)
    assert miss is not None and miss.objective == "ttft"
    assert miss.best_s == pytest.approx(40e-6 * 8160 + 0.002, rel=1e-6)  # b's: 8,160 tokens in one step
    assert p.meets_objectives(query(Objectives(ttft_s=0.05)), cands)
    assert p.meets_objectives(query(Objectives(tpot_s=0.004)), cands)


def test_no_objectives_and_objectives_every_candidate_meets_pick_alike():
    """A seeded stream of requests over four workers with random holdings and queues: without objectives, with
    objectives no candidate misses, and before anything is learned, the picks and scores are the same."""
    for temperature in (0.0, 0.5):
        plain, loose = learned(3, temperature=temperature), learned(3, temperature=temperature)
        rng = random.Random(5)
        for n in range(300):
            cands = [cand(w, matched=rng.choice((0, 0, 64, 200, 256)), queued=rng.choice((0, 0, 512, 4096)),
                          running=rng.randint(0, 8)) for w in ("a", "b", "c", "d")]
            tag = f"t{rng.randint(0, 5)}"
            a = plain.pick(query(tag=tag), cands)
            b = loose.pick(query(Objectives(ttft_s=3600.0, tpot_s=3600.0), tag=tag), cands)
            assert a == b, n
            assert plain.fallbacks(query(tag=tag), cands, 3) == loose.fallbacks(
                query(Objectives(ttft_s=3600.0), tag=tag), cands, 3)


def test_meets_objectives_defaults_to_true_on_policies_without_predictions():
    from kvmesh.router.core.policies import make_policy

    q = query(Objectives(ttft_s=1e-9))
    p = make_policy("round-robin", PolicyConfig(seed=0))
    assert p.objective_miss(q, QUEUED) is None and p.meets_objectives(q, QUEUED)
