"""`kvmesh bench routing` end to end: 2 simulated workers, 2 policies, a trace built so that the
policies must differ: pairs of requests sharing a 512-token prefix, one pair after another."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh.make_model import ensure_default_model

FAMILIES = 8
INPUT, SHARED, OUTPUT = 1000, 512, 8
PAIR_GAP_MS, FAMILY_GAP_MS = 3000, 6000  # trace time; --speedup 15 makes them 0.2 s and 0.4 s


def pair_trace() -> list[dict]:
    """Family f: two requests whose first trace block (512 tokens) is the same, the rest their own.

    Round robin sends the two requests of a pair to different workers (the pair is always requests
    2f and 2f+1), so it never hits; a KV-aware router sends the second to the first one's worker.
    """
    out = []
    for f in range(FAMILIES):
        for k in range(2):
            out.append({"timestamp": f * FAMILY_GAP_MS + k * PAIR_GAP_MS, "input_length": INPUT,
                        "output_length": OUTPUT, "hash_ids": [f + 1, 100 + 2 * f + k]})
    return out


@pytest.mark.timeout(150)
def test_bench_routing_kv_aware_follows_the_prefix_round_robin_cannot(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in pair_trace()))
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "routing", "--trace", str(trace), "--workers", "2",
         "--policies", "kv-aware,round-robin", "--speedup", "15", "--sim-time-scale", "0.1", "--num-blocks", "512",
         "--json", str(out), "--no-progress", "--model", str(ensure_default_model()),
         # NOTE: the index's answer, not its speed, is under test: a loaded 2-core host can take
         # longer than the default 50 ms Lookup deadline, which would route by fallback instead.
         "--router-args", "--lookup-timeout-ms 2000"],
        capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    n = 2 * FAMILIES
    assert set(doc) == {"kv-aware", "round-robin", "oracle_hit_rate", "settings"}
    for policy in ("kv-aware", "round-robin"):
        r = doc[policy]
        assert {"ttft_mean_ms", "ttft_p90_ms", "ttft_p99_ms", "output_tok_s", "hit_rate", "max_mean_load"} <= set(r)
        assert (r["completed"], r["failed"]) == (n, 0)
        assert r["ttft_mean_ms"] > 0 and r["output_tok_s"] > 0
        assert 0.0 < r["utilisation_mean"] <= 1.0
    kv, rr = doc["kv-aware"], doc["round-robin"]
    # Every second request of a pair can reuse its 512-token prefix: the oracle's hit rate.
    best = FAMILIES * SHARED / (n * INPUT)
    assert doc["oracle_hit_rate"] == pytest.approx(best)
    # Round robin alternates: each pair lands on both workers, equal load, not one hit.
    assert rr["decisions"] == {"round_robin": n}
    assert rr["hit_rate"] == 0.0 and rr["max_mean_load"] == pytest.approx(1.0)
    # kv-aware routes each second request by its prefix and gets (nearly all of) the oracle's hits.
    # NOTE: a pair is 0.2 s apart; only a host stalled that long between the first request's
    # prefill and the second's arrival could cost a hit, hence not exactly the oracle.
    assert kv["decisions"] == {"load": FAMILIES, "prefix": FAMILIES}
    assert 0.75 * best <= kv["hit_rate"] <= best + 1e-9, kv
    assert "kv-aware decisions: " in proc.stdout
    assert kv["redis"]["evalsha_per_s"] > 0  # the index's Redis ran the event and lookup scripts
    p99 = kv["lookup_p99_ms_le"]  # kv-aware asked the index for every multi-block prompt
    assert p99["kv_service"] > 0 and p99["router"] > 0 and rr["lookup_p99_ms_le"]["router"] == 0
    assert "TTFT÷" in proc.stdout and "oracle hit rate" in proc.stdout
