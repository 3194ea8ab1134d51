"""Recovery's read of the log's tail (offloadd.log.log_reads.LogReads.iter_log): pages asked for
by ID range in pipelined batches read every record once and in order, from any start, across
a gap, at an exact multiple of the page; an entry that is not a record inside a range is
refused, as the open-ended read refused it. Real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from events.logkeys import LogKeys
from events.records import RECORD_FIELD, encode_record, entry_id
from events.schema import BlockRemoved, LogRecord
from offloadd.errors import ForeignData
from offloadd.log.log_reads import LogReads


def _write(admin: redis.Redis, keys: LogKeys, offsets: range) -> None:
    pipe = admin.pipeline(transaction=False)
    for off in offsets:
        record = LogRecord(off, "e", 1, off, 1.0, (BlockRemoved((off,), "GPU"),))
        pipe.xadd(keys.log, {RECORD_FIELD: encode_record(record)}, id=entry_id(off))
    pipe.execute()


def _offsets(redis_url: str, keys: LogKeys, start: int, page: int, per_read: int) -> list[list[int]]:
    async def go() -> list[list[int]]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            pages = LogReads(client, keys).iter_log(page, start=start, pages_per_read=per_read)
            return [[r.offset for r in records] async for records in pages]
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize(("n", "start", "page", "per_read"), [
    (0, 1, 10, 4),      # empty log
    (95, 1, 10, 4),     # ends inside a page of the third batch
    (80, 1, 10, 4),     # an exact multiple of page and batch
    (95, 37, 10, 3),    # from the middle
    (95, 200, 10, 3),   # past the end
    (95, 0, 2000, 16),  # recovery's sizes: one short page
])
def test_every_record_once_in_order(redis_url: str, namespace: str, n: int, start: int,
                                    page: int, per_read: int) -> None:
    keys = LogKeys(namespace)
    _write(redis.Redis.from_url(redis_url), keys, range(1, n + 1))
    pages = _offsets(redis_url, keys, start, page, per_read)
    assert [off for got in pages for off in got] == list(range(max(1, start), n + 1))
    assert all(0 < len(got) <= page for got in pages)


def test_records_after_a_gap_are_read(redis_url: str, namespace: str) -> None:
    keys = LogKeys(namespace)
    admin = redis.Redis.from_url(redis_url)
    _write(admin, keys, range(1, 101))
    admin.xdel(keys.log, *(entry_id(off) for off in range(21, 71)))  # a gap of 5 pages
    got = [off for page in _offsets(redis_url, keys, 1, 10, 2) for off in page]
    assert got == [*range(1, 21), *range(71, 101)]


@pytest.mark.parametrize("foreign_id", ["15-1", "30-5", "1000000-0"])
def test_an_entry_that_is_not_a_record_is_refused(redis_url: str, namespace: str,
                                                  foreign_id: str) -> None:
    keys = LogKeys(namespace)
    admin = redis.Redis.from_url(redis_url)
    after = min(int(foreign_id.split("-")[0]), 40)  # stream IDs only grow: written in order
    _write(admin, keys, range(1, after + 1))
    admin.xadd(keys.log, {"x": "1"}, id=foreign_id)
    _write(admin, keys, range(after + 1, 41))
    with pytest.raises(ForeignData) as err:
        _offsets(redis_url, keys, 1, 10, 4)
    assert f"log entry {foreign_id} of {keys.log} is not a record" in str(err.value)
