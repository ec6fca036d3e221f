"""The replay's shared pieces: one Mooncake reader both replayers build on, one record, one summary."""

from __future__ import annotations

import json

import pytest

from kvmesh.bench.trace import TraceSynthesizer
from kvmesh.replay.records import RequestRecord, stats, summarize
from kvmesh.replay.trace import TraceRecord, load_trace
from kvmesh.sim.workload import trace_workload

LINES = [{"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
         {"timestamp": 3500, "input_length": 1000, "output_length": 0, "hash_ids": [7]},
         {"timestamp": 5000, "input_length": 512, "output_length": 3, "hash_ids": [11, 8]}]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in LINES) + "\n\n")
    return path


def test_a_trace_is_read_from_any_line_on(trace):
    assert load_trace(trace) == [TraceRecord(1000, 1100, 5, (7, 8, 9)), TraceRecord(3500, 1000, 0, (7,)),
                                 TraceRecord(5000, 512, 3, (11, 8))]
    assert load_trace(trace, max_requests=1, skip=1) == [TraceRecord(3500, 1000, 0, (7,))]
    assert load_trace(trace, skip=5) == []


def test_block_ids_are_as_many_as_the_prompt_needs_padded_with_private_ones():
    assert TraceRecord(0, 1100, 1, (7, 8, 9, 10)).block_ids(0) == [7, 8, 9]
    assert TraceRecord(0, 1000, 1, (7,)).block_ids(2) == [7, -(2 * 1_000_003 + 1)]
    assert TraceRecord(0, 1000, 1, (7,)).block_ids(3) != TraceRecord(0, 1000, 1, (7,)).block_ids(2)
    assert TraceRecord(0, 0, 1, (7,)).block_ids(0) == []


def test_the_simulator_and_the_live_bench_make_each_prompt_of_the_same_blocks(trace):
    """The simulator's segments and the bench's token blocks come from the same block ids: a prompt of
    either shares exactly the blocks it shares in the other."""
    workload = trace_workload(trace)
    synth = TraceSynthesizer(seed=1, block_tokens=512)
    for i, (req, rec) in enumerate(zip(workload.requests, load_trace(trace), strict=True)):
        assert [s for s, _ in req.segments] == rec.block_ids(i)
        assert sum(n for _, n in req.segments) == req.prompt_len == len(synth.prompt(rec, i)) == rec.input_length
    assert [r.arrival_s for r in workload.requests] == [0.0, 2.5, 4.0]
    assert [r.output_len for r in workload.requests] == [5, 1, 3]  # at least one token asked for


def test_one_summary_of_finished_failed_and_unfinished_requests():
    recs = [RequestRecord(0, 0.0, 100, 5, "w0", 0.1, 0.5, 5, 50, itl=[0.1] * 4),
            RequestRecord(1, 1.0, 200, 3, "w1", 1.25, 2.25, 3, 0),
            RequestRecord(2, 1.5, 100, 4, "w1", 1.75, failed="UNAVAILABLE: x"),
            RequestRecord(3, 2.0, 100, 4, "w0", 2.5)]  # first token, never finished
    s = summarize(recs, ["w0", "w1", "w2"])
    assert (s.requests, s.completed, s.failed, s.unfinished) == (4, 2, 1, 1)
    assert (s.prompt_tokens, s.output_tokens, s.cached_tokens) == (300, 8, 50)
    assert s.ttft == pytest.approx([0.1, 0.25, 0.5])  # the unfinished one's too, not the failed one's
    assert s.tpot == pytest.approx([0.1, 0.5]) and s.e2e == pytest.approx([0.5, 1.25]) and len(s.itl) == 4
    assert s.served == {"w0": 105, "w1": 203, "w2": 0}
    assert s.hit_rate == pytest.approx(50 / 300) and s.max_mean_load == pytest.approx(203 / (308 / 3))
    assert s.errors == ["UNAVAILABLE: x"]
    assert stats([0.1, 0.3], 1000.0)["p99"] == pytest.approx(298.0) and stats([])["mean"] == 0.0
