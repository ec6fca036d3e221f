"""The index's Redis client on its own (kv_service/redis_cluster.py ``ShardedRedis``): where each shard
lives, script calls routed to their shard and reloaded where a node lost them, the namespace's shard
count, and when a replica may answer. The index over it: test_redis_cluster.py, test_redis_replicas.py
and the conformance suite."""

from __future__ import annotations

import pytest

from kvmesh.contract.errors import FailedPrecondition, Unavailable
from kvmesh.kv_service.redis_cluster import ShardedRedis, as_str, home_shard, replica_readable, shard_tags
from kvmesh.loopback import free_port

pytestmark = pytest.mark.anyio

WHERE = "redis.call('SET', KEYS[1], ARGV[2]) return KEYS[1] .. ' ' .. ARGV[1] .. ' ' .. ARGV[2]"
"""A script that says which key and prefix it ran with, and leaves its argument in its key."""


def test_shard_tags_fall_in_equal_slot_ranges_and_do_not_depend_on_anything_stored():
    from redis.crc import key_slot

    for n in (2, 3, 4, 7):
        tags = shard_tags("kvmesh", n)
        assert [key_slot(t.encode()) * n // 16384 for t in tags] == list(range(n))
    assert shard_tags("kvmesh", 1) == ["kvmesh"]  # one shard: the layout before sharding


def test_home_shard_spreads_ids_that_differ_only_in_their_last_character():
    # NOTE: CRC32 puts w0..w3 all on one shard of 3; BLAKE2b does not.
    assert [home_shard(f"w{i}", 3) for i in range(6)] == [home_shard(f"w{i}", 3) for i in range(6)]
    assert len({home_shard(f"w{i}", 3) for i in range(4)}) > 1
    assert {home_shard(f"worker-{i}", 1) for i in range(10)} == {0}


async def test_script_calls_go_to_their_shard_and_a_lost_script_is_loaded_again(redis_url, redis_namespace):
    r = ShardedRedis(redis_url, redis_namespace, 3, {"where": WHERE})
    try:
        got = [as_str(x) for x in await r.each("where", "x")]
        assert got == [f"kvm:{{{t}}}:workers kvm:{{{t}}}:" + " x" for t in shard_tags(redis_namespace, 3)]
        k = r.home("w7")
        assert as_str(await r.call("where", "w7")) == f"{r.keys[k]} {r.prefixes[k]} w7"
        assert [as_str(v) for v in await r.round([(s, ("GET", r.keys[s])) for s in range(3)])] == [
            "w7" if s == k else "x" for s in range(3)]
        await r.round([(0, ("SCRIPT", "FLUSH"))])  # a restarted Redis: its scripts are gone
        assert as_str(await r.on(2, "where", "again")) == f"{r.keys[2]} {r.prefixes[2]} again"
    finally:
        await r.close()


async def test_a_namespace_keeps_the_shard_count_it_was_first_used_with(redis_url, redis_namespace):
    one, three = ShardedRedis(redis_url, redis_namespace, 1, {}), ShardedRedis(redis_url, redis_namespace, 3, {})
    try:
        await one.ping()
        with pytest.raises(FailedPrecondition, match=r"kept in 1 shard\(s\).*not 3"):
            await three.ping()
    finally:
        await one.close()
        await three.close()


async def test_a_redis_that_does_not_answer_is_unavailable(redis_namespace):
    r = ShardedRedis(f"redis://127.0.0.1:{free_port()}", redis_namespace, 2, {}, socket_timeout=0.5)
    try:
        with pytest.raises(Unavailable, match="unreachable"):
            await r.ping()
    finally:
        await r.close()


async def test_on_a_cluster_each_shards_calls_run_on_the_master_that_owns_its_slot(redis_cluster, redis_namespace):
    r = ShardedRedis(redis_cluster.url, redis_namespace, 3, {"where": WHERE})
    try:
        await r.each("where", "here")
        masters = redis_cluster.master_ports()
        held = [set(redis_cluster.cli(redis_cluster.ports.index(p), "KEYS", f"kvm:{{{redis_namespace}/*").split())
                for p in masters]
        assert held == [{key} for key in r.keys]  # shard k's key on master k, in slot order
    finally:
        await r.close()


@pytest.mark.parametrize(("info", "readable"), [
    ("role:slave\r\nmaster_link_status:up\r\nmaster_sync_in_progress:0\r\n", True),
    ("role:slave\r\nmaster_link_status:down\r\nmaster_sync_in_progress:0\r\nmaster_link_down_since_seconds:3\r\n",
     True),
    ("role:slave\r\nmaster_link_status:down\r\nmaster_sync_in_progress:0\r\nmaster_link_down_since_seconds:9\r\n",
     False),
    ("role:slave\r\nmaster_link_status:down\r\nmaster_sync_in_progress:0\r\nmaster_link_down_since_seconds:-1\r\n",
     False),
    ("role:slave\r\nmaster_link_status:up\r\nmaster_sync_in_progress:1\r\n", False),
    ("role:master\r\nconnected_slaves:1\r\n", False),
])
def test_a_replica_is_read_while_in_sync_or_briefly_cut_off_from_its_master(info, readable):
    assert replica_readable(info, stale_s=5) is readable
