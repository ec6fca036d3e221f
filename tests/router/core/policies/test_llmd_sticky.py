"""llm-d's sticky-until-saturated peer (router/core/policies/llmd_sticky.py): the affinity filter keeps a
cache-warm worker until its in-flight uncached tokens lead the best cold worker's by more than τ, then the
token-load (or active-request) scorer picks; the in-flight counts are the policy's own, released at the first
chunk."""

from __future__ import annotations

import hashlib

import pytest

from kvmesh.model_worker.simulated.step_time import Roofline
from kvmesh.router.core.inflight import Ticket
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.llmd_sticky import LlmdStickyPolicy

BS = 16
PROMPT = 1024  # 64 blocks
TAU = 18_975 * 18  # tokens: R_peak x 18 s = 341,550


def query(prompt_len: int = PROMPT) -> RouteQuery:
    chain = [hashlib.sha256(f"b{i}".encode()).digest()[:16] for i in range(prompt_len // BS)]
    return RouteQuery(prompt_len, BS, chain, True, 100)


def cand(wid: str, indexed: int = 0, matched: int = 0) -> Candidate:
    return Candidate(wid, f"{wid}:1", matched, indexed_blocks=indexed)


class Loaded:
    """A policy with in-flight uncached tokens put on workers through the router's own hooks."""

    def __init__(self, name: str = "llm-d-sticky") -> None:
        self.p = make_policy(name, PolicyConfig(seed=0))
        self.serial = 0

    def send(self, wid: str, tokens: int, prefilled: bool = False) -> Ticket:
        self.serial += 1
        t = Ticket(wid, tokens, serial=self.serial)
        self.p.started(t, query(tokens), cand(wid))  # a cold prompt of `tokens` tokens: all uncached
        if prefilled:
            self.p.prefilled(t)
        return t


def test_tau_is_the_simulators_peak_prefill_throughput_times_the_filters_default_penalty():
    chunk = 8192
    r_peak = chunk / Roofline().step_time([(0, chunk)], [])
    assert LlmdStickyPolicy.peak_prefill_throughput == pytest.approx(r_peak, abs=1.0)
    assert LlmdStickyPolicy.max_ttft_penalty_ms == 18_000
    assert LlmdStickyPolicy(PolicyConfig()).saturation_tokens == pytest.approx(TAU)


def test_sticks_to_the_cache_warm_worker_while_its_lead_is_under_tau():
    s = Loaded()
    s.send("warm", 300_000)  # a lead of 300k tokens (15.8 s at R_peak) over the idle cold workers
    cands = [cand("warm", indexed=64), cand("cold"), cand("half", indexed=51)]  # hits 1.0, 0, 0.797
    d = s.p.pick(query(), cands)
    assert (d.worker_id, d.reason, d.score) == ("warm", "prefix", 300_000)
    # two sticky workers: the less loaded one wins
    s.send("edge", 1_000)
    d = s.p.pick(query(), [*cands, cand("edge", indexed=52)])  # 52/64 = 0.8125
    assert (d.worker_id, d.reason, d.score) == ("edge", "prefix", 1_000 + 1024 - 52 * BS)


def test_a_hit_of_exactly_the_threshold_is_sticky():
    s = Loaded()
    s.send("warm", 5_000)
    q = query(1280)  # 80 blocks: 64 of them is 0.8
    assert s.p.pick(q, [cand("warm", indexed=64), cand("cold")]).worker_id == "warm"
    assert s.p.pick(q, [cand("warm", indexed=63), cand("cold")]).worker_id == "cold"


def test_spills_when_the_warm_workers_lead_passes_tau():
    s = Loaded()
    s.send("warm", TAU + 1_000)
    cands = [cand("warm", indexed=64), cand("cold"), cand("busy")]
    s.send("busy", 500)
    d = s.p.pick(query(), cands)
    assert (d.worker_id, d.reason, d.score) == ("cold", "balance", 1024)
    # the gate is the lead over the best cold worker, not the warm worker's own count
    for w in ("cold", "busy"):
        s.send(w, 200_000)
    d = s.p.pick(query(), cands)
    assert (d.worker_id, d.reason) == ("warm", "prefix")


def test_the_first_chunk_releases_the_tokens_and_stickiness_returns():
    s = Loaded()
    t = s.send("warm", TAU + 1_000)
    cands = [cand("warm", indexed=64), cand("cold")]
    assert s.p.pick(query(), cands).worker_id == "cold"
    s.p.prefilled(t)
    assert (s.p.inflight_tokens("warm"), s.p.inflight_requests("warm")) == (0, 1)
    assert (s.p.pick(query(), cands).worker_id, s.p.pick(query(), cands).reason) == ("warm", "prefix")
    s.p.finished(t, 10)
    s.p.finished(t, 10)  # once only
    assert (s.p.inflight_tokens("warm"), s.p.inflight_requests("warm")) == (0, 0)


def test_token_load_order_is_in_flight_plus_the_uncached_part_of_the_prompt():
    s = Loaded()
    s.send("c", 700)
    # none sticky (hits 0.625, 0, 0.5): load = in flight + 1024 - indexed * 16
    cands = [cand("b"), cand("c", indexed=32), cand("a", indexed=40)]  # a 384, b 1024, c 700 + 512 = 1212
    d = s.p.pick(query(), cands)
    assert (d.worker_id, d.reason, d.score) == ("a", "load", 384)
    assert s.p.fallbacks(query(), cands, 3) == ["a", "b", "c"]
    # the index's answer, not a speculative match, is the hit rate
    assert s.p.pick(query(), [cand("b", matched=64), cand("a", indexed=40)]).worker_id == "a"


def test_started_counts_the_uncached_tokens_at_the_chosen_workers_match():
    p = make_policy("llm-d-sticky", PolicyConfig(seed=0))
    p.started(Ticket("w", 0, serial=1), query(), cand("w", indexed=60))
    assert p.inflight_tokens("w") == PROMPT - 60 * BS


def test_decode_variant_scores_active_requests_after_the_same_filter():
    s = Loaded("llm-d-sticky-decode")
    for _ in range(3):
        s.send("x", 10, prefilled=True)  # 3 requests decoding, no tokens in flight
    s.send("y", 5_000)  # 1 request, 5k tokens
    cands = [cand("x"), cand("y"), cand("z", indexed=10)]
    s.send("z", 1)
    s.send("z", 1)
    d = s.p.pick(query(), cands)
    assert (d.worker_id, d.reason, d.score) == ("y", "load", 1)
    # a sticky worker stays the pick while under tau, however many requests it runs
    d = s.p.pick(query(), [cand("x", indexed=64), cand("y"), cand("w")])
    assert (d.worker_id, d.reason) == ("x", "prefix")
    s.send("x", TAU + 6_000)
    d = s.p.pick(query(), [cand("x", indexed=64), cand("y"), cand("w")])
    assert (d.worker_id, d.reason, d.score) == ("w", "balance", 0)
