"""Fixtures shared by every test package: a real private redis-server."""

from __future__ import annotations

import atexit
import sys
import uuid

import pytest

from kvmesh.loopback import RedisServer
from tests.support import filter_own_stderr_at_exit


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """triton's nanobind extension reports the objects it still holds when the interpreter exits, a
    wall of ``nanobind: leaked ...`` lines after the summary that reads like a failure. Only those
    lines are dropped (tests/support/); the exit status and every other line of stderr stay.

    NOTE: at exit, not now: pytest puts its own stderr back after this hook; and before nanobind's
    own exit handler, which triton registered earlier (atexit runs the last registered first)."""
    if "triton" in sys.modules:
        atexit.register(filter_own_stderr_at_exit)


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
