"""Recovery's read of a layout's projection rows (offloadd.log.log_reads.LogReads.read_rows):
in one HGETALL up to ``whole_rows`` rows, paged beyond (-1 here: always paged) (the next page asked for before this one
is decoded); every row exactly once either way, and a row that does not decode named in one
error on any page. Real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from events.logkeys import LogKeys
from offloadd.errors import ForeignData
from offloadd.log.log_reads import LogReads
from offloadd.log.projection import ProjectedBlock, encode


def _rows(n: int) -> dict[bytes, ProjectedBlock]:
    return {i.to_bytes(32, "big"): ProjectedBlock(i, 0, 7 * i, None, (i, i + 1), b"", None)
            for i in range(n)}


def _read(redis_url: str, keys: LogKeys, page_rows: int, whole_rows: int = -1) -> dict[bytes, ProjectedBlock]:
    async def go() -> dict[bytes, ProjectedBlock]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await LogReads(client, keys).read_rows(keys.blocks(1), page_rows=page_rows, whole_rows=whole_rows)
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize(("page_rows", "whole_rows"), [(10, -1), (300, -1), (20_000, -1), (10, 1_500)])
def test_every_row_once_whatever_the_page(redis_url: str, namespace: str, page_rows: int,
                                          whole_rows: int) -> None:
    keys = LogKeys(namespace)
    rows = _rows(1_500)
    admin = redis.Redis.from_url(redis_url)
    admin.hset(keys.blocks(1), mapping={d: encode(r) for d, r in rows.items()})
    assert _read(redis_url, keys, page_rows, whole_rows) == rows


@pytest.mark.parametrize("whole_rows", [-1, 100])
def test_empty_projection(redis_url: str, namespace: str, whole_rows: int) -> None:
    assert _read(redis_url, LogKeys(namespace), 100, whole_rows) == {}


@pytest.mark.parametrize("whole_rows", [-1, 2_000])
def test_a_row_that_does_not_decode_is_named_whatever_its_page(redis_url: str, namespace: str,
                                                               whole_rows: int) -> None:
    keys = LogKeys(namespace)
    admin = redis.Redis.from_url(redis_url)
    admin.hset(keys.blocks(1), mapping={d: encode(r) for d, r in _rows(1_000).items()})
    admin.hset(keys.blocks(1), b"junk-field", b"\xc1 not msgpack")
    with pytest.raises(ForeignData) as err:
        _read(redis_url, keys, 50, whole_rows)
    assert f"field b'junk-field' of {keys.blocks(1)} does not decode" in str(err.value)
    assert "kvctl repair" in str(err.value)
