"""The short soak of `make test`: benchmarks/soak.py for 20 s, zero failed requests, zero leaked blocks.

RSS is reported by the soak but not asserted (20 s of allocator noise says nothing).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import repo_root


@pytest.mark.timeout(180)
def test_short_soak_has_no_errors_and_no_leaks(fault_model, tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(repo_root() / "benchmarks" / "soak.py"), "--streams", "8",
                          "--minutes", "0.33", "--sample-s", "5", "--model", str(fault_model), "--json", str(out)],
                         capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert (r["failed"], r["dead"], r["leaked_blocks"], r["bad_refcounts"]) == (0, [], 0, 0)
    assert r["ok"] >= 100 and r["drained"] and r["rebuilt"]
    for worker, pool in r["pool"].items():
        assert pool == {"free": 511, "total": 512, "leaked": 0}, worker
    for worker, ix in r["index"].items():
        # Not vacuous: the worker cached blocks (the 512-block pool also evicted some), and the
        # index built from its events is exactly the snapshot it sent.
        assert ix["events"] > 0 and ix == {"events": ix["events"], "snapshot": ix["events"], "index_only": 0,
                                           "worker_only": 0}, worker
