"""The bridge tests' Redis client, on the session's Redis (tests/conftest.py's ``redis_url``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()
