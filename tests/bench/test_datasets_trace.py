"""Dataset generators, Poisson arrivals and Mooncake trace synthesis: exact lengths and sharing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvmesh.bench.datasets import (
    TokenRange,
    multi_turn_dataset,
    poisson_arrivals,
    prefix_repetition_dataset,
    random_dataset,
)
from kvmesh.bench.trace import TraceSynthesizer
from kvmesh.replay.trace import TraceRecord, load_trace


def test_random_dataset_lengths_and_shared_prefix():
    reqs = random_dataset(5, input_len=40, output_len=7, prefix_len=16, seed=1, tokens=TokenRange(2, 100))
    assert [len(r.prompt_token_ids) for r in reqs] == [56] * 5
    assert all(r.output_len == 7 for r in reqs)
    assert all(r.prompt_token_ids[:16] == reqs[0].prompt_token_ids[:16] for r in reqs)
    assert reqs[0].prompt_token_ids[16:] != reqs[1].prompt_token_ids[16:]
    assert all(2 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    assert random_dataset(5, 40, 7, 16, seed=1, tokens=TokenRange(2, 100))[3].prompt_token_ids == \
        reqs[3].prompt_token_ids


def test_prefix_repetition_uses_each_prefix_equally():
    reqs = prefix_repetition_dataset(12, prefix_len=32, suffix_len=8, num_prefixes=3, output_len=4, seed=0)
    assert [len(r.prompt_token_ids) for r in reqs] == [40] * 12
    prefixes = [tuple(r.prompt_token_ids[:32]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]


def test_multi_turn_turn_extends_previous_prompt():
    reqs = multi_turn_dataset(6, turns=3, system_len=10, user_len=5, output_len=4, seed=0)
    # two conversations, interleaved: 0,1 = turn 1; 2,3 = turn 2; 4,5 = turn 3
    assert [len(r.prompt_token_ids) for r in reqs] == [15, 15, 24, 24, 33, 33]
    for prev, nxt in ((0, 2), (2, 4), (1, 3), (3, 5)):
        p = reqs[prev].prompt_token_ids
        assert reqs[nxt].prompt_token_ids[: len(p)] == p


def test_poisson_arrivals_seeded_and_rate():
    a = poisson_arrivals(2000, request_rate=10.0, seed=3)
    assert a == poisson_arrivals(2000, request_rate=10.0, seed=3)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.1) < 0.01  # 1999 exponential gaps: std of the mean is 0.0022
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # Poisson: coefficient of variation 1
    bursty = np.diff(poisson_arrivals(2000, 10.0, burstiness=0.25, seed=3))
    assert bursty.std() / bursty.mean() > 1.7  # gamma shape k: CV = 1/sqrt(k) = 2
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def test_trace_equal_hash_ids_give_identical_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
             {"timestamp": 2500, "input_length": 600, "output_length": 1, "hash_ids": [7, 10]},
             {"timestamp": 4000, "input_length": 1024, "output_length": 3, "hash_ids": [11, 8]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    recs = load_trace(path)
    assert recs[1] == TraceRecord(2500, 600, 1, (7, 10))
    assert len(load_trace(path, max_requests=2)) == 2
    synth = TraceSynthesizer(seed=5, tokens=TokenRange(2, 660))
    a, b, c = (synth.prompt(r, i) for i, r in enumerate(recs))
    assert [len(a), len(b), len(c)] == [1100, 600, 1024]
    assert a[:512] == b[:512]  # hash id 7 at position 0 in both
    assert a[512:1024] == c[512:1024]  # hash id 8
    assert a[:512] != c[:512] and b[512:] != a[512:600]
    assert a[1024:] == synth.block(9)[:76].tolist()  # last block cut to input_length
    assert TraceSynthesizer(seed=5, tokens=TokenRange(2, 660)).prompt(recs[0]) == a  # fresh instance, same tokens
    assert TraceSynthesizer(seed=6, tokens=TokenRange(2, 660)).prompt(recs[0]) != a
    reqs = synth.requests(recs, speedup=2.0)
    assert [r.arrival_s for r in reqs] == [0.0, 1.25, 2.0]
    assert [r.output_len for r in reqs] == [5, 1, 3]


def test_trace_pads_missing_hash_ids_with_private_blocks():
    synth = TraceSynthesizer(seed=0)
    short = TraceRecord(0, 1000, 1, (3,))  # needs 2 blocks, has 1
    p0, p1 = synth.prompt(short, 0), synth.prompt(short, 1)
    assert len(p0) == 1000 and p0[:512] == p1[:512] and p0[512:] != p1[512:]
