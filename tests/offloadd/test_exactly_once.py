"""Exactly once in the log: a batch resent after its write's reply was lost is a duplicate, and
the log itself refuses a (source, incarnation, seq) it already holds.

The lost reply is real: a script on another connection keeps Redis busy (it serves nobody
meanwhile), the writer's socket times out and closes, and when Redis is free again it reads the
writer's command, already on its socket, and runs it. The write landed; the writer never heard.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from events.codec_proto import EventBatch
from events.logkeys import LogKeys
from events.records import RECORD_FIELD, decode_record
from events.schema import BlockStored, LogRecord
from events.state import CacheState
from offloadd.log.ingest import AckStatus, Ingest
from offloadd.log.metadata import (
    AlreadyLogged,
    Append,
    ForeignEntry,
    MetadataStore,
    RedisUnavailable,
)

# Busy for ARGV[1] microseconds: Redis runs no other command meanwhile (well under the 5 s
# after which it would answer BUSY).
_BUSY = """
local t = redis.call('TIME')
local until_us = t[1] * 1000000 + t[2] + tonumber(ARGV[1])
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= until_us
return 1
"""


def _stored(h: int) -> BlockStored:
    return BlockStored((h,), None, (1, 2, 3, 4), 4, "GPU")


def _append(source: str, incarnation: int, seq: int, reverted: list[int] | None = None) -> Append:
    def revert() -> None:
        if reverted is not None:
            reverted.append(seq)

    return Append(source, incarnation, seq, (_stored(seq),), lambda pipe: None,
                  lambda record: None, revert)


def _logged(redis_url: str, keys: LogKeys) -> list[tuple[str, int, int]]:
    admin = redis.Redis.from_url(redis_url)
    try:
        entries: Any = admin.xrange(keys.log)
        records = [decode_record(f[RECORD_FIELD]) for _, f in entries]
    finally:
        admin.close()
    return [(r.source, r.incarnation, r.source_seq) for r in records]


class LostReply:
    """Makes the next write of a writer whose socket times out at ``timeout_s`` land in Redis
    with its reply lost (module docstring)."""

    def __init__(self, redis_url: str, keys: LogKeys, busy_s: float = 0.8) -> None:
        self.url = redis_url
        self.keys = keys
        self.busy_s = busy_s
        self._busy: asyncio.Task[object] | None = None
        self._admin = aioredis.Redis.from_url(redis_url, socket_timeout=10)

    async def __aenter__(self) -> LostReply:
        self._busy = asyncio.ensure_future(self._admin.eval(_BUSY, 0, int(self.busy_s * 1e6)))
        await asyncio.sleep(0.1)  # the script runs: Redis reads nothing else until it ends
        return self

    async def landed(self, head: int, timeout_s: float = 5.0) -> None:
        """Until the busy script ended and the lost write set the head to ``head``."""
        assert self._busy is not None
        await self._busy
        deadline = time.monotonic() + timeout_s
        while int(await self._admin.get(self.keys.head) or 0) != head:
            assert time.monotonic() < deadline, "the write in doubt never landed"
            await asyncio.sleep(0.01)

    async def __aexit__(self, *exc: object) -> None:
        if self._busy is not None and not self._busy.done():
            await self._busy
        await self._admin.aclose()


def _writer_client(redis_url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(redis_url, socket_timeout=0.3, retry=Retry(NoBackoff(), 0))


def test_a_resend_of_a_batch_whose_reply_was_lost_is_a_duplicate(redis_url: str) -> None:
    """Batch 2's write lands but its reply is lost; the engine resends batch 2 before anything
    resolved the doubt: it is acked DUPLICATE (not logged again), and batch 3 follows it."""
    keys = LogKeys("resend")

    async def scenario() -> tuple[list[tuple[int, int, int]], CacheState]:
        client = _writer_client(redis_url)
        md = MetadataStore(client, keys, CacheState())
        ingest = Ingest(md, md.state, max_batch_events=16)
        ingest.log_epoch = "epoch-1"  # as recovery sets it: no read of it while Redis is busy
        acks = []
        acks.append(await ingest.publish(EventBatch("e", 1, 1, 0.0, (_stored(1),))))
        async with LostReply(redis_url, keys) as lost:
            with pytest.raises(RedisUnavailable):
                await ingest.publish(EventBatch("e", 1, 2, 0.0, (_stored(2),)))
            assert md.is_in_doubt
            await lost.landed(head=2)
        acks.append(await ingest.publish(EventBatch("e", 1, 2, 0.0, (_stored(2),))))  # the resend
        acks.append(await ingest.publish(EventBatch("e", 1, 3, 0.0, (_stored(3),))))
        await client.aclose()
        return [(a.status, a.acked_seq, a.log_offset) for a in acks], md.state

    acks, state = asyncio.run(scenario())
    assert acks == [(AckStatus.APPLIED, 1, 1), (AckStatus.DUPLICATE, 2, 0), (AckStatus.APPLIED, 3, 3)]
    assert _logged(redis_url, keys) == [("e", 1, 1), ("e", 1, 2), ("e", 1, 3)]
    assert state.fence("e") == (1, 3) and state.violations == []
    assert state.view() == {("e", "GPU", 0): frozenset({1, 2, 3})}


def test_the_log_refuses_a_record_whose_write_was_in_doubt(redis_url: str) -> None:
    """The same lost reply, and the writer asked to append the record again while its memory
    does not hold it yet (no fence above the log): the write script refuses it."""
    keys = LogKeys("twice")

    async def scenario() -> tuple[list[LogRecord | BaseException], list[int], MetadataStore]:
        client = _writer_client(redis_url)
        md = MetadataStore(client, keys, CacheState())
        reverted: list[int] = []
        await md.append(_append("e", 1, 1))
        async with LostReply(redis_url, keys) as lost:
            with pytest.raises(RedisUnavailable):
                await md.append(_append("e", 1, 2))
            await lost.landed(head=2)
        outcomes = await asyncio.gather(
            md.append(_append("e", 1, 2, reverted)), md.append(_append("e", 1, 3, reverted)),
            return_exceptions=True)
        await client.aclose()
        return list(outcomes), reverted, md

    outcomes, reverted, md = asyncio.run(scenario())
    assert isinstance(outcomes[0], AlreadyLogged)
    assert "incarnation 1, seq 2" in str(outcomes[0])
    assert isinstance(outcomes[1], LogRecord) and outcomes[1].offset == 3
    assert reverted == [2]
    assert _logged(redis_url, keys) == [("e", 1, 1), ("e", 1, 2), ("e", 1, 3)]
    assert md.head == 3 and md.state.fence("e") == (1, 3)


def test_the_log_fences_each_source_by_incarnation_and_seq(redis_url: str) -> None:
    """Refused: a position logged already (alone, or twice in one write), an earlier seq, an
    older incarnation. Taken: the next seq, a newer incarnation (exactly, also above 2**53,
    where Lua's numbers would round), and incarnation 0, which is not fenced."""
    keys = LogKeys("fence")
    big = 2**60

    async def scenario() -> list[str]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        tries = [
            [("e", 1, 1)], [("e", 1, 1)], [("e", 1, 2), ("e", 1, 2), ("f", 1, 1)], [("e", 1, 1)],
            [("e", 2, 1)], [("e", 1, 3)], [("e", 0, 0)], [("e", 0, 0)],
            [("big", big, 1)], [("big", big + 1, 1)], [("big", big, 2)],
        ]
        outcomes = []
        for group in tries:
            got = await asyncio.gather(*(md.append(_append(*pos)) for pos in group),
                                       return_exceptions=True)
            outcomes += ["refused" if isinstance(g, AlreadyLogged) else
                         "ok" if isinstance(g, LogRecord) else repr(g) for g in got]
        await client.aclose()
        return outcomes

    assert asyncio.run(scenario()) == [
        "ok", "refused", "ok", "refused", "ok", "refused", "ok", "refused", "ok", "ok",
        "ok", "ok", "refused",
    ]
    assert _logged(redis_url, keys) == [
        ("e", 1, 1), ("e", 1, 2), ("f", 1, 1), ("e", 2, 1), ("e", 0, 0), ("e", 0, 0),
        ("big", big, 1), ("big", big + 1, 1),
    ]


def test_a_position_that_is_not_ours_refuses_the_write(redis_url: str) -> None:
    """A source's position in the sources hash that is not an (incarnation, seq) the daemon
    wrote: the write is refused as a whole (ForeignEntry naming the source and kvctl), nothing
    is written, and memory is unchanged."""
    keys = LogKeys("badpos")
    admin = redis.Redis.from_url(redis_url)
    admin.hset(keys.sources, "e", b"\x92\xcf\x01")  # a truncated uint64

    async def scenario() -> tuple[BaseException | LogRecord, int]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        (got,) = await asyncio.gather(md.append(_append("e", 1, 1)), return_exceptions=True)
        await client.aclose()
        return got, md.head

    got, head = asyncio.run(scenario())
    assert isinstance(got, ForeignEntry)
    assert "source 'e'" in str(got) and "kvctl repair" in str(got)
    assert head == 0 and admin.xlen(keys.log) == 0 and admin.get(keys.head) is None
    admin.close()
