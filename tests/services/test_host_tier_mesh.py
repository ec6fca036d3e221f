"""The host KV tier across the mesh: real Redis, kv_service, two tiny-model workers with a host tier
and the router. A prefix the device evicted lands again on the worker that holds it in host memory,
the worker loads it back (cached_tokens counts it), and after the run the index holds exactly each
worker's two pools (docs/kv-service.md, "Tiers"; docs/router.md, "Host-tier hits")."""

from __future__ import annotations

import pytest

from kvmesh.client import Client
from kvmesh.loopback import free_port
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.server import RouterServer
from kvmesh.stack import wait_serving
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from tests.support import wait_until

BS = 16


def prompt(k: int, n: int = 90) -> list[int]:
    """A prompt of its own (5 full blocks of 16 and a partial one, no block shared with another k)."""
    return [(13 * i + 97 * k + 5) % 300 + 3 for i in range(n)]


def direct(worker, ids: list[int]) -> None:
    """A request sent to the worker itself, not through the router."""
    stub = worker_pb2_grpc.WorkerStub(dial(worker.address))
    list(stub.Generate(worker_pb2.WorkerGenerateRequest(prompt_token_ids=ids, sampling=common_pb2.SamplingParams(
        max_tokens=2, ignore_eos=True)), timeout=60))


def pools(kv_stub, worker_id: str, candidates: set[bytes]) -> tuple[set[bytes], set[bytes]]:
    """Of ``candidates``, what the index says the worker holds on its device and in its host tier."""
    device, host = set(), set()
    for h in candidates:
        r = kv_stub.GetBlock(kpb.GetBlockRequest(block_hash=h), timeout=5)
        if worker_id in r.holders:
            device.add(h)
        if worker_id in r.host_holders:
            host.add(h)
    return device, host


@pytest.mark.parametrize("policy", ["kv-aware", "dynamo"])
def test_an_evicted_prefix_lands_again_on_its_host_tier_and_the_index_agrees_with_both_pools(
        policy, kv_server, start_worker, model_dir):
    kv_addr = f"127.0.0.1:{kv_server.port}"
    # 12 device blocks (11 usable): one 90-token prompt takes 6, so two more push the first out
    workers = [start_worker(f"w{i}", kv_addr, num_blocks=12, max_model_len=128, host_kv_blocks=64) for i in range(2)]
    cfg = RouterConfig(host="127.0.0.1", port=free_port(), kv_service=kv_addr, model_dirs=[str(model_dir)],
                       routing=RoutingConfig(policy=policy, discovery_interval_s=0.2, speculative_ttl_s=0.0,
                                             policy_config=PolicyConfig(seed=0)))
    router = RouterServer(cfg).start()
    kv_stub = kpb_grpc.KVServiceStub(dial(kv_addr))
    client = Client(f"127.0.0.1:{router.port}", timeout=60)
    try:
        wait_serving(f"127.0.0.1:{router.port}", timeout=20)
        # the router learns each worker's step cost from the loads its Lookups carry: prompts of several
        # lengths, so that the fit tells a prefill token's cost from a step's (one length cannot)
        for k in range(12):
            client.generate(prompt(100 + k, 16 + 9 * k), max_tokens=4, ignore_eos=True)
        p = prompt(0)
        chain = workers[0].engine.block_hasher.hash_prompt(p)
        first = client.generate(p, max_tokens=4, ignore_eos=True)
        holder = next(w for w in workers if chain[0] in w.engine.cached_block_hashes())
        # the holder's device evicts p (and q): two prompts sent to it directly push them to its host tier
        q = prompt(1)
        direct(holder, q)
        for k in (2, 3):
            direct(holder, prompt(k))
        wait_until(lambda: pools(kv_stub, holder.worker_id, set(chain))[1] == set(chain[:5]),
                   what="p's blocks in the holder's host tier, in the index")
        assert not pools(kv_stub, holder.worker_id, set(chain))[0]
        # a host hit on the holder (q, loaded back), so that its reports show what a load costs there
        direct(holder, q)
        assert holder.engine.stats().host_cache_hits == 5 * BS

        def reported_loads() -> int:
            info = {i.worker_id: i for i in kv_stub.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers}
            return info[holder.worker_id].load.host_loaded_blocks_total

        wait_until(lambda: reported_loads() == 5, what="the holder's report of its loads")
        client.generate(prompt(200, 40), max_tokens=4, ignore_eos=True)  # a pick that reads that report
        if policy == "kv-aware":
            learner = router.router.policy.cost
            assert learner.estimate(holder.worker_id) is not None
            assert learner.load_s_per_block(holder.worker_id) is not None
        other = next(w for w in workers if w is not holder)
        before = other.engine.stats().prefix_cache_queries
        picks = []
        core = router.router.core
        pick = core.pick

        def recorded(plan, candidates=None, *, count=True):
            d = pick(plan, candidates, count=count)
            picks.append(({c.worker_id: (c.matched_blocks, c.host_blocks) for c in plan.candidates}, d))
            return d

        core.pick = recorded
        again = client.generate(p, max_tokens=4, ignore_eos=True)
        core.pick = pick
        # the router saw the index's host continuation of p on the holder, and nothing on the other
        seen, decision = picks[-1]
        assert seen == {holder.worker_id: (0, 5), other.worker_id: (0, 0)}
        assert again.token_ids == first.token_ids
        if policy == "dynamo" or decision.worker_id == holder.worker_id:
            # NOTE: dynamo credits a host block 0.75 of a device one, whatever it costs; kv-aware prices
            # it by the learned load time against the prefill it saves, and on a tiny CPU model the
            # learned prefill cost can be 0 (the pricing itself is tests/router/core/test_host_tier_routing.py)
            assert decision.worker_id == holder.worker_id
            # it went to the holder, which loaded the prefix back from host memory
            assert again.usage.cached_tokens == 5 * BS
            assert holder.engine.stats().host_cache_hits == 2 * 5 * BS
            assert other.engine.stats().prefix_cache_queries == before
        else:
            assert again.usage.cached_tokens == 0
        # after the run: the index holds exactly each worker's device pool and host tier
        seen = {h for w in workers for h in w.engine.cached_block_hashes() | w.engine.host_block_hashes()}
        for w in workers:
            wait_until(lambda w=w: pools(kv_stub, w.worker_id, seen) == (w.engine.cached_block_hashes(),
                                                                          w.engine.host_block_hashes()),
                       what=f"the index to hold {w.worker_id}'s two pools")
        info = {i.worker_id: i for i in kv_stub.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers}
        for w in workers:
            assert (info[w.worker_id].blocks_indexed, info[w.worker_id].host_blocks_indexed) == (
                len(w.engine.cached_block_hashes()), len(w.engine.host_block_hashes()))
    finally:
        client.close()
        router.stop(0.5)
