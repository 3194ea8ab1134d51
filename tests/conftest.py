"""Shared fixtures: a real Redis per test session, flushed for each test that asks for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import offloadd  # noqa: F401  before anything loads grpc: the daemon's gRPC fork settings (DECISIONS 51)
from tests.support.redis_proc import RedisProcess, free_port


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(Path(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisProcess) -> str:
    """URL of a running, empty Redis (shared by the session, flushed per test)."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A Redis of this test's own, for tests that stop and restart it."""
    server = RedisProcess(tmp_path / "own-redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def port() -> int:
    return free_port()
