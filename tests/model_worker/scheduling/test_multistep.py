"""Multi-step decode: N decode steps per schedule() give the tokens, finishes, block events and
prefix cache of one-step decoding, with every token handed out by its own inner step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.output import RequestOutput
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.scheduling.scheduler import Scheduler
from tests.support.model_worker import EXACT, EXACT_CLI, KVMESH, hf_greedy, random_prompt

BS = 16


def make_engine(model_dir: Path, n: int, **kwargs) -> LLMEngine:
    kwargs = {"num_blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 256, **EXACT, **kwargs}
    return LLMEngine(model=str(model_dir), num_scheduler_steps=n, **kwargs)


class Run:
    """Drives an engine to the end, recording what every inner step handed out."""

    def __init__(self, engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        self.finish: dict[str, str | None] = {}
        self.inner_steps: list[list[RequestOutput]] = []
        self.num_steps = 0
        self.events: list = []
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)

    def on_output(self, outputs: list[RequestOutput]) -> None:
        self.inner_steps.append(outputs)
        for out in outputs:
            assert out.request_id not in self.finish, "output after the finish"
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                self.finish[out.request_id] = out.finish_reason
                # Finished mid-window: its blocks are back in the pool at once.
                assert self.engine.kv_cache_manager.get_block_ids(out.request_id) == []

    def drain(self) -> Run:
        while self.engine.has_unfinished_requests():
            before = len(self.inner_steps)
            returned = self.engine.step(on_output=self.on_output)
            self.num_steps += 1
            self.events.extend(self.engine.take_kv_events())
            assert returned == [o for outs in self.inner_steps[before:] for o in outs]
        kv = self.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks - 1, "blocks leaked"
        return self


def test_stops_mid_window_match_one_step_and_transformers(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("llama")
    prompts = [random_prompt(n, seed=300 + n) for n in (5, 18, 31, 9)]
    free = Run(make_engine(src, 1), {f"r{i}": (p, SamplingParams(max_tokens=30, ignore_eos=True))
                                     for i, p in enumerate(prompts)}).drain()
    eos, stop = free.tokens["r1"][11], free.tokens["r2"][5]
    assert eos not in free.tokens["r1"][:11] and stop not in free.tokens["r2"][:5]
    model_dir = tmp_path / "eos"
    shutil.copytree(src, model_dir)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model_dir / name).read_text())
        cfg["eos_token_id"] = eos
        (model_dir / name).write_text(json.dumps(cfg))
    # After the prefill step's token, windows of 8 cover tokens 2-9, 10-17, ...: every stop below
    # falls inside a window, and r3 (max_tokens 1) never decodes at all.
    requests = {
        "r0": (prompts[0], SamplingParams(max_tokens=13, ignore_eos=True)),  # length, 4th of window 2
        "r1": (prompts[1], SamplingParams(max_tokens=30)),  # EOS as its 12th token
        "r2": (prompts[2], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop])),  # 6th
        "r3": (prompts[3], SamplingParams(max_tokens=1, ignore_eos=True)),
    }
    one = Run(make_engine(model_dir, 1), requests).drain()
    multi = Run(make_engine(model_dir, 8), requests).drain()

    assert multi.tokens == one.tokens
    assert multi.finish == one.finish == {"r0": "length", "r1": "stop", "r2": "stop", "r3": "length"}
    assert [len(multi.tokens[r]) for r in ("r0", "r1", "r2", "r3")] == [13, 12, 6, 1]
    for rid, (prompt, _) in requests.items():
        n = len(multi.tokens[rid])
        assert multi.tokens[rid] == hf_greedy(model_dir, prompt, n), rid
    # One step for the prefills, then windows: 1 + ceil(12 / 8) scheduler calls, 13 inner steps,
    # each handing every live request exactly one token.
    assert (one.num_steps, multi.num_steps) == (13, 3)
    assert len(multi.inner_steps) == len(one.inner_steps) == 13
    assert all(len(o.new_token_ids) == 1 for outs in multi.inner_steps for o in outs)
    assert [[o.request_id for o in outs] for outs in multi.inner_steps] == [
        [o.request_id for o in outs] for outs in one.inner_steps
    ]
    # Prefix caching is exact: same block events in the same order, same cache at the end.
    assert multi.events == one.events and multi.events
    assert multi.engine.cached_block_hashes() == one.engine.cached_block_hashes()


def test_abort_mid_window_frees_at_once_and_leaves_the_others_exact(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    requests = {"a": (random_prompt(7, seed=1), params), "b": (random_prompt(12, seed=2), params)}
    ref = Run(make_engine(model_dir, 1), requests).drain()

    run = Run(make_engine(model_dir, 8), requests)
    engine = run.engine
    freed_after_abort: list[bool] = []
    record = run.on_output

    def on_output(outputs: list[RequestOutput]) -> None:
        record(outputs)
        if len(run.tokens["a"]) == 4 and "b" in engine.scheduler.requests:
            assert engine.abort_request("b")  # as the server thread would, mid-window
        elif len(run.tokens["a"]) == 5:
            freed_after_abort.append(engine.kv_cache_manager.get_block_ids("b") == [])

    run.on_output = on_output  # type: ignore[method-assign]
    run.drain()
    assert run.tokens == {"a": ref.tokens["a"], "b": ref.tokens["b"][:4]}
    assert freed_after_abort == [True]
    assert run.num_steps == 4  # prefill, then windows of tokens 2-9, 10-17, 18-20


def test_preemption_with_windows_stays_exact(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    # Four requests of 40 + 40 tokens want 20 blocks; 11 usable blocks force preemption, and
    # a window runs only when the pool also has every request's lookahead blocks.
    prompts = [random_prompt(40, seed=100 + i) for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    requests = {f"p{i}": (p, params) for i, p in enumerate(prompts)}
    engine = make_engine(model_dir, 8, num_blocks=12, max_model_len=128)
    windows: list[int] = []
    execute_window = engine.runner.execute_window
    engine.runner.execute_window = lambda out, cb: (windows.append(out.num_steps), execute_window(out, cb))[1]
    run = Run(engine, requests).drain()
    assert engine.scheduler.num_preemptions > 0 and windows
    for rid, prompt in zip(requests, prompts, strict=True):
        assert run.tokens[rid] == hf_greedy(model_dir, prompt, 40), rid


def test_seeded_sampling_equals_one_step(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen2")
    requests = {f"s{i}": (random_prompt(6 + i, seed=i), SamplingParams(
        max_tokens=11 + i, temperature=0.9, top_p=0.9, top_k=50, seed=40 + i, ignore_eos=True)) for i in range(3)}
    assert Run(make_engine(model_dir, 4), requests).drain().tokens == Run(make_engine(model_dir, 1), requests).drain().tokens


# -- the scheduler's window planning, on a fake model -------------------------------------------


def make_scheduler(num_blocks: int = 20, steps: int = 4, max_model_len: int = 256) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS)
    return Scheduler(SchedulerConfig(max_model_len=max_model_len, num_scheduler_steps=steps), kv)


def make_request(rid: str, n: int, **params: int | bool) -> Request:
    base = 1000 * (1 + sum(rid.encode()) % 50)
    return Request(rid, list(range(base, base + n)), SamplingParams(ignore_eos=True, **params), eos_token_id=2,
                   block_hasher=BlockHasher("test-model", block_size=BS))


def test_window_gets_lookahead_blocks_capped_by_max_tokens() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 14, max_tokens=50))
    s.add_request(make_request("b", 30, max_tokens=3))
    out = s.schedule()
    assert out.num_steps == 1  # prefills run one step
    s.update_from_output(out, {"a": [7], "b": [8]})
    out = s.schedule()
    # a computed 14 of 15 tokens: 4 steps need slots 14..17 -> 2 blocks; b may produce 2 more
    # tokens: slots 30..31 -> still 2 blocks.
    assert out.num_steps == 4
    assert [(sr.request.request_id, len(sr.block_ids)) for sr in out.scheduled] == [("a", 2), ("b", 2)]
    s.update_from_output(out, {"a": [9], "b": [9]})
    assert s.prepare_window_step(out) == ["a", "b"]
    s.update_from_output(out, {"a": [9], "b": [9]})
    assert s.prepare_window_step(out) == ["a"]  # b reached max_tokens mid-window
    assert s.requests.keys() == {"a"}


def test_no_window_while_an_arrival_can_start_or_the_pool_is_short() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 16, max_tokens=50))
    out = s.schedule()
    s.update_from_output(out, {"a": [7]})
    s.add_request(make_request("b", 5))
    out = s.schedule()
    assert out.num_steps == 1 and [sr.request.request_id for sr in out.scheduled] == ["a", "b"]

    # Two usable blocks, one each: a window of 4 would need a second block for both.
    short = make_scheduler(num_blocks=3, max_model_len=32)
    short.add_request(make_request("a", 15, max_tokens=50))
    short.add_request(make_request("b", 15, max_tokens=50))
    out = short.schedule()
    short.update_from_output(out, {"a": [7], "b": [7]})
    out = short.schedule()
    assert out.num_steps == 1 and [len(sr.block_ids) for sr in out.scheduled] == [1, 1]


def test_offline_cli_with_eight_steps_is_token_exact_with_transformers(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(9, seed=61), random_prompt(23, seed=62)]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": 19, "ignore_eos": True}) + "\n"
                           for p in prompts))
    done = subprocess.run([*KVMESH, "offline", "--model", str(model_dir), "--input", str(src), "--output", str(dst),
                           "--num-blocks", "64", "--max-model-len", "256", "--num-scheduler-steps", "8", *EXACT_CLI],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    got = [json.loads(line)["token_ids"] for line in dst.read_text().splitlines()]
    assert got == [hf_greedy(model_dir, p, 19) for p in prompts]
