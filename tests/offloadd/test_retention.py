"""The log's retention horizon (offloadd.log.retention) on a real Redis log: each retention
setting is a floor, the horizon the oldest of them, never past the oldest kept checkpoint's
offset + 1, and the last record always stays."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from events.logkeys import LogKeys
from events.schema import BlockStored
from events.state import CacheState
from offloadd.config import OffloaddConfig
from offloadd.log.metadata import Append, MetadataStore
from offloadd.log.retention import first_since, horizon


def test_the_horizon_is_the_oldest_floor_within_the_kept_checkpoints(redis_url: str) -> None:
    keys = LogKeys("retention-horizon")

    def cfg(retention_records: int = 0, retention_s: float = 0.0, retention_bytes: int = 0) -> OffloaddConfig:
        return OffloaddConfig(namespace=keys.namespace, retention_records=retention_records,
                              retention_s=retention_s, retention_bytes=retention_bytes)

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())

        async def append(start: int, n: int) -> None:
            for i in range(start, start + n):
                await md.append(Append("e", 1, i + 1, (BlockStored((i,), None, (1, 2, 3, 4), 4, "GPU"),),
                                       lambda pipe: None, lambda record: None))

        await append(0, 10)
        await asyncio.sleep(0.6)
        since = time.time()
        await append(10, 10)
        first, length = await md.log_bounds()
        assert (first, length, md.head) == (1, 20, 20)
        # No floor set: only the last record stays (and not past the kept checkpoint + 1).
        assert await horizon(md, cfg(), [20], first, length) == 20
        assert await horizon(md, cfg(), [7, 20], first, length) == 8
        # Records: the newest 5 stay.
        assert await horizon(md, cfg(retention_records=5), [20], first, length) == 16
        # Seconds: the records stamped in the last ~0.3 s (the second ten) stay.
        assert await first_since(md, since, 1, 20) == 11
        assert await horizon(md, cfg(retention_s=time.time() - since + 0.3), [20], first, length) == 11
        # The oldest floor wins: records keep more than seconds here.
        assert await horizon(md, cfg(retention_records=15, retention_s=time.time() - since + 0.3),
                             [20], first, length) == 6
        # Bytes: about half the log's memory keeps about half its records; more than all of it,
        # everything.
        usage = int(await client.memory_usage(keys.log) or 0)
        half = await horizon(md, cfg(retention_bytes=usage // 2), [20], first, length)
        assert 5 <= half <= 15
        assert await horizon(md, cfg(retention_bytes=10 * usage), [20], first, length) <= first
        await client.aclose()

    asyncio.run(scenario())
