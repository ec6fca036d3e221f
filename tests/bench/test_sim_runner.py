"""The cost model's formula and the simulated runner inside a real LLMEngine (no weights)."""

from __future__ import annotations

import pytest

from kvmesh.contract.types import SamplingParams
from kvmesh.make_model import ensure_default_model
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.simulated.sim_runner import SimRunner, sim_token_id
from kvmesh.model_worker.simulated.step_time import LinearCost


def test_cost_model_formula():
    c = LinearCost(step_overhead_s=0.01, prefill_token_s=0.001, attn_pair_s=1e-6, decode_seq_s=0.002,
                  decode_kv_token_s=1e-5)
    assert c.step_time([], []) == 0.0
    # prefill chunk of 4 new tokens after 10 cached: pairs = 4 * (10 + 2.5) = 50
    assert c.step_time([(10, 4)], []) == pytest.approx(0.01 + 0.004 + 50e-6)
    # two decodes at contexts 100 and 300
    assert c.step_time([], [100, 300]) == pytest.approx(0.01 + 0.004 + 400e-5)
    assert c.step_time([(0, 2)], [50]) == pytest.approx(0.01 + 0.002 + 3e-6 + 0.002 + 50e-5)


def test_default_cost_model_h100_ballpark():
    c = LinearCost()
    prefill_8k = c.step_time([(0, 8192)], [])
    assert 0.5 < prefill_8k < 0.6  # ~15k tok/s at 8k tokens
    itl = c.step_time([], [2048] * 32)
    assert 0.008 < itl < 0.012


def test_sim_token_avoids_eos():
    t = sim_token_id("r", 5, 4, set())
    assert sim_token_id("r", 5, 4, {t}) == (t + 1) % 4
    assert sim_token_id("r", 5, 4, set()) == t  # deterministic


def test_engine_with_sim_runner_serves_and_caches():
    made: list[SimRunner] = []

    def factory(cfg, mc):
        made.append(SimRunner(cfg, mc, LinearCost(), time_scale=0.0))
        return made[0]

    engine = LLMEngine(model=str(ensure_default_model()), num_blocks=64, max_model_len=512,
                       runner_factory=factory)
    assert engine.kv_cache_manager.num_blocks == 64
    prompt = list(range(2, 50))  # 48 tokens = 3 full blocks
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        done = [o for o in outs if o.finished]
        assert len(done) == 1 and sum(len(o.new_token_ids) for o in outs) == 3
    assert done[0].num_cached_tokens == 32  # b hits a's first two blocks (last token recomputed)
    s = made[0].snapshot()
    assert s.prefill_tokens == 48 + 16 and s.decode_tokens == 4  # 2 requests x 2 decode steps
    assert s.steps == 6 and s.busy_s > 0


def _run_sim(num_scheduler_steps: int) -> tuple[dict[str, list[int]], int, SimRunner]:
    made: list[SimRunner] = []

    def factory(cfg, mc):
        made.append(SimRunner(cfg, mc, LinearCost(), time_scale=0.0))
        return made[0]

    engine = LLMEngine(model=str(ensure_default_model()), num_blocks=64, max_model_len=512,
                       num_scheduler_steps=num_scheduler_steps, runner_factory=factory)
    for i, n in enumerate((9, 9, 5)):
        engine.add_request(f"r{i}", list(range(2 + i, 40 + i)), SamplingParams(max_tokens=n, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens, steps, made[0]


def test_sim_runner_multistep_window_matches_single_steps():
    one, one_steps, one_runner = _run_sim(1)
    win, win_steps, win_runner = _run_sim(4)
    assert win == one and [len(win[r]) for r in ("r0", "r1", "r2")] == [9, 9, 5]
    a, b = one_runner.snapshot(), win_runner.snapshot()
    # every inner step is costed like the one-step batch it replaces, but scheduled once per window
    assert (b.decode_tokens, b.prefill_tokens, b.steps) == (a.decode_tokens, a.prefill_tokens, a.steps)
    assert b.busy_s == pytest.approx(a.busy_s)
    assert win_steps < one_steps


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_engine_work_counters_explain_the_step_time_exactly(num_scheduler_steps):
    """The load's work counters are the cost model's features: busy time is linear in them."""
    engine_steps = []

    def factory(cfg, mc):
        engine_steps.append(SimRunner(cfg, mc, LinearCost(), time_scale=0.0))
        return engine_steps[0]

    engine = LLMEngine(model=str(ensure_default_model()), num_blocks=64, max_model_len=512,
                       num_scheduler_steps=num_scheduler_steps, max_num_batched_tokens=32, runner_factory=factory)
    for i, n in enumerate((9, 9, 5)):
        engine.add_request(f"r{i}", list(range(2 + i, 60 + i)), SamplingParams(max_tokens=n, ignore_eos=True))
    total = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        total += engine.last_step_s
    load = engine.stats().load
    c = LinearCost()
    explained = (c.step_overhead_s * load.steps + c.prefill_token_s * load.prefill_tokens
                 + c.attn_pair_s * load.prefill_pairs + c.decode_seq_s * load.decode_tokens
                 + c.decode_kv_token_s * load.decode_context_tokens)
    assert load.busy_s == pytest.approx(total) == pytest.approx(explained)
    assert load.busy_s == pytest.approx(engine_steps[0].snapshot().busy_s)
    assert (load.prefill_tokens, load.decode_tokens, load.max_num_batched_tokens) == (3 * 58, 9 + 9 + 5 - 3, 32)


def test_a_request_built_with_its_block_hashes_is_submitted_and_checked():
    # the simulator submits requests it built with its workload's block hashes (kvmesh/sim/mesh.py)
    engine = LLMEngine(model=str(ensure_default_model()), num_blocks=64, max_model_len=512,
                       runner_factory=lambda cfg, mc: SimRunner(cfg, mc, LinearCost(), time_scale=0.0))
    prompt = list(range(2, 50))
    hashes = engine.block_hasher.hash_prompt(prompt)
    engine.submit(Request("a", prompt, SamplingParams(max_tokens=1), block_hasher=engine.block_hasher,
                          block_hashes=hashes))
    with pytest.raises(ValueError, match="2 block hashes given for a prompt of 3 full blocks"):
        Request("b", prompt, SamplingParams(max_tokens=1), block_hasher=engine.block_hasher, block_hashes=hashes[:2])
    with pytest.raises(ValueError, match="leave room for 464 of max_model_len 512"):
        engine.submit(Request("c", prompt, SamplingParams(max_tokens=500), block_hasher=engine.block_hasher))
