"""LLMEngine / LLM scenarios: bad input at the door, EOS, threads, events, stats, text in/out."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.block_hash import algorithm_name as _alg
from kvmesh.contract.errors import AlreadyExists
from kvmesh.contract.types import BlockStored, SamplingParams
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from tests.support.model_worker import EXACT

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def make_engine(model_dir: Path, **kwargs) -> LLMEngine:
    return LLMEngine(model=str(model_dir), num_blocks=64, max_model_len=128, **{**EXACT, **kwargs})


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


BAD_REQUESTS = [
    ("too long", list(range(2, 130)), SamplingParams(), "128"),
    ("empty", [], SamplingParams(), "empty"),
    ("id >= vocab", [5, 660, 6], SamplingParams(), "660"),
    ("negative id", [5, -1], SamplingParams(), "-1"),
    ("max_tokens 0", [5, 6], SamplingParams(max_tokens=0), "0"),
    ("negative temperature", [5, 6], SamplingParams(temperature=-0.5), "-0.5"),
    ("top_p 0", [5, 6], SamplingParams(top_p=0.0), "0.0"),
    ("top_p > 1", [5, 6], SamplingParams(top_p=1.5), "1.5"),
    ("negative top_k", [5, 6], SamplingParams(top_k=-3), "-3"),
]


def test_bad_requests_raise_and_leave_a_running_request_alone(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    assert engine.model_config.vocab_size == 660
    engine.add_request("ok", [10, 11, 12, 13], GREEDY)
    first = [t for _ in range(2) for out in engine.step() for t in out.new_token_ids]
    assert len(first) == 2
    for name, prompt, params, shown in BAD_REQUESTS:
        with pytest.raises(ValueError) as err:
            engine.add_request(f"bad-{name}", prompt, params)
        assert shown in str(err.value), name
    with pytest.raises(AlreadyExists, match="already in use"):
        engine.add_request("ok", [1, 2], GREEDY)
    tokens = run_to_end(engine)
    assert set(tokens) == {"ok"}
    tokens["ok"] = first + tokens["ok"]

    alone = make_engine(tiny_model_dir("llama"))
    alone.add_request("ok", [10, 11, 12, 13], GREEDY)
    assert tokens == run_to_end(alone)


def test_eos_from_config_stops_unless_ignored(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("llama")
    (free,) = LLM(str(src), num_blocks=64, max_model_len=128, **EXACT).generate([[20, 21, 22]], GREEDY)
    eos = free.token_ids[4]
    cut = free.token_ids.index(eos)
    # A second EOS id in config.json and generation_config.json (as Llama 3 ships them).
    model_dir = tmp_path / "two-eos"
    shutil.copytree(src, model_dir)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model_dir / name).read_text())
        cfg["eos_token_id"] = [1, eos]
        (model_dir / name).write_text(json.dumps(cfg))
    llm = LLM(str(model_dir), num_blocks=64, max_model_len=128, **EXACT)
    stopped, ignored = llm.generate(
        [[20, 21, 22]] * 2, [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, ignore_eos=True)]
    )
    assert (stopped.token_ids, stopped.finish_reason) == (free.token_ids[: cut + 1], "stop")
    assert (ignored.token_ids, ignored.finish_reason) == (free.token_ids, "length")


def test_requests_added_from_another_thread(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    prompts = {f"r{i}": [30 + i, 31, 32 + i] for i in range(6)}

    def add_all() -> None:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, GREEDY)

    adder = threading.Thread(target=add_all)
    adder.start()
    tokens: dict[str, list[int]] = {}
    while adder.is_alive() or engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    adder.join()

    sequential = make_engine(tiny_model_dir("llama"))
    for rid, prompt in prompts.items():
        sequential.add_request(rid, prompt, GREEDY)
    assert tokens == run_to_end(sequential)


def test_abort_stops_a_request_and_frees_its_blocks(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir("llama"), enable_prefix_caching=False)
    engine.add_request("a", list(range(2, 50)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.stats().num_free_blocks == 63 - 3  # 48 prompt tokens -> 3 blocks (block 0 is null)
    assert engine.abort_request("a") is True
    assert engine.abort_request("a") is False
    assert engine.step() == []
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == 63


def test_kv_events_and_snapshot_name_the_prompt_blocks(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    engine = make_engine(model_dir, hash_algorithm="xxh3")
    assert engine.model_id == model_dir.resolve().name
    prompt = list(range(100, 140))  # 2 full blocks + 8 tokens
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    run_to_end(engine)
    # 40 + 7 computed tokens: blocks 0 and 1 are full; block 2 never is.
    expected = BlockHasher(engine.model_id, 16, _alg("xxh3")).hash_prompt(prompt)
    stored = [h for e in engine.take_kv_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == expected
    assert engine.cached_block_hashes() == set(expected)
    assert engine.take_kv_events() == []


def test_stats_count_queued_work_and_cache_hits(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    prompt = list(range(200, 240))
    engine.add_request("a", prompt, GREEDY)
    engine.add_request("b", prompt[:35], GREEDY)
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.queued_prefill_tokens) == (0, 2, 75)
    engine.step()  # admits both in one step; b hits a's first 2 blocks cached at schedule time
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.queued_prefill_tokens) == (2, 0, 0)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (75, 32)
    run_to_end(engine)
    assert engine.stats().num_running == 0
    assert engine.stats().num_total_blocks == 64


def test_the_report_counts_a_prompt_in_prefill_whole_until_its_first_token(tiny_model_dir) -> None:
    """``prefilling_tokens``: the scheduler's prompts without a token yet, whole (what a router counts of its
    own); the queued prefill counts what is left. Not the inbox's (its hit is not known yet)."""
    engine = make_engine(tiny_model_dir("llama"), max_num_batched_tokens=32)
    engine.add_request("a", list(range(200, 290)), GREEDY)
    load = engine.report_load()
    assert (load.queued_prefill_tokens, load.prefilling_tokens) == (90, 0)
    engine.step()  # the first 32-token chunk
    load = engine.report_load()
    assert (load.queued_prefill_tokens, load.prefilling_tokens) == (58, 90)
    engine.step()
    engine.step()  # the last chunk: its first token
    load = engine.report_load()
    assert (load.queued_prefill_tokens, load.prefilling_tokens) == (0, 0)


