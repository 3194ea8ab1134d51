"""A background task that sends Redis commands ends when the daemon cancels it, although one
cancel can be lost on Python 3.11 (asyncio.wait_for in redis-py's send path; offloadd.edge.cancel)."""

from __future__ import annotations

import asyncio
import random

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from offloadd.edge.cancel import cancel_and_wait


async def _sweep_like(client: aioredis.Redis) -> None:
    """As the daemon's sweeper: Redis commands in a loop, Redis errors retried next round."""
    while True:
        await asyncio.sleep(0.001)
        try:
            await client.get("kvd:{cancel}:head")
            await client.xrange("kvd:{cancel}:log", "1-0", "5-0")
        except RedisError:
            pass


def test_cancel_and_wait_ends_a_task_in_the_middle_of_redis_commands(redis_url: str) -> None:
    async def scenario() -> tuple[int, int]:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=1.0)  # as --redis-timeout-s
        lost, rng = 0, random.Random(7)
        for _ in range(60):
            task = asyncio.create_task(_sweep_like(client))
            await asyncio.sleep(rng.uniform(0.001, 0.01))
            task.cancel()  # one plain cancel: lost when it lands as a send finishes
            await asyncio.wait({task}, timeout=0.2)
            lost += not task.done()
            assert await cancel_and_wait(task, timeout_s=5.0)
            assert task.done()
        never = asyncio.create_task(asyncio.sleep(0))
        await never
        assert await cancel_and_wait(never)  # an ended task: nothing to do
        await client.aclose()
        return lost, 60

    lost, trials = asyncio.run(scenario())
    print(f"plain cancels lost: {lost} of {trials}")  # 3.11: many; 3.12+: none
