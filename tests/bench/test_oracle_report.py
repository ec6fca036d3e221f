"""Oracle LRU hit rate on constructed traces and the report's math on constructed records."""

from __future__ import annotations

import pytest

from kvmesh.bench.oracle import oracle_hit_rate, request_blocks
from kvmesh.bench.report import format_report, load_timeline, save_result, summarize
from kvmesh.replay.records import RequestRecord
from kvmesh.replay.trace import TraceRecord


def test_request_blocks_split_trace_blocks():
    assert request_blocks(TraceRecord(0, 40, 1, (5, 6)), block_size=16, trace_block=32) == [(5, 0), (5, 1)]
    assert request_blocks(TraceRecord(0, 70, 1, (5, 6, 7)), 16, 32) == [(5, 0), (5, 1), (6, 0), (6, 1)]


def test_oracle_exact_hit_rate_unbounded():
    # trace block 32 tokens = 2 kvmesh blocks of 16
    recs = [TraceRecord(0, 64, 1, (1, 2)),   # cold: 0 hits
            TraceRecord(0, 64, 1, (1, 3)),   # shares block 1: 32 tokens
            TraceRecord(0, 64, 1, (1, 2))]   # full repeat: the last token is recomputed -> 3 blocks = 48
    assert oracle_hit_rate(recs, capacity_blocks=100, block_size=16, trace_block=32) == pytest.approx(80 / 192)


def test_oracle_lru_evicts_least_recent_and_tail_first():
    recs = [TraceRecord(0, 32, 1, (1,)),   # A: 2 blocks
            TraceRecord(0, 32, 1, (2,)),   # B: 2 blocks; cache of 3 drops A's tail (A1)
            TraceRecord(0, 33, 1, (1, 9)),  # A again: only A0 left -> 16 hit tokens
            TraceRecord(0, 33, 1, (2, 9))]  # B: B0 survived (A re-touched, evicts B1 first)
    # after rec 3: cache holds A0, A1 (re-inserted), B0 -> B's hit = 16
    assert oracle_hit_rate(recs, capacity_blocks=3, block_size=16, trace_block=32) == pytest.approx(32 / 130)


def _rec(start, ttft, latency, out, prompt, cached, worker, itl=(), ok=True):
    """A request sent at ``start`` whose first token came ``ttft`` and last message ``latency`` later."""
    if not ok:
        return RequestRecord(0, start, prompt, out, worker, cached_tokens=cached, failed="UNAVAILABLE: x")
    return RequestRecord(0, start, prompt, out, worker, start + ttft, start + latency, out, cached, itl=list(itl))


def test_summarize_exact_values():
    recs = [_rec(0.0, 0.1, 0.5, 5, 100, 50, "w0", itl=[0.1, 0.1, 0.1, 0.1]),
            _rec(1.0, 0.3, 1.1, 3, 200, 0, "w1", itl=[0.4, 0.4]),
            _rec(1.5, 0.0, 0.0, 4, 100, 0, "", ok=False)]
    s = summarize(recs, duration_s=2.0, workers=["w0", "w1", "w2"])
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_input_tokens"] == 300 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(154.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(298.0)  # linear interpolation 100 + 0.99 * 200
    assert s["tpot_ms"]["mean"] == pytest.approx(250.0)  # (0.4/4 + 0.8/2) / 2
    assert s["itl_ms"]["mean"] == pytest.approx(200.0)  # (4 x 100 + 2 x 400) / 6
    assert s["e2el_ms"]["mean"] == pytest.approx(800.0)
    assert s["prefix_hit_rate"] == pytest.approx(50 / 300)
    assert s["worker_load_share"] == pytest.approx({"w0": 105 / 308, "w1": 203 / 308, "w2": 0.0})
    assert s["max_mean_load"] == pytest.approx(203 / (308 / 3))
    assert s["errors"] == ["UNAVAILABLE: x"]
    scaled = summarize(recs, duration_s=2.0, time_scale=0.5)
    assert scaled["ttft_ms"]["mean"] == pytest.approx(400.0) and scaled["output_throughput"] == pytest.approx(2.0)
    text = format_report(s)
    assert f"{'Successful requests:':<40}2 " in text and f"{'P99 TTFT (ms):':<40}298.00" in text
    assert f"{'Mean E2EL (ms):':<40}800.00" in text and f"{'Prefix hit rate (cached/prompt):':<40}0.1667" in text


def test_load_timeline_and_save(tmp_path):
    recs = [_rec(0.0, 0.1, 2.5, 1, 10, 0, "a"), _rec(1.0, 0.1, 1.0, 1, 10, 0, "b")]
    ticks, load = load_timeline(recs, step_s=1.0)
    assert ticks == [0.0, 1.0, 2.0, 3.0]
    assert load == {"a": [1, 1, 1, 0], "b": [0, 1, 0, 0]}
    path = tmp_path / "r.json"
    save_result(path, summarize(recs, 3.0), {"dataset": "x"}, recs)
    import json

    doc = json.loads(path.read_text())
    assert doc["config"] == {"dataset": "x"} and doc["completed"] == 2 and len(doc["requests"]) == 2
