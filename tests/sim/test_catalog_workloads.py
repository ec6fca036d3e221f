"""inference-perf's catalog workloads (kvmesh/sim/workload.py: code-generation, reasoning): the shapes its
configs give, checked on the generated requests."""

from __future__ import annotations

import numpy as np

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.sim.workload import (
    ANSWER_MARGIN,
    CODE_MESSAGE_BASE,
    CODE_REPLY_BASE,
    CODE_SHARED_SEGMENT,
    CODE_SYSTEM_BASE,
    REASONING_SHARED_SEGMENT,
    LengthDist,
    code_generation,
    make_workload,
    reasoning,
)


def _turn(seg_id: int) -> tuple[int, int]:
    """A code-generation message's (blueprint, turn)."""
    return divmod(seg_id - CODE_MESSAGE_BASE, 1000)


def test_code_generation_turns_are_two_to_twenty_and_every_blueprint_replays_all_of_them():
    w = code_generation(num_requests=3000, seed=0)
    seen: dict[int, set[int]] = {}
    for r in w.requests:
        b, k = _turn(r.segments[-1][0])
        seen.setdefault(b, set()).add(k)
    assert sorted(seen) == list(range(20))  # 20 conversation blueprints
    counts = [len(ks) for ks in seen.values()]
    for ks in seen.values():
        assert ks == set(range(len(ks)))  # turns 0..T-1, none skipped
    assert min(counts) >= 2 and max(counts) <= 20
    assert 4.0 <= float(np.mean(counts)) <= 9.0  # normal, mean 6, std 3.5, clipped to [2, 20]
    assert len(set(counts)) > 3  # drawn, not one fixed count


def test_code_generation_system_prompts_are_3k_shared_plus_15k_to_120k_own():
    w = code_generation(num_requests=2000, seed=1)
    own: dict[int, int] = {}
    for r in w.requests:
        (s0, n0), (s1, n1) = r.segments[:2]
        assert (s0, n0) == (CODE_SHARED_SEGMENT, 3008)  # 3,000 rounded up to whole 64-token blocks
        assert own.setdefault(s1 - CODE_SYSTEM_BASE, n1) == n1  # a blueprint keeps its system prompt
    assert all(15_000 <= n <= 120_000 and n % 64 == 0 for n in own.values())
    assert max(own.values()) - min(own.values()) > 40_000  # uniform over the range, not one length


def test_each_code_generation_turn_extends_the_previous_prompt_and_its_reply():
    w = code_generation(num_requests=1500, seed=2)
    earliest: dict[tuple, object] = {}
    for r in w.requests:
        earliest.setdefault(r.segments, r)
    extended = trimmed = 0
    for r in w.requests:
        assert r.prompt_len + r.output_len <= 131_072 - ANSWER_MARGIN
        b, k = _turn(r.segments[-1][0])
        history = r.segments[2:-1]
        if k == 0:
            assert history == ()
            continue
        if history and _turn(history[0][0]) == (b, 0):
            reply_id, reply_len = history[-1]
            c, j = divmod(reply_id - CODE_REPLY_BASE, 1000)
            assert c % 20 == b and j == k - 1
            prev = earliest[r.segments[:-2]]
            assert _turn(prev.segments[-1][0]) == (b, k - 1) and prev.arrival_s < r.arrival_s
            assert prev.output_len == reply_len  # the reply in the context is the answer asked for
            extended += 1
        else:  # the oldest turns were dropped: one more (<= 10,048 + 4,032 tokens) would not fit
            assert r.prompt_len + r.output_len > 131_072 - ANSWER_MARGIN - 10_048 - 4_032
            trimmed += 1
    assert extended > 500 and 0 < trimmed < extended


def test_code_generation_fits_a_smaller_model_by_dropping_the_oldest_turns():
    w = code_generation(num_requests=600, max_model_len=40_000,
                        system_len=LengthDist("uniform", 15_000, 30_000, 22_500), seed=3)
    assert all(r.prompt_len + r.output_len <= 40_000 - ANSWER_MARGIN for r in w.requests)
    assert any(r.segments[2][0] != CODE_MESSAGE_BASE + 1000 * _turn(r.segments[-1][0])[0] for r in w.requests)


def test_code_generation_shares_each_system_prompt_across_its_replays_in_the_block_chains():
    w = code_generation(num_requests=300, seed=0)
    chains = w.chains(BlockHasher("m", block_size=64))
    by_blueprint: dict[int, set[bytes]] = {}
    for r, ch in zip(w.requests, chains, strict=True):
        system_blocks = (r.segments[0][1] + r.segments[1][1]) // 64
        by_blueprint.setdefault(r.segments[1][0], set()).add(ch[system_blocks - 1])
    assert all(len(h) == 1 for h in by_blueprint.values())
    assert len({ch[3008 // 64 - 1] for ch in chains}) == 1  # the shared part: one chain for all


def test_reasoning_shares_one_250_token_prompt_and_answers_average_8k():
    w = reasoning(num_requests=3000, seed=0)
    assert {r.segments[0] for r in w.requests} == {(REASONING_SHARED_SEGMENT, 256)}
    questions = np.array([r.segments[1][1] for r in w.requests])
    out = np.array([r.output_len for r in w.requests])
    assert len({r.segments[1][0] for r in w.requests}) == 3000  # private questions
    assert questions.min() >= 100 and questions.max() <= 5000 and 850 <= questions.mean() <= 1150
    assert out.min() >= 500 and out.max() <= 32_000
    assert 7_300 <= out.mean() <= 8_300  # lognormal of mean 8,000, clipped at 32,000
    assert np.median(out) < out.mean()  # a long right tail
    prompts = [w.prompt(r) for r in w.requests[:5]]
    assert all(p[:256] == prompts[0][:256] for p in prompts) and prompts[0][256:300] != prompts[1][256:300]


def test_catalog_workloads_are_deterministic_under_the_seed_and_registered():
    for name in ("code-generation", "reasoning"):
        a, b, c = make_workload(name, 200, seed=5), make_workload(name, 200, seed=5), make_workload(name, 200, seed=6)
        assert a.name == name and len(a) == 200
        assert [(r.arrival_s, r.segments, r.output_len) for r in a.requests] == \
            [(r.arrival_s, r.segments, r.output_len) for r in b.requests]
        assert [r.segments for r in a.requests] != [r.segments for r in c.requests]
        assert all(x.arrival_s <= y.arrival_s for x, y in zip(a.requests, a.requests[1:], strict=False))
