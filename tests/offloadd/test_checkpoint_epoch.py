"""A checkpoint is written only into the log epoch it was taken from: a daemon that ended its
log after a failover lost writes (offloadd.log.failover deletes the epoch, the pointer...) and
has not stopped yet writes no checkpoint of the log that is gone into the next epoch's keys."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from events.logkeys import LogKeys
from events.schema import BlockStored
from events.state import CacheState
from offloadd.config import OffloaddConfig
from offloadd.log.checkpoint import Checkpointer, CheckpointFailed
from offloadd.log.failover import end_rewound_log
from offloadd.log.metadata import Append, MetadataStore


def test_no_checkpoint_is_written_after_the_log_was_ended(redis_url: str) -> None:
    keys = LogKeys("ckpt-epoch")

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        await client.set(keys.epoch, "e" * 16)  # what recovery sets for a new log

        async def append(start: int, n: int) -> None:
            for i in range(start, start + n):
                await md.append(Append("e", 1, i + 1, (BlockStored((i,), None, (1, 2, 3, 4), 4, "GPU"),),
                                       lambda pipe: None, lambda record: None))

        cp = Checkpointer(md, OffloaddConfig(namespace=keys.namespace), "e" * 16)
        await append(0, 5)
        # The log "went back" to 3 (as a promoted replica's would) and the daemon ended it;
        # before the daemon stops, its checkpointer wakes with records unwritten (no pointer
        # yet: the pointer check alone would let it through).
        await client.set(keys.head, "3")
        assert "ended it" in await end_rewound_log(client, keys, "", 3, 5)
        with pytest.raises(CheckpointFailed, match="was ended; not written"):
            await cp.write()
        left = [k async for k in client.scan_iter(match=keys.checkpoint + "*")]
        assert left == [] and await client.get(keys.epoch) is None
        # The next epoch's checkpointer writes as usual.
        await client.set(keys.epoch, "f" * 16)
        again = Checkpointer(md, OffloaddConfig(namespace=keys.namespace), "f" * 16)
        written = await again.write()
        assert written is not None and written.epoch == "f" * 16
        await client.aclose()

    asyncio.run(scenario())
