"""Several routers, one view: `kvmesh up --routers 3` on loopback (real redis-server, kv_service,
simulated workers that sleep their modelled step times, three router processes), a burst dealt to
the routers in turn (kvmesh.bench.serve, one channel per router).

A simultaneous burst of same-prefix requests spread over 3 routers lands the way one router lands
it; every pick is retired by the worker's reports (nothing leaks), also when a router dies in the
middle of a burst. It holds under stress too (issue 35): the kv_service answering every Lookup and
Reserve 10 ms late (--lookup-delay-ms, --reserve-delay-ms) while a busy loop takes a core."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from kvmesh.bench.datasets import BenchRequest
from kvmesh.bench.serve import run
from kvmesh.loopback import free_port, free_port_run
from kvmesh.stack import LocalStack, StackConfig
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from tests.support import wait_until

PREFIX, SUFFIX, BURST = 4096, 2048, 24
"""A long shared prefix and long own suffixes: one router sends about a third of a 24-request burst to
the prefix's holder and the rest elsewhere (routers with private views each send it more of theirs)."""
BURSTS = 8
"""Bursts per kind (one router, three). A burst's share on the holder varies by 1-1.5 (standard
deviation): with 4 bursts each, the means' gap had a noise of about 1 and a CI run failed the bound
then in force, one router's mean + 3 (one router 6.25, three 9.5; 2026-11-26). Over 8 it is about 0.7."""


def prompts(trial: int, n: int) -> list[BenchRequest]:
    # NOTE: ids below the tiny model's vocabulary (660); each trial's prefix differs from the others'.
    prefix = [(37 * trial + 1 + i) % 600 for i in range(PREFIX)]
    return [BenchRequest(prefix + [(300 + 7 * k + 13 * j + trial) % 650 for j in range(SUFFIX)], 4, 0.0)
            for k in range(n)]


def send(target: str, reqs: list[BenchRequest]) -> Counter:
    records, _ = run(target, reqs, progress=False, timeout=120)
    assert all(r.success for r in records), [r.failed for r in records if not r.success]
    return Counter(r.worker for r in records)


def workers(kv) -> dict[str, kpb.WorkerInfo]:
    return {w.worker_id: w for w in kv.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers}


STRESS = ["--lookup-delay-ms", "10", "--reserve-delay-ms", "10"]


@pytest.mark.parametrize("stress", [False, True], ids=["calm", "stressed"])
def test_a_burst_through_three_routers_spreads_as_one_router_spreads_it_and_no_pick_leaks(model_dir, tmp_path, stress):
    """Measured (docs/router.md, "Several routers"): the prefix's holder got 6-9 of a 24-request burst
    from one router, 7-10 from three sharing their view, calm or stressed (2026-11-26, issue 35); before
    the shared prefixes and the late-Lookup rule, three routers put 10-14 on it under stress."""
    base = free_port_run(6)
    stack = LocalStack(StackConfig(
        model=str(model_dir), workers=4, routers=3, router_port=base, kv_service_port=free_port(),
        worker_port=free_port_run(4), metrics_port=0, simulate=True, router_tokenizer=False,
        kv_service_args=["--lease-ttl-ms", "3000", "--pending-ttl-ms", "2000", *(STRESS if stress else [])],
        log_dir=str(tmp_path / "logs"))).start()
    # NOTE: a busy loop beside the stack: on a 2-core host it takes a core from the routers, the
    # kv_service and the workers (issue 35 found the calm test failing 2 of 2 with one running).
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if stress else None
    try:
        assert stack.endpoints["routers"] == f"ipv4:127.0.0.1:{base},127.0.0.1:{base + 2},127.0.0.1:{base + 4}"
        kv = kpb_grpc.KVServiceStub(dial(stack.endpoints["kv_service"]))
        on_holder: dict[str, list[int]] = {"one": [], "three": []}
        for trial in range(2 * BURSTS):
            reqs = prompts(trial, BURST + 1)
            holder = next(iter(send(stack.endpoints["router"], reqs[:1])))  # the prefix lands on one worker
            time.sleep(0.5)  # its events reach the index
            # Even trials: one router takes the whole burst; odd: gRPC round_robin deals it to all three.
            kind = "one" if trial % 2 == 0 else "three"
            got = send(stack.endpoints[{"one": "router", "three": "routers"}[kind]], reqs[1:])
            assert got[holder] < BURST, got  # spread, by one router or by three
            on_holder[kind].append(got[holder])
            # Every pick is retired by the workers' own reports once they admitted the requests.
            wait_until(lambda: all(w.pending.requests == 0 for w in workers(kv).values()), timeout=10)
        one, three = (sum(v) / len(v) for v in (on_holder["one"], on_holder["three"]))
        # NOTE: within 3 of what one router puts on the holder, or at most 4 over an even share (10
        # of 24), whichever is larger. Measured side by side, 8 bursts each (2026-11-26, shared 2-core
        # host): under stress three routers sharing their view put 8.1-9.0 on the holder, one router
        # 7.5-8.0, three with private views 11.75: the bound parts them. One router's share falls
        # with the host's load (5.5 with a second busy loop, where three routers' stays at 8.4):
        # even + 4 keeps a loaded host from failing the shared view; there private views put 9.75 and
        # this test cannot tell them apart (the simulator's test, deterministic, is the tight one).
        assert three <= max(one + 3, BURST / 4 + 4), on_holder
        reserved = sum(w.pending.version for w in workers(kv).values())
        print(f"holder's share {on_holder}, {reserved} reservations")  # noqa: T201 - the figures, with -s
        assert reserved >= 2 * BURSTS * BURST, reserved  # every pick was reserved

        # A router dies in the middle of a burst: what it picked and forwarded is admitted, what it
        # reserved and never forwarded expires; no pick is left behind either way.
        victim = next(proc for name, proc in stack.procs if name == "router-1")
        burst = threading.Thread(target=lambda: run(f"127.0.0.1:{base + 2}", prompts(2 * BURSTS + 1, 30),
                                                    progress=False, timeout=60), daemon=True)
        burst.start()
        time.sleep(0.05)
        victim.kill()
        burst.join(60)
        wait_until(lambda: all(w.pending.requests == 0 for w in workers(kv).values()), timeout=15)
        send(stack.endpoints["router"], prompts(2 * BURSTS + 2, 2))  # the mesh still serves
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        stack.stop()
