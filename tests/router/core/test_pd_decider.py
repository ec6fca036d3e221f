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
    # 4,096 tokens, nothing cached, 8 decoding at d, 2 requests waiting per decode worker, none at the prefill
    # worker: local = ttft + (1 + 2) * own (the work) + 8 * own (the harm); remote = the prefill's ttft and work
    # + the tail's ttft, work and harm on d
    local, remote, sent = decider(pd_work_weight=1.0).predict(q(4096), dec(), pre(), backlog=(2.0, 0.0))
    per_step_d = 0.01 + 1e-4 * 8
    own = 1e-4 * 4096 + 2 * per_step_d
    assert local == pytest.approx(own + 3 * own + 8 * own)
    own_p = 1e-4 * 4096 + 2 * 0.01
    tail_own = 1e-4 * 16 + per_step_d  # the last block (its 16 tokens), one step
    assert remote == pytest.approx(own_p + own_p + tail_own + 3 * tail_own + 8 * tail_own)
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


def test_an_itl_target_counts_only_the_steps_beyond_it():
    # 1,024 uncached tokens: one step of ~0.11 s; 8,192: four steps of ~0.22 s each (budget 2,048)
    loose = decider(pd_itl_target=0.15)
    assert loose.decide(q(1024), dec(), [pre(queued=2000)]).prefill_worker is None  # under the target: no harm
    assert decider().decide(q(1024), dec(), [pre(queued=2000)]).prefill_worker == "p"  # every second counts
    assert loose.decide(q(8192), dec(), [pre()]).prefill_worker == "p"  # each step past the target harms 8 decoders
    local, _, _ = loose.predict(q(8192), dec(), pre())
    ttft_local, _, _ = decider(pd_harm_weight=0.0).predict(q(8192), dec(), pre())
    own_step = (1e-4 * 8192 + 4 * (0.01 + 1e-4 * 8)) / 4
    assert local - ttft_local == pytest.approx(8 * 4 * (own_step - 0.15))


def test_only_the_reusable_blocks_the_decode_worker_lacks_travel_and_are_priced():
    """Catches P/D pricing a transfer of blocks the decode worker already holds (issue 50: ``sent = reusable``):
    of 4,096 tokens' 255 reusable blocks, a decode worker holding 100 is sent 155, and the remote leg costs the
    link's price of those 155 (a fixed 50 ms per transfer + 2 ms per block) over the same split without a link."""
    linked = decider()
    linked.link.observe("d", 10, 0.05 + 10 * 0.002)
    linked.link.observe("d", 100, 0.05 + 100 * 0.002)
    _, remote, sent = linked.predict(q(4096), dec(matched=100), pre())
    _, unlinked, _ = decider().predict(q(4096), dec(matched=100), pre())
    assert sent == 155
    assert remote - unlinked == pytest.approx(0.05 + 155 * 0.002)
    assert linked.decide(q(4096), dec(matched=100), [pre()]).blocks_sent == 155
