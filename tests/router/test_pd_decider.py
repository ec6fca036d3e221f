"""The router's prefill/decode decision (router/core/pd.py), on known step costs: exact predictions, the reasons,
the learned threshold, the learned transfer link."""

from __future__ import annotations

import pytest

from kvmesh.contract.types import Load
from kvmesh.router.core.pd import PDConfig, PDDecider, TransferLink, disaggregated_fleet, split_roles
from kvmesh.router.core.policies.base import Candidate, RouteQuery
from kvmesh.router.core.policies.cost import StepCost

BS = 16
COST = StepCost(step_s=0.01, prefill_token_s=1e-4, prefill_pair_s=0.0, decode_seq_s=1e-4, decode_context_token_s=0.0,
                pairs_per_prefill_token=0.0)


class KnownCost:
    """A step-cost learner that has learned ``COST`` for every worker."""

    learned = True

    def estimate(self, worker_id=None):
        return COST

    def observe(self, worker_id, load):
        pass


def q(n: int) -> RouteQuery:
    return RouteQuery(prompt_len=n, block_size=BS, block_hashes=[b"h" * 16] * (n // BS))


def decider(**kw) -> PDDecider:
    return PDDecider(PDConfig(**kw), cost=KnownCost(), default_step_tokens=2048)  # type: ignore[arg-type]


def dec(running: int = 8, matched: int = 0) -> Candidate:
    return Candidate("d", "a", matched_blocks=matched, load=Load(num_running=running, max_num_batched_tokens=2048))


def pre(queued: int = 0, wid: str = "p") -> Candidate:
    return Candidate(wid, "a", load=Load(queued_prefill_tokens=queued, num_waiting=1 if queued else 0,
                                         max_num_batched_tokens=2048))


def test_predictions_are_kv_awares_in_seconds():
    # 4,096 tokens, nothing cached, 8 decoding at d: local = ttft + 8 * own; remote = prefill + tail
    local, remote, sent = decider().predict(q(4096), dec(), pre())
    per_step_d = 0.01 + 1e-4 * 8
    own = 1e-4 * 4096 + 2 * per_step_d
    assert local == pytest.approx(own + 8 * own)
    tail_own = 1e-4 * 16 + per_step_d  # the last block (its 16 tokens), one step
    assert remote == pytest.approx((1e-4 * 4096 + 2 * 0.01) + tail_own + 8 * tail_own)
    assert sent == 255


def test_the_reasons():
    d = decider()
    assert d.decide(q(4096), dec(), [pre()]).reason == "disaggregated"
    assert d.decide(q(4096), dec(), [pre()]).prefill_worker == "p"
    assert d.decide(q(4096), dec(running=0), [pre()]).reason == "short"  # nobody decodes there: nothing to protect
    assert d.decide(q(4096), dec(), [pre(queued=400_000)]).reason == "prefill_busy"
    assert d.decide(q(4096), dec(matched=255), [pre()]).reason == "cached"
    assert d.decide(q(4096), dec(), []).reason == "no_prefill_worker"
    assert decider(pd_mode="never").decide(q(4096), dec(), [pre()]).prefill_worker is None
    assert decider(pd_mode="always").decide(q(64), dec(running=0), [pre()]).prefill_worker == "p"
    # the least loaded prefill worker takes it
    assert d.decide(q(4096), dec(), [pre(queued=3000, wid="p1"), pre(wid="p2")]).prefill_worker == "p2"


def test_the_threshold_is_where_the_prediction_tips():
    d = decider()
    d.link.observe("d", 10, 0.05 + 10 * 0.002)
    d.link.observe("d", 100, 0.05 + 100 * 0.002)  # a fixed 50 ms per transfer + 2 ms per block
    t = d.threshold(q(8192), dec(), pre())
    assert 16 < t < 8192
    assert d.decide(q(t), dec(), [pre()]).reason == "disaggregated"
    assert d.decide(q(t - BS), dec(), [pre()]).reason == "short"


def test_the_cold_rule_until_costs_are_learned():
    d = PDDecider(PDConfig(pd_cold_min_tokens=1024))
    assert d.decide(q(1000), dec(), [pre()]).reason == "cold_short"
    assert d.decide(q(1040), dec(), [pre()]).reason == "disaggregated"


def test_the_link_fit_separates_fixed_and_per_block_costs():
    link = TransferLink()
    assert link.cost("d", 100) == 0.0
    for blocks in (4, 50, 250, 10):
        link.observe("d", blocks, 0.003 + 0.0004 * blocks)
    assert link.cost("d", 100) == pytest.approx(0.003 + 0.04)
    assert link.seconds_per_block("d") == pytest.approx(0.0004)
    assert link.cost("other", 100) == pytest.approx(0.043)  # the pooled fit answers for a worker without its own


def test_roles_split_the_candidates():
    cands = [Candidate(w, "a") for w in ("p", "d", "b")]
    decode, prefill = split_roles(cands, {"p": "prefill", "d": "decode", "b": "both"})
    assert [c.worker_id for c in decode] == ["d", "b"] and [c.worker_id for c in prefill] == ["p"]
    assert disaggregated_fleet(["prefill", "decode"]) and disaggregated_fleet(["prefill", "both"])
    assert not disaggregated_fleet(["both", "both"]) and not disaggregated_fleet(["prefill"])
