"""Fixtures shared by every test package: a real private redis-server."""

from __future__ import annotations

import uuid

import pytest

from kvmesh.loopback import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def redis_namespace() -> str:
    """A fresh key namespace per test, so tests never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``pytest.mark.anyio``) run on asyncio, as the services do."""
    return "asyncio"
