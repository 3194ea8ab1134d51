"""The Redis fixture is real: data survives a stop/start (AOF), as the daemon's tests rely on."""

from __future__ import annotations

import redis

from tests.support.redis_proc import RedisProcess


def test_own_redis_survives_restart(own_redis: RedisProcess) -> None:
    client = redis.Redis.from_url(own_redis.url)
    client.set("k", "v")
    client.execute_command("BGREWRITEAOF")
    client.close()
    own_redis.stop()
    own_redis.start()
    client = redis.Redis.from_url(own_redis.url)
    assert client.get("k") == b"v"
    client.close()
