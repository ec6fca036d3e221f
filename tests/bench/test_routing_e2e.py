"""`kvmesh bench routing` end to end: 2 simulated workers, 20 trace requests, 2 policies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.make_model import ensure_default_model

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
@pytest.mark.timeout(120)
def test_bench_routing_two_policies(tmp_path):
    # short prompts: the first 20 lines of a 2-block trace keep prefill cheap
    lines = [json.loads(x) for x in TRACE.read_text().splitlines()[:20]] if TRACE.exists() else [
        {"timestamp": 100 * i, "input_length": 700, "output_length": 8, "hash_ids": [0, i + 1]} for i in range(20)]
    small = [{**x, "input_length": min(x["input_length"], 1000), "hash_ids": x["hash_ids"][:2],
              "output_length": min(x["output_length"], 8)} for x in lines]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in small))
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "routing", "--trace", str(trace), "--workers", "2",
         "--policies", "kv-aware,round-robin", "--speedup", "20", "--sim-time-scale", "0.1", "--num-blocks", "512",
         "--json", str(out), "--no-progress", "--model", str(ensure_default_model())],
        capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert set(doc) == {"kv-aware", "round-robin", "oracle_hit_rate", "settings"}
    for policy in ("kv-aware", "round-robin"):
        r = doc[policy]
        assert {"ttft_mean_ms", "ttft_p90_ms", "ttft_p99_ms", "output_tok_s", "hit_rate", "max_mean_load"} <= set(r)
        assert (r["completed"], r["failed"]) == (20, 0)
        assert r["ttft_mean_ms"] > 0 and r["output_tok_s"] > 0 and 1.0 <= r["max_mean_load"] <= 2.0
        assert 0.0 < r["utilisation_mean"] <= 1.0
    # the router's own account of its picks: one per request, by the policy's reasons
    assert sum(doc["round-robin"]["decisions"].values()) == 20 and set(doc["round-robin"]["decisions"]) == {"round_robin"}
    assert sum(doc["kv-aware"]["decisions"].values()) == 20
    assert set(doc["kv-aware"]["decisions"]) <= {"prefix", "load", "balance", "fallback"}
    assert "kv-aware decisions: " in proc.stdout
    assert doc["kv-aware"]["redis"]["evalsha_per_s"] > 0  # the index's Redis ran the event and lookup scripts
    p99 = doc["kv-aware"]["lookup_p99_ms_le"]  # kv-aware asked the index for every multi-block prompt
    assert p99["kv_service"] > 0 and p99["router"] > 0 and doc["round-robin"]["lookup_p99_ms_le"]["router"] == 0
    # every request shares hash id 0 (512 tokens) with the first: both policies see hits
    assert 0 < doc["oracle_hit_rate"] < 1 and doc["kv-aware"]["hit_rate"] > 0
    assert "TTFT÷" in proc.stdout and "oracle hit rate" in proc.stdout
