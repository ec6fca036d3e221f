"""The Redis store's own machinery (not index semantics: those are test_index_conformance.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvmesh.kv_service.store_redis import RedisIndex

pytestmark = pytest.mark.anyio


async def test_close_ends_the_load_refresher_even_when_a_cancellation_is_swallowed(redis_url, redis_namespace):
    """On Python 3.11 a redis-py write (asyncio.wait_for) swallows a cancellation that arrives as
    the write completes; the refresher then ran on and a stopping kv_service waited for it forever.
    Closed mid-refresh at random moments, every index closes."""
    rng = random.Random(7)
    for k in range(60):
        idx = RedisIndex(redis_url, f"{redis_namespace}{k}", shards=3)
        idx.INFO_REFRESH_S = 0.0005  # refreshing nearly all the time: the close lands mid-round
        await idx.lookup("m", [b"h" * 16], 0)  # starts the refresher
        await asyncio.sleep(rng.random() * 0.005)
        await asyncio.wait_for(idx.close(), 5)
        assert idx._refresher is None
