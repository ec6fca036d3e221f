"""benchmarks/results/sim/merge_runs.py: one folder of every policy's latest run (issue 51)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import repo_root

SCRIPT = repo_root() / "benchmarks" / "results" / "sim" / "merge_runs.py"


def doc(caps: dict[str, float], *, limits: dict | None = None, requests: int = 1000, routers: int = 1) -> dict:
    return {"workload": {"name": "w", "requests": requests}, "settings": {"routers": routers, "routing": {"policy": "x"}},
            "capacity": caps, "capacity_search": {p: [{"policy": p, "rate": c}] for p, c in caps.items()},
            "runs": [{"policy": p, "rate": 1.0} for p in caps], "limits": limits or {}, "oracle_hit_rate": 0.5}


def write(d: Path, name: str, body: dict) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(body))


def merge(tmp_path: Path, *dirs: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "out"), *map(str, dirs)],
                          capture_output=True, text=True)


def test_a_later_run_replaces_its_policies_and_keeps_the_others(tmp_path):
    base, peers, ours = tmp_path / "base", tmp_path / "peers", tmp_path / "ours"
    write(base, "a_r1.json", doc({"kv-aware": 1.0, "lmetric": 2.0, "dynamo": 1.5}, limits={"information": 3.0}))
    write(peers, "a_r1.json", doc({"kv-aware": 1.1, "sticky": 1.2}))
    write(ours, "a_r1.json", doc({"kv-aware": 2.5}, limits={"information": 2.6}))
    write(ours, "only_ours.json", doc({"kv-aware": 9.0}))
    r = merge(tmp_path, base, peers, ours)
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out" / "a_r1.json").read_text())
    assert out["capacity"] == {"kv-aware": 2.5, "lmetric": 2.0, "dynamo": 1.5, "sticky": 1.2}
    assert out["capacity_search"]["kv-aware"] == [{"policy": "kv-aware", "rate": 2.5}]
    assert sorted(r["policy"] for r in out["runs"]) == ["dynamo", "kv-aware", "lmetric", "sticky"]
    assert out["limits"] == {"information": 2.6}  # the later run's limits: they follow kv-aware's rule
    assert out["merged_from"] == {"kv-aware": "ours/a_r1.json", "lmetric": "base", "dynamo": "base",
                                  "sticky": "peers/a_r1.json"}
    assert json.loads((tmp_path / "out" / "only_ours.json").read_text())["capacity"] == {"kv-aware": 9.0}


def test_runs_of_another_workload_or_other_settings_are_refused(tmp_path):
    base, other = tmp_path / "base", tmp_path / "other"
    write(base, "a_r1.json", doc({"kv-aware": 1.0}))
    write(other, "a_r1.json", doc({"kv-aware": 2.0}, requests=300))
    r = merge(tmp_path, base, other)
    assert r.returncode != 0 and "different workload" in r.stderr + r.stdout
    write(other, "a_r1.json", doc({"kv-aware": 2.0}, routers=3))
    r = merge(tmp_path, base, other)
    assert r.returncode != 0 and "different settings ['routers']" in r.stderr + r.stdout
