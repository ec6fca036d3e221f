"""Async scheduling: step n+1 is planned and launched before step n's tokens are committed, and
every output is what the engine gives without it (and what transformers gives).

On the CPU the runner's ``launch`` returns after the step ran (a CPU forward pass is synchronous),
but the engine's order is the GPU's: schedule n+1 with n's samples as placeholders, launch n+1
(its placeholder input ids read from n's sampled ids on the device), then commit n. The padded
decode path runs without capture here (``decode_graphs(capture=False)``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.config import EngineConfig
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.output import RequestOutput
from kvmesh.model_worker.scheduling.request import Request, RequestStatus
from kvmesh.model_worker.scheduling.scheduler import Scheduler
from tests.support.model_worker import EXACT, hf_greedy, random_prompt


def make_engine(model_dir: Path, async_scheduling: bool, graphs: bool = False, **kwargs) -> LLMEngine:
    kwargs = {"num_blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 64, **EXACT, **kwargs}
    engine = LLMEngine(model=str(model_dir), async_scheduling=async_scheduling, **kwargs)
    assert engine.async_scheduling is async_scheduling
    if graphs:
        engine.runner.graphs = engine.runner.decode_graphs(capture=False)
    return engine


class Run:
    """Drives an engine to the end; records tokens, finishes, and that nothing comes after a finish."""

    def __init__(self, engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        self.finish: dict[str, str | None] = {}
        self.steps = 0
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)

    def on_output(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.request_id not in self.finish, "output after the finish"
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                self.finish[out.request_id] = out.finish_reason
                assert self.engine.kv_cache_manager.get_block_ids(out.request_id) == []

    def drain(self, each_step=None) -> Run:
        while self.engine.has_unfinished_requests():
            self.engine.step(on_output=self.on_output)
            self.steps += 1
            if each_step is not None:
                each_step(self)
        kv = self.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks - 1, "blocks leaked"
        assert self.engine._in_flight is None
        return self


def eos_model(src: Path, dst: Path, eos: int) -> Path:
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((dst / name).read_text())
        cfg["eos_token_id"] = eos
        (dst / name).write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded-decode"])
def test_stops_and_lengths_match_without_it_and_transformers(tiny_model_dir, tmp_path: Path, graphs: bool) -> None:
    src = tiny_model_dir("llama")
    prompts = [random_prompt(n, seed=500 + n) for n in (5, 18, 31, 9, 70)]
    free = Run(make_engine(src, False), {f"r{i}": (p, SamplingParams(max_tokens=20, ignore_eos=True))
                                         for i, p in enumerate(prompts)}).drain()
    def first_new(tokens: list[int], at_least: int) -> int:  # a token's first occurrence, from at_least on
        return next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])

    n_eos, n_stop = first_new(free.tokens["r1"], 5), first_new(free.tokens["r2"], 3)
    eos, stop = free.tokens["r1"][n_eos], free.tokens["r2"][n_stop]
    model_dir = eos_model(src, tmp_path / "eos", eos)
    requests = {
        "r0": (prompts[0], SamplingParams(max_tokens=13, ignore_eos=True)),  # length
        "r1": (prompts[1], SamplingParams(max_tokens=30)),  # EOS
        "r2": (prompts[2], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop])),
        "r3": (prompts[3], SamplingParams(max_tokens=1, ignore_eos=True)),  # its prefill's token only
        "r4": (prompts[4], SamplingParams(max_tokens=6, ignore_eos=True)),  # a prompt chunked over two steps
    }
    sync = Run(make_engine(model_dir, False, graphs), requests).drain()
    run = Run(make_engine(model_dir, True, graphs), requests).drain()
    assert run.tokens == sync.tokens
    assert run.finish == sync.finish == {"r0": "length", "r1": "stop", "r2": "stop", "r3": "length", "r4": "length"}
    assert [len(run.tokens[r]) for r in requests] == [13, n_eos + 1, n_stop + 1, 1, 6]
    for rid, (prompt, _) in requests.items():
        assert run.tokens[rid] == hf_greedy(model_dir, prompt, len(run.tokens[rid])), rid
    # The prefix cache ends the same: blocks are cached once their tokens are known.
    assert run.engine.cached_block_hashes() == sync.engine.cached_block_hashes()


def test_the_next_step_is_launched_before_the_last_one_is_committed(tiny_model_dir) -> None:
    """The order the GPU overlap needs: launch n+1 (with n's token as a placeholder, read on the
    device), then commit n; a request that stops by length is not scheduled past its last token."""
    model_dir = tiny_model_dir("llama")
    engine = make_engine(model_dir, True)
    order: list[str] = []
    placeholder_rows: list[int] = []
    launch, update = engine.runner.launch, engine.scheduler.update_from_output

    def spy_launch(out):
        rows = [s for s in out.scheduled if s.start >= s.request.num_tokens]
        placeholder_rows.append(len(rows))
        order.append(f"launch {len(out.scheduled)}")
        return launch(out)

    def spy_update(out, sampled):
        order.append("commit")
        return update(out, sampled)

    engine.runner.launch = spy_launch
    engine.scheduler.update_from_output = spy_update
    prompt = random_prompt(9, seed=3)
    run = Run(engine, {"a": (prompt, SamplingParams(max_tokens=4, ignore_eos=True))}).drain()
    assert run.tokens["a"] == hf_greedy(model_dir, prompt, 4)
    # prefill (samples token 1), then decodes of tokens 2, 3, 4 each launched before the step
    # before is committed; token 4 is the last by length: nothing is launched after it.
    assert order == ["launch 1", "launch 1", "commit", "launch 1", "commit", "launch 1", "commit",
                     "launch 0", "commit"]
    assert placeholder_rows == [0, 1, 1, 1, 0]


def test_windows_stay_exact(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen2")
    prompts = [random_prompt(n, seed=n) for n in (4, 23, 11)]
    requests = {f"w{i}": (p, SamplingParams(max_tokens=9 + 4 * i, ignore_eos=True)) for i, p in enumerate(prompts)}
    windows: list[int] = []
    engine = make_engine(model_dir, True, num_scheduler_steps=4)
    execute_window = engine.runner.execute_window
    engine.runner.execute_window = lambda out, cb: (windows.append(out.num_steps), execute_window(out, cb))[1]
    run = Run(engine, requests).drain()
    assert windows and max(windows) == 4
    for rid, (prompt, params) in requests.items():
        assert run.tokens[rid] == hf_greedy(model_dir, prompt, params.max_tokens), rid


def test_abort_while_a_step_is_in_flight(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    requests = {"a": (random_prompt(7, seed=1), params), "b": (random_prompt(12, seed=2), params)}
    ref = Run(make_engine(model_dir, False), requests).drain()
    run = Run(make_engine(model_dir, True), requests)
    engine = run.engine
    freed: list[bool] = []

    def each_step(r: Run) -> None:
        if len(r.tokens["b"]) == 5 and "b" not in r.finish and not freed:
            assert engine._in_flight is not None  # b's 6th token is being computed
            assert engine.abort_request("b")
            freed.append(False)
        elif freed == [False]:
            freed[0] = engine.kv_cache_manager.get_block_ids("b") == []

    run.drain(each_step)
    assert run.tokens["a"] == ref.tokens["a"] and run.tokens["b"] == ref.tokens["b"][:5]
    assert run.finish == {"a": "length"} and freed == [True]  # an abort has no output (the stream ends it)


def test_preemption_stays_exact(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(40, seed=100 + i) for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    requests = {f"p{i}": (p, params) for i, p in enumerate(prompts)}
    engine = make_engine(model_dir, True, num_blocks=12, max_model_len=128)
    run = Run(engine, requests).drain()
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in zip(requests, prompts, strict=True):
        assert run.tokens[rid] == hf_greedy(model_dir, prompt, 40), rid


def test_seeded_sampling_equals_it_off(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen2")
    requests = {f"s{i}": (random_prompt(6 + i, seed=i), SamplingParams(
        max_tokens=8 + i, temperature=0.9, top_p=0.9, top_k=50, seed=40 + i, ignore_eos=True)) for i in range(3)}
    on = Run(make_engine(model_dir, True, graphs=True), requests).drain()
    assert on.tokens == Run(make_engine(model_dir, False), requests).drain().tokens


def test_the_default_is_on_for_cuda_and_off_for_the_cpu(tiny_model_dir) -> None:
    from kvmesh.model_worker.config import ModelConfig

    model_config = ModelConfig.from_dir(tiny_model_dir("llama"))
    for device, want in (("cpu", False), ("cuda", True)):
        config = EngineConfig(model="m", device=device)
        config.check(model_config)
        assert config.async_scheduling is want
    off = EngineConfig(model="m", device="cuda", async_scheduling=False)
    off.check(model_config)
    assert off.async_scheduling is False


# -- the scheduler alone --------------------------------------------------------------------------


def make_request(rid: str, n: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_placeholders_give_the_next_position_and_the_last_by_length_is_not_scheduled() -> None:
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(num_blocks=20, block_size=4))
    scheduler.add_request(make_request("a", 6, max_tokens=2))
    first = scheduler.schedule()
    assert [(s.start, s.num_new_tokens, s.sample) for s in first.scheduled] == [(0, 6, True)]
    scheduler.start_step(first)
    a = scheduler.requests["a"]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (6, 1)
    second = scheduler.schedule()  # before the first step's token is known
    assert [(s.start, s.num_new_tokens, s.sample) for s in second.scheduled] == [(6, 1, True)]
    scheduler.start_step(second)
    scheduler.update_from_output(first, {"a": [101]})
    assert (a.output_token_ids, a.num_output_placeholders) == ([101], 1)
    # The second step's token is a's last (max_tokens 2): nothing is scheduled after it.
    assert scheduler.schedule().is_empty
    [out] = scheduler.update_from_output(second, {"a": [102]})
    assert (out.finished, out.finish_reason, a.output_token_ids) == (True, "length", [101, 102])


def test_a_request_preempted_in_flight_keeps_its_token_and_waits_for_it() -> None:
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(num_blocks=20, block_size=4))
    scheduler.add_request(make_request("a", 5, max_tokens=9))
    step = scheduler.schedule()
    scheduler.start_step(step)
    a = scheduler.requests["a"]
    scheduler.running.remove(a)
    scheduler._preempt(a)  # as the next schedule() would under pressure
    assert scheduler.schedule().is_empty  # its token is not known yet: it is not admitted
    scheduler.update_from_output(step, {"a": [77]})
    assert (a.status, a.output_token_ids, a.num_output_placeholders) == (RequestStatus.PREEMPTED, [77], 0)
    again = scheduler.schedule()  # recomputes all 6 known tokens and samples the 7th
    assert [(s.start, s.num_new_tokens, s.sample) for s in again.scheduled] == [(0, 6, True)]
