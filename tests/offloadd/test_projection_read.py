"""Recovery's read of a layout's projection rows (offloadd.log.log_reads.LogReads.read_rows):
in one HGETALL up to ``whole_rows`` rows, paged beyond (-1 here: always paged) (the next page asked for before this one
is decoded); every row exactly once either way, and a row that does not decode named in one
error on any page. Real Redis."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis
import redis.asyncio as aioredis

from events.logkeys import LogKeys
from offloadd.errors import ForeignData
from offloadd.log.log_reads import LogReads
from offloadd.log.projection import ProjectedBlock, decode_entry, encode
from offloadd.tier.index import BlockState, RestoredEntry, SlotEntry


def _rows(n: int) -> dict[bytes, ProjectedBlock]:
    return {i.to_bytes(32, "big"): ProjectedBlock(i, 0, 7 * i, None, (i, i + 1), b"", None)
            for i in range(n)}


def _as_entries(rows: dict[bytes, ProjectedBlock]) -> dict[bytes, SlotEntry]:
    """What recovery restores of each row: its fields, READY, not verified, no generation yet."""
    return {d: SlotEntry(r.slot, r.group_idx, r.checksum, r.parent, r.token_ids, r.extra_keys,
                         r.lora_name, BlockState.READY, verified=False) for d, r in rows.items()}


def _read(redis_url: str, keys: LogKeys, page_rows: int, whole_rows: int = -1) -> dict[bytes, SlotEntry]:
    async def go() -> dict[bytes, SlotEntry]:
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
    got = _read(redis_url, keys, page_rows, whole_rows)
    assert {d: msgspec.structs.asdict(e) for d, e in got.items()} == {
        d: msgspec.structs.asdict(e) for d, e in _as_entries(rows).items()}


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


def test_a_row_is_the_entry_it_restores_field_by_field() -> None:
    """SlotEntry's first fields are ProjectedBlock's, in its order: a row decodes straight into
    the entry (projection.decode_entry), the entry's own state at its restore defaults."""
    assert SlotEntry.__struct_fields__[:len(ProjectedBlock.__struct_fields__)] == ProjectedBlock.__struct_fields__
    row = ProjectedBlock(5, 1, 2**63 + 9, b"p" * 32, (300, 70_000), b"\xa0", "lora-a")
    entry = decode_entry(encode(row))
    assert isinstance(entry, RestoredEntry)
    assert msgspec.structs.asdict(entry) == {
        **msgspec.structs.asdict(row), "state": BlockState.READY, "owner": "", "pins": 0,
        "verified": False, "generation": 0}


@pytest.mark.parametrize("whole_rows", [-1, 2_000])
def test_a_row_longer_than_the_projections_fields_is_refused(redis_url: str, namespace: str,
                                                             whole_rows: int) -> None:
    """A row with more than the projection's fields would fill the entry's own state (READY,
    verified, its pins) from Redis: it is named as a row that does not decode instead."""
    keys = LogKeys(namespace)
    admin = redis.Redis.from_url(redis_url)
    admin.hset(keys.blocks(1), mapping={d: encode(r) for d, r in _rows(100).items()})
    forged = msgspec.msgpack.encode([3, 0, 7, None, [3, 4], b"", None, "ready", "", 0, True, 0])
    admin.hset(keys.blocks(1), b"forged", forged)
    with pytest.raises(ForeignData) as err:
        _read(redis_url, keys, 50, whole_rows)
    assert f"field b'forged' of {keys.blocks(1)} does not decode" in str(err.value)
