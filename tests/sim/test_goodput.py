"""Latency objectives in the simulator (kvmesh/sim/goodput.py): goodput counts only the requests that met both
objectives, every request carries the run's objectives to its router's policy, and a run without them has no
goodput keys."""

from __future__ import annotations

import pytest

from kvmesh.replay.records import RequestRecord
from kvmesh.router.core.policies.base import NO_OBJECTIVES, Objectives, RouterPolicy
from kvmesh.sim.config import SimConfig
from kvmesh.sim.goodput import goodput, meets, parse_objectives, workload_objectives
from kvmesh.sim.run import Sim
from kvmesh.sim.workload import make_workload

OBJ = Objectives(ttft_s=1.0, tpot_s=0.05)


def record(ttft: float | None, tpot: float | None = 0.02, tokens: int = 11, failed: str | None = None) -> RequestRecord:
    r = RequestRecord(0, 10.0, 100, tokens)
    if ttft is not None:
        r.first_token = 10.0 + ttft
        r.completion_tokens = tokens
        r.finish = r.first_token + (tpot or 0.0) * (tokens - 1)
    r.failed = failed
    return r


def test_a_request_counts_only_when_it_meets_both_objectives():
    assert meets(record(0.5, 0.02), OBJ)
    assert not meets(record(0.5, 0.08), OBJ)  # TTFT met, TPOT missed: not goodput
    assert not meets(record(1.5, 0.02), OBJ)  # TPOT met, TTFT missed
    assert not meets(record(None), OBJ)  # never got a token
    assert not meets(record(0.5, 0.02, failed="worker failed mid-stream"), OBJ)
    assert meets(record(0.5, None, tokens=1), OBJ)  # one token: no TPOT to miss
    assert meets(record(0.5, 0.08), Objectives(ttft_s=1.0))  # only TTFT asked


def test_goodput_is_the_rate_of_requests_meeting_both():
    recs = [record(0.5, 0.02), record(0.5, 0.08), record(1.5, 0.02), record(0.9, 0.049)]
    g = goodput(recs, OBJ, span_s=2.0)
    assert g["goodput_rps"] == pytest.approx(1.0)  # 2 of 4 met both, over 2 s
    assert g["request_rps"] == pytest.approx(2.0)
    assert g["objectives_met"] == pytest.approx(0.5)


def test_the_objectives_flag():
    assert parse_objectives("") == NO_OBJECTIVES
    assert parse_objectives("workload") is None
    assert parse_objectives("1500:40") == Objectives(1.5, 0.04)
    for bad in ("1500", "a:b", "0:0", "-1:5"):
        with pytest.raises(ValueError, match="--objectives"):
            parse_objectives(bad)
    with pytest.raises(ValueError, match="--objectives"):
        SimConfig(objectives="fast").check()


def test_a_workloads_own_ttft_is_twice_its_p90_cold_prefill_rounded_up_at_least_one_second():
    assert workload_objectives([100] * 10, lambda n: n / 1000) == Objectives(1.0, 0.05)
    assert workload_objectives(list(range(1, 11)) * 100, lambda n: n * 0.4) == Objectives(7.5, 0.05)  # p90 9 -> 7.2


def test_every_request_carries_the_runs_objectives_to_the_policy_and_goodput_is_reported(monkeypatch):
    seen: list[Objectives] = []
    original = RouterPolicy.started

    def started(self, ticket, query, chosen):
        seen.append(query.objectives)
        return original(self, ticket, query, chosen)

    monkeypatch.setattr(RouterPolicy, "started", started)
    w = make_workload("multi-turn", 40, seed=1)
    res = Sim(w, SimConfig(workers=2, objectives="800:60")).run("round-robin", 2.0)
    assert seen and set(seen) == {Objectives(0.8, 0.06)}
    assert res["objectives"] == {"ttft_s": 0.8, "tpot_s": 0.06}
    assert 0 < res["goodput_rps"] <= res["request_rps"]
    seen.clear()
    plain = Sim(w, SimConfig(workers=2)).run("round-robin", 2.0)
    assert set(seen) == {NO_OBJECTIVES}
    assert not {"objectives", "goodput_rps", "request_rps", "objectives_met"} & set(plain)