def test_load_reports_list_admissions_until_acknowledged_and_count_them(tiny_model_dir) -> None:
    """Every request a report lists as admitted is in its counts (the kv_service retires the routers'
    picks of it on that word), and an acknowledged admission is not listed again."""
    engine = make_engine(tiny_model_dir("llama"))
    engine.add_request("a", list(range(200, 240)), GREEDY)
    engine.add_request("b", list(range(300, 310)), GREEDY)
    first = engine.report_load()
    assert (first.admitted, first.reports_admissions, first.num_waiting) == (("a", "b"), True, 2)
    engine.ack_admitted(first.admitted[:1])
    assert engine.report_load().admitted == ("b",)
    engine.step()  # both move into the scheduler: still counted, now as running
    engine.add_request("c", list(range(400, 410)), GREEDY)
    later = engine.report_load()
    assert later.admitted == ("b", "c") and later.num_running + later.num_waiting == 3
    engine.ack_admitted(later.admitted)
    assert engine.report_load().admitted == ()
    assert engine.stats().load.admitted == ()  # plain stats (GetLoad, metrics) list nothing


def test_requests_taken_into_a_running_window_are_counted_until_its_snapshot(tiny_model_dir) -> None:
    """A request that leaves the inbox for the scheduler mid-step is in neither the inbox nor the last
    snapshot: stats() still counts it (it used to vanish from the load until the step ended)."""
    engine = make_engine(tiny_model_dir("llama"))
    engine.add_request("a", list(range(200, 240)), GREEDY)
    engine._drain_inbox()  # what step() does first, before its snapshot at the end
    s = engine.stats()
    assert (s.num_waiting, s.queued_prefill_tokens) == (1, 40)
    engine.step()
    assert engine.stats().num_running == 1 and engine.stats().num_waiting == 0


def test_text_prompts_in_input_order(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), num_blocks=64, max_model_len=128, **EXACT)
    texts = ["The keeper climbed the tower.", "Ships", "Why is the lens shaped like a beehive?"]
    outputs = llm.generate(texts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 7, 5)])
    assert [len(o.token_ids) for o in outputs] == [3, 7, 5]
    for text, out in zip(texts, outputs, strict=True):
        assert out.prompt_token_ids == llm.encode(text)
        assert out.prompt_token_ids[0] == 0  # BOS
        assert out.text == llm.decode(out.token_ids)
    assert llm.decode(llm.encode(texts[2])) == texts[2]
