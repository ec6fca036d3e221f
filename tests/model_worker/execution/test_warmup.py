"""Warm start (warmup.py): the shapes a warm-up runs, and that it leaves no trace but warm code.
The engine runs in float32 on ``ENGINE_DEVICE`` (tests/support/model_worker.py)."""

from __future__ import annotations

import logging

from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.execution.warmup import WarmupBatch, warmup_batches
from tests.support.model_worker import EXACT


def test_a_full_warm_up_covers_every_tile_split_and_compile_class() -> None:
    batches = warmup_batches(max_num_seqs=128, max_num_batched_tokens=2048, max_model_len=4096, block_size=16)
    assert batches == [
        WarmupBatch((1,), 1),  # T = 1 (compiled apart), decode tile, no split
        WarmupBatch((1,), 256),  # a 4096-token table: split-KV on a GPU
        WarmupBatch((1,) * 128, 256),  # the largest decode batch
        WarmupBatch((2048,), 128),  # the longest prefill chunk: the prefill tile
        WarmupBatch((1, 1, 7), 1),  # decodes beside a chunk: T > 2S, the prefill tile on several sequences
    ]


def test_warm_up_shapes_stay_within_what_the_scheduler_can_produce() -> None:
    # A prompt is shorter than max_model_len; a step holds at most the token budget and max_num_seqs rows.
    for seqs, budget, max_len in ((4, 16, 64), (256, 64, 8192), (1, 2048, 100), (2, 3, 10)):
        for b in warmup_batches(seqs, budget, max_len, 16):
            assert 1 <= len(b.q_lens) <= seqs and b.num_tokens <= budget
            assert max(b.q_lens) <= max_len - 1 and b.table_width <= -(-max_len // 16)


def test_warm_up_leaves_the_cache_and_the_sampler_as_it_found_them(tiny_model_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvmesh.model_worker.execution.warmup"):
        llm = LLM(str(tiny_model_dir("mistral")), num_blocks=32, max_model_len=256, **EXACT)
    report = llm.engine.warmup_report
    assert report is not None and report.batches >= 1 and report.seconds > 0
    assert any(r.getMessage().startswith("warm-up took ") for r in caplog.records)
    runner = llm.engine.runner
    assert all(bool((a.k_cache == 0).all() and (a.v_cache == 0).all()) for a in runner.attention_layers)
    assert llm.engine.kv_cache_manager.num_free_blocks == 31
    # Unseeded sampled requests draw from the shared generator: the warm-up never touched it.
    assert runner.sampler._shared == {} and runner.sampler._per_request == {}
    # A request went through the whole step path, and left nothing a client or router could see.
    engine = llm.engine
    assert engine.warm_request_s > 0
    assert engine.take_kv_events() == [] and engine.cached_block_hashes() == set()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.steps, stats.busy_s, stats.prefix_cache_queries) == (0, 0, 0, 0.0, 0)
    assert engine.scheduler.requests == {} and not engine.has_unfinished_requests()


def test_prefill_size_classes_are_warmed_where_asked() -> None:
    batches = warmup_batches(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096, block_size=16,
                             prefill_classes=True)
    assert [b.q_lens for b in batches if len(b.q_lens) == 1 and b.q_lens[0] > 1] == [
        (512,), (16,), (32,), (64,), (128,), (256,)]
