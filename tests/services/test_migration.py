"""Request migration with real workers (issue 50): a stream whose worker stops mid-generation with no
grace left (its drain outlasts the grace: the stream is cut UNAVAILABLE) goes on at another worker, and
the client's one stream holds the same greedy tokens as an undisturbed run."""

from __future__ import annotations

import threading
import time

import pytest

from kvmesh.client import Client
from kvmesh.contract.convert import PB_TO_FINISH

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
TOKENS = 300


@pytest.mark.parametrize("kv_server", [30_000], indirect=True)
def test_a_stream_cut_mid_generation_goes_on_elsewhere_token_identical(kv_server, start_worker, start_router):
    kv = f"127.0.0.1:{kv_server.port}"
    workers = {w.worker_id: w for w in (start_worker("w0", kv), start_worker("w1", kv))}
    router = start_router(kv)
    deadline = time.monotonic() + 20
    while len(router.pool.endpoints()) < 2:
        assert time.monotonic() < deadline, "the router never saw both workers"
        time.sleep(0.05)
    with Client(f"127.0.0.1:{router.port}", timeout=120) as client:
        reference = client.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True)
        assert len(reference.token_ids) == TOKENS
        got: list[int] = []
        finish = None
        stopper: threading.Thread | None = None
        for msg in client.stream(PROMPT, max_tokens=TOKENS, ignore_eos=True):
            got.extend(msg.token_ids)
            if msg.finish_reason:
                finish = PB_TO_FINISH.get(msg.finish_reason)
            if stopper is None and len(got) >= 40:
                serving = [w for w in workers.values() if w.engine.stats().num_running]
                assert len(serving) == 1
                # NOTE: grace 0: the drain outlasts it at once and the open stream is cut UNAVAILABLE
                stopper = threading.Thread(target=serving[0].stop, args=(0.0,))
                stopper.start()
        assert stopper is not None
        stopper.join(30)
    assert finish == "length"
    assert got == reference.token_ids, "the migrated stream's tokens differ from the undisturbed run's"
    assert router.metrics.migrations._value.get() == 1
