"""Each part of the stack fails (SIGKILL, SIGSTOP, restart) while requests flow: what clients see.

One module-scoped mesh: a private Redis, kv_service replicas `kv-a`, `kv-b` (workers and the router
use both, round robin) and `kv-c` (only the slow-Lookup router uses it), three simulated workers, a
router. Tests run in file order and each leaves the mesh serving.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import pytest

from kvmesh.client import Client
from kvmesh.loopback import free_port
from kvmesh.stack import wait_serving
from kvmesh.v1 import kv_service_pb2 as kpb
from tests.faults.conftest import (
    LEASE_MS,
    Cluster,
    Proc,
    Traffic,
    kv_stub,
    live_workers,
    matched,
    metric,
    prompt,
)
from tests.support import wait_until

MODEL_ID = "tiny-llama"
BLOCK = 16


@dataclass
class Mesh:
    cluster: Cluster
    kv_a: Proc
    kv_b: Proc
    kv_c: Proc
    workers: dict[str, Proc]
    router: Proc
    metrics_port: int

    @property
    def kv_list(self) -> str:
        return f"{self.kv_a.address},{self.kv_b.address}"

    def client(self) -> Client:
        return Client(self.router.address, timeout=20)


@pytest.fixture(scope="module")
def mesh(cluster: Cluster) -> Mesh:
    cluster.start_redis()
    kv_a, kv_b, kv_c = (cluster.kv_service(n) for n in ("kv-a", "kv-b", "kv-c"))
    kv_list = f"{kv_a.address},{kv_b.address}"
    workers = {w: cluster.worker(w, kv_list, wait=False) for w in ("w0", "w1", "w2")}
    for w in workers.values():
        wait_serving(w.address, w.popen, 60)
    wait_until(lambda: len(live_workers(kv_stub(kv_a.address))) == 3, 20, "three registered workers")
    port = free_port()
    router = cluster.router(kv_list, port, "--first-token-timeout", "1")
    return Mesh(cluster, kv_a, kv_b, kv_c, workers, router, port)


def warm(mesh: Mesh, ids: list[int]) -> str:
    """Serves ``ids`` once; waits until the index shows its whole prompt at the server; returns it."""
    with mesh.client() as c:
        out = c.generate(ids, max_tokens=2, ignore_eos=True)
    kv = kv_stub(mesh.kv_a.address)
    wait_until(lambda: matched(kv, MODEL_ID, ids).get(out.served_by) == len(ids) // BLOCK, 10,
               f"the index to show {out.served_by} holding the prompt")
    return out.served_by


# NOTE: the first test of the module also pays for starting the mesh (eight processes).
@pytest.mark.timeout(240)
def test_lookup_slower_than_its_deadline_routes_by_fallback(mesh: Mesh):
    # NOTE: the breaker stays open 3 s (--index-retry), far longer than the five requests below
    # take even on a loaded host, so exactly one of them pays the deadline. The speculative map is
    # off: a prefix decision after the breaker closes can only come from the index.
    port = free_port()
    router = mesh.cluster.router(mesh.kv_c.address, port, "--lookup-timeout-ms", "50", "--index-retry", "3",
                                 "--speculative-ttl", "0", "--first-token-timeout", "5", name="router-c")
    fallbacks = "kvmesh_router_fallbacks_total"
    try:
        ids = prompt(7, 1)
        holder = warm(mesh, ids)
        before = {cause: metric(port, fallbacks, cause=cause) for cause in ("lookup_failed", "index_down")}
        mesh.kv_c.signal(signal.SIGSTOP)  # the Lookup now waits until its 50 ms deadline
        try:
            with Client(router.address, timeout=20) as c:
                outs = [c.generate(prompt(7, 100 + n), max_tokens=2, ignore_eos=True) for n in range(5)]
        finally:
            mesh.kv_c.signal(signal.SIGCONT)
        after = {cause: metric(port, fallbacks, cause=cause) for cause in before}
        assert [o.finish_reason for o in outs] == ["length"] * 5
        # The first request pays the deadline; the breaker makes the next ones skip the index.
        assert after["lookup_failed"] - before["lookup_failed"] == 1
        assert after["index_down"] - before["index_down"] == 4
        # Once the breaker closes, the index is asked again (a Lookup answers; requests of another
        # prefix family, so nothing routed here touches the holder's prefix) ...
        lookups = "kvmesh_router_lookup_latency_seconds_count"
        answered = metric(port, lookups)
        with Client(router.address, timeout=20) as c:
            other = iter(range(1000))

            def index_answers() -> bool:
                c.generate(prompt(70, next(other)), max_tokens=2, ignore_eos=True)
                return metric(port, lookups) > answered

            wait_until(index_answers, 15, "a Lookup answered after the kv_service resumed")
            # ... and one request on the cached prefix goes to its holder, as a prefix decision.
            decisions = "kvmesh_router_decisions_total"
            prefix_picks = metric(port, decisions, policy="kv-aware", reason="prefix")
            out = c.generate(ids, max_tokens=2, ignore_eos=True)
        assert (out.served_by, out.usage.cached_tokens) == (holder, len(ids) // BLOCK * BLOCK)
        assert metric(port, decisions, policy="kv-aware", reason="prefix") == prefix_picks + 1
        assert metric(port, fallbacks, cause="lookup_failed") == after["lookup_failed"]
    finally:
        router.stop()
        mesh.cluster.procs.remove(router)


@pytest.mark.timeout(60)
def test_stopped_worker_is_given_up_before_the_first_token(mesh: Mesh):
    ids = prompt(8, 1)
    holder = warm(mesh, ids)
    retries = metric(mesh.metrics_port, "kvmesh_router_retries_total", failure="timeout")
    mesh.workers[holder].signal(signal.SIGSTOP)
    try:
        with mesh.client() as c:
            out = c.generate(ids, max_tokens=4, ignore_eos=True)
    finally:
        mesh.workers[holder].signal(signal.SIGCONT)
    assert out.finish_reason == "length" and out.usage.completion_tokens == 4
    assert out.served_by != holder and out.usage.cached_tokens == 0
    assert metric(mesh.metrics_port, "kvmesh_router_retries_total", failure="timeout") == retries + 1
    wait_until(lambda: set(live_workers(kv_stub(mesh.kv_a.address))) == set(mesh.workers), 10,
               "the resumed worker's lease")


@pytest.mark.timeout(60)
def test_worker_killed_mid_stream_is_migrated_and_leaves_before_its_lease_ends(mesh: Mesh):
    """SIGKILL mid-stream: the router continues the stream on another worker (the client's one stream
    ends whole; simulated workers' tokens depend on the request id, so identity is tested with real
    ones in tests/services/test_migration.py), and the dead worker leaves Lookup: its event stream
    ended with no next one, and the router reported it."""
    ids = prompt(9, 1)
    holder = warm(mesh, ids)
    kv = kv_stub(mesh.kv_a.address)
    migrated = metric(mesh.metrics_port, "kvmesh_router_migrations_total")
    with mesh.client() as c:
        stream = c.stream(ids, max_tokens=1500, ignore_eos=True)
        got = [next(stream) for _ in range(3)]
        assert all(m.token_ids for m in got)
        mesh.workers[holder].signal(signal.SIGKILL)
        got += list(stream)
    assert sum(len(m.token_ids) for m in got) == 1500
    assert got[-1].finish_reason and got[-1].served_by != holder

    assert metric(mesh.metrics_port, "kvmesh_router_migrations_total") == migrated + 1
    # NOTE: tests/services/test_workers_leave.py shows, with a 30 s lease, that this is the stream's end or the
    # router's report and not the lease (4 s here).
    wait_until(lambda: holder not in matched(kv, MODEL_ID, ids), LEASE_MS / 1000 + 5, f"{holder} to leave Lookup")
    assert set(live_workers(kv)) == set(mesh.workers) - {holder}
    # The reaper deletes its blocks within half a lease of its leaving: replicas are the survivors' only.
    wait_until(lambda: kv.GetStats(kpb.GetStatsRequest(), timeout=5).block_replicas == sum(w.blocks_indexed for w in live_workers(kv).values()),
               LEASE_MS / 1000, "the dead worker's blocks to be reaped")
    del mesh.workers[holder]


@pytest.mark.timeout(90)
def test_restarted_worker_starts_a_new_epoch_with_no_blocks(mesh: Mesh):
    kv = kv_stub(mesh.kv_a.address)
    ids = prompt(10, 1)
    holder = warm(mesh, ids)
    old = mesh.workers[holder]
    old_info = live_workers(kv)[holder]
    old_epoch = old_info.epoch
    old.signal(signal.SIGSTOP)  # no heartbeat, no events: its lease is still running
    new = mesh.cluster.worker(holder, mesh.kv_list)  # same id, new process (and port)
    old.signal(signal.SIGKILL)
    mesh.workers[holder] = new
    # NOTE: SERVING does not wait for the registration. The epoch comes from the new process's
    # wall clock: a later one replaces the live registration at once; one that stepped back is
    # refused until the old lease runs out. Either way the new address shows up within a lease.
    wait_until(lambda: live_workers(kv).get(holder, old_info).address == new.address, LEASE_MS / 1000 + 5,
               f"{holder}'s new process to register")
    info = live_workers(kv)[holder]
    assert info.epoch != old_epoch
    assert info.blocks_indexed == 0
    assert matched(kv, MODEL_ID, ids) == {w: 0 for w in mesh.workers}
    with mesh.client() as c:
        out = c.generate(ids, max_tokens=2, ignore_eos=True)
    assert out.usage.cached_tokens == 0  # nobody holds the old prefix any more, whoever served it
    n = len(ids) // BLOCK
    wait_until(lambda: matched(kv, MODEL_ID, ids) == {w: n if w == out.served_by else 0 for w in mesh.workers},
               10, "the index to show exactly the new holder")


@pytest.mark.timeout(90)
def test_kill_one_kv_service_replica_under_load(mesh: Mesh):
    with Traffic(mesh.router.address) as traffic:
        traffic.wait_for(20)
        mesh.kv_b.signal(signal.SIGKILL)
        killed = time.monotonic()
        traffic.wait_for(40)
        # Workers keep their leases (heartbeats through kv-a) for longer than a lease.
        wait_until(lambda: time.monotonic() - killed > LEASE_MS / 1000 * 1.2, 10, "a lease to pass")
        traffic.wait_for(10)
    assert dict(traffic.errors) == {}
    assert traffic.ok >= 70
    assert set(live_workers(kv_stub(mesh.kv_a.address))) == set(mesh.workers)
    port = int(mesh.kv_b.address.rsplit(":", 1)[1])
    mesh.cluster.procs.remove(mesh.kv_b)
    mesh.kv_b = mesh.cluster.kv_service("kv-b", port)


@pytest.mark.timeout(120)
def test_kill_redis_under_load_then_index_rebuilt_from_snapshots(mesh: Mesh):
    kv = kv_stub(mesh.kv_a.address)
    ids = prompt(11, 1)
    holder = warm(mesh, ids)
    with Traffic(mesh.router.address) as traffic:
        traffic.wait_for(20)
        redis = mesh.cluster.redis
        assert redis is not None
        port = redis.port
        redis.proc.kill()
        redis.proc.wait()
        traffic.wait_for(30)  # served by rendezvous fallback while the index is gone
        mesh.cluster.start_redis(port)  # back empty, on the same port
        back = time.monotonic()

        def rebuilt() -> bool:
            live = live_workers(kv)
            return set(live) == set(mesh.workers) and all(w.blocks_indexed > 0 for w in live.values())

        wait_until(rebuilt, 5, "every worker registered again with its blocks")
        rebuilt_s = time.monotonic() - back
        traffic.wait_for(20)
    assert dict(traffic.errors) == {}
    assert rebuilt_s <= 5
    # The empty Redis learnt the prompt served before the crash from its holder's snapshot alone.
    assert matched(kv, MODEL_ID, ids)[holder] == len(ids) // BLOCK
