"""Fixtures of the Redis Cluster tests: a real 3-primary, 3-replica cluster on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_cluster import RedisCluster


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """One cluster for the tests that kill nothing (each uses namespaces of its own)."""
    c = RedisCluster(tmp_path_factory.mktemp("shared-cluster"), primaries=3, node_timeout_ms=1000)
    c.start()
    yield c
    c.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A cluster of this test's own (tests kill its nodes); cluster-node-timeout 1 s."""
    c = RedisCluster(tmp_path / "cluster", primaries=3, node_timeout_ms=1000)
    c.start()
    yield c
    c.stop()
