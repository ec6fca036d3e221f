"""A real Redis Cluster on loopback for the kv_service tests (3 masters, started once)."""

from __future__ import annotations

import pytest

from kvmesh.loopback import RedisCluster


@pytest.fixture(scope="session")
def redis_cluster():
    """3 masters, no replicas, built with `redis-cli --cluster create` (~2 s); shared by every test
    that only reads and writes its own namespace (the fault tests start their own)."""
    with RedisCluster(masters=3) as cluster:
        yield cluster
