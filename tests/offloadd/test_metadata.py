"""The single writer against real Redis: writes whose outcome is in doubt are settled truthfully,
and a log that moved under the daemon stops it (crash-only) instead of forking the history."""

from __future__ import annotations

import asyncio
from pathlib import Path

import cbor2
import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from events.logkeys import LogKeys
from events.records import RECORD_FIELD, decode_record, encode_record
from events.schema import BlockStored, LogRecord, SchemaError
from events.state import CacheState
from offloadd.client import OffloadClient, OffloadClientError
from offloadd.log.metadata import (
    Append,
    LogConflict,
    MetadataStore,
    RecordRefused,
    RedisUnavailable,
)
from offloadd.log.projection import Pipe
from tests.offloadd.conftest import GROUP, chain
from tests.support.offloadd_proc import DaemonProcess


def _event(h: int) -> BlockStored:
    return BlockStored((h,), None, (1, 2, 3, 4), 4, "GPU")


def _append(md: MetadataStore, seq: int, applied: list[int], reverted: list[int]) -> Append:
    def apply(record: LogRecord) -> None:
        applied.append(record.offset)

    return Append("e", 1, seq, (_event(seq),), lambda pipe: None, apply,
                  revert=lambda: reverted.append(seq))


def test_write_in_doubt_is_settled_to_match_redis(redis_url: str) -> None:
    keys = LogKeys("doubt")

    async def scenario() -> tuple[int, int, list[int], list[int]]:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
        md = MetadataStore(client, keys, CacheState())
        applied: list[int] = []
        reverted: list[int] = []
        await md.append(_append(md, 1, applied, reverted))
        admin = redis.Redis.from_url(redis_url)
        admin.execute_command("CLIENT", "PAUSE", "600", "WRITE")  # EXEC waits, the client gives up
        with pytest.raises(RedisUnavailable):
            await md.append(_append(md, 2, applied, reverted))
        assert md.is_in_doubt
        await asyncio.sleep(0.8)
        await md.resolve()  # landed or not: memory must now agree with Redis
        assert not md.is_in_doubt
        head = int(admin.get(keys.head) or 0)
        entries = admin.xrange(keys.log)
        admin.close()
        await client.aclose()
        assert [decode_record(f[RECORD_FIELD]).offset for _, f in entries] == list(range(1, head + 1))
        return head, md.head, applied, reverted

    head, mem_head, applied, reverted = asyncio.run(scenario())
    assert mem_head == head
    assert (applied, reverted) in (([1, 2], []), ([1], [2]))
    assert applied[-1] == head


def test_foreign_writer_stops_the_daemon(tmp_path: Path, redis_url: str, namespace: str) -> None:
    proc = DaemonProcess(tmp_path / "d", redis_url, namespace)
    proc.start()
    try:
        with OffloadClient(proc.target) as c:
            c.register_engine("e", 1, "m", [GROUP])
            res = c.reserve("e", 0, chain(1))
            admin = redis.Redis.from_url(redis_url)
            admin.set(LogKeys(namespace).head, 999)  # someone else writes this namespace's log
            admin.close()
            with pytest.raises(OffloadClientError) as err:
                c.commit("e", res.reservation_id)
            assert err.value.code.name == "INTERNAL"
            assert "log head moved" in err.value.message
        assert proc.proc is not None
        assert proc.proc.wait(timeout=10) == 3
        proc.proc = None
        assert "fatal" in proc.log_tail()
    finally:
        proc.kill()


def test_append_conflict_raises(redis_url: str) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, LogKeys("conflict"), CacheState())
        await client.set(md.keys.head, 5)
        with pytest.raises(LogConflict):
            await md.append(_append(md, 1, [], []))
        await client.aclose()

    asyncio.run(scenario())


def test_write_that_landed_is_applied_on_resolve(redis_url: str) -> None:
    """EXEC reached Redis but its reply was lost: resolve finds our exact record and applies it."""
    keys = LogKeys("landed")

    async def scenario() -> tuple[list[int], list[int], int]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        applied: list[int] = []
        reverted: list[int] = []
        await md.append(_append(md, 1, applied, reverted))
        # stand-in for the lost reply: the same write made by a twin writer at the same head
        twin = MetadataStore(client, keys, CacheState())
        twin.head = md.head
        item = _append(md, 2, applied, reverted)
        record = await twin.append(item)
        applied.clear()
        md._in_doubt = [(record, encode_record(record), item)]
        await md.resolve()
        await client.aclose()
        return applied, reverted, md.head

    assert asyncio.run(scenario()) == ([2], [], 2)


def test_concurrent_appends_share_a_transaction(redis_url: str) -> None:
    """Appends arriving while a write is in flight go in the next MULTI/EXEC, each its own
    record with its own offset, and daemon-style callable seqs stay contiguous per source."""
    keys = LogKeys("group")

    async def scenario() -> tuple[list[int], list[int], CacheState]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        seqs = {"d": 0}

        def item(source: str, h: int) -> Append:
            def apply(record: LogRecord) -> None:
                if source == "d":
                    seqs["d"] = record.source_seq

            seq = (lambda: seqs["d"] + 1) if source == "d" else h
            return Append(source, 1, seq, (_event(h),), lambda pipe: None, apply)

        records = await asyncio.gather(
            *(md.append(item("d", h)) for h in range(1, 11)),
            *(md.append(item("e", h)) for h in range(1, 11)),
        )
        await client.aclose()
        return [r.offset for r in records], [r.source_seq for r in records if r.source == "d"], md.state

    offsets, daemon_seqs, state = asyncio.run(scenario())
    assert sorted(offsets) == list(range(1, 21))
    assert sorted(daemon_seqs) == list(range(1, 11))
    assert state.fence("d") == (1, 10) and state.fence("e") == (1, 10)
    assert state.violations == []
    admin = redis.Redis.from_url(redis_url)
    stored = [decode_record(f[RECORD_FIELD]) for _, f in admin.xrange(keys.log)]
    admin.close()
    assert [r.offset for r in stored] == list(range(1, 21))


def test_submitted_appends_land_in_order_whoever_waits(redis_url: str) -> None:
    """``submit`` queues without a task of the caller's: the futures answer in submission order;
    one nobody awaits still lands, and a caller of ``append`` cancelled at once does not cancel
    its write (the shield)."""
    keys = LogKeys("submit")

    async def scenario() -> tuple[list[int], list[int], list[int], CacheState]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        applied: list[int] = []
        reverted: list[int] = []
        futures = [md.submit(_append(md, seq, applied, reverted)) for seq in (1, 2)]
        unawaited = md.submit(_append(md, 3, applied, reverted))
        cancelled = asyncio.ensure_future(md.append(_append(md, 4, applied, reverted)))
        await asyncio.sleep(0)
        cancelled.cancel()
        records = await asyncio.gather(*futures)
        while len(applied) < 4:
            await md.next_append().wait()
        assert unawaited.done() and unawaited.result().source_seq == 3
        await client.aclose()
        return [r.offset for r in records], applied, reverted, md.state

    offsets, applied, reverted, state = asyncio.run(scenario())
    assert offsets == [1, 2]
    assert applied == [1, 2, 3, 4] and reverted == []
    assert state.fence("e") == (1, 4)
    admin = redis.Redis.from_url(redis_url)
    stored = [decode_record(f[RECORD_FIELD]) for _, f in admin.xrange(keys.log)]
    admin.close()
    assert [(r.offset, r.source_seq) for r in stored] == [(1, 1), (2, 2), (3, 3), (4, 4)]


def test_an_unwritable_record_fails_alone_and_is_reverted(redis_url: str) -> None:
    """One group, five appends: one record msgpack cannot hold (a CBOR tag in extra_keys), one
    whose projection raises. Those two fail and are reverted; the other three are written with
    contiguous offsets, the daemon's callable seqs stay contiguous, and Redis holds exactly them."""
    keys = LogKeys("isolate")

    async def scenario() -> tuple[list[object], list[str], list[str], CacheState]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        seqs = {"d": 0}
        applied: list[str] = []
        reverted: list[str] = []

        def item(name: str, extra: tuple[object, ...] | None = None, bad_project: bool = False) -> Append:
            def apply(record: LogRecord) -> None:
                seqs["d"] = record.source_seq
                applied.append(name)

            def project(pipe: Pipe) -> None:
                pipe.hset(keys.daemon, name, "1")
                if bad_project:
                    raise RuntimeError("projection bug")

            event = BlockStored((len(applied) + 1,), None, (1, 2, 3, 4), 4, "CPU", extra_keys=extra)
            return Append("d", 1, lambda: seqs["d"] + 1, (event,), project, apply,
                          revert=lambda: reverted.append(name))

        outcomes = await asyncio.gather(
            md.append(item("a")),
            md.append(item("tag", extra=((cbor2.CBORTag(1234, 5),),))),
            md.append(item("b")),
            md.append(item("project", bad_project=True)),
            md.append(item("c")),
            return_exceptions=True,
        )
        await client.aclose()
        return list(outcomes), applied, reverted, md.state

    outcomes, applied, reverted, state = asyncio.run(scenario())
    good = [r for r in outcomes if isinstance(r, LogRecord)]
    assert [(r.offset, r.source_seq) for r in good] == [(1, 1), (2, 2), (3, 3)]
    assert isinstance(outcomes[1], SchemaError) and "cannot be logged" in str(outcomes[1])
    assert isinstance(outcomes[3], RecordRefused)
    assert applied == ["a", "b", "c"]
    assert sorted(reverted) == ["project", "tag"]
    assert state.fence("d") == (1, 3) and state.violations == []
    admin = redis.Redis.from_url(redis_url)
    stored = [decode_record(f[RECORD_FIELD]) for _, f in admin.xrange(keys.log)]
    projected = admin.hgetall(keys.daemon)
    head = int(admin.get(keys.head) or 0)
    admin.close()
    assert [r.offset for r in stored] == [1, 2, 3] and head == 3
    assert sorted(projected) == [b"a", b"b", b"c"]  # the failed projection left nothing behind


def test_a_failed_group_write_reverts_every_append(redis_url: str) -> None:
    """A bug in the writer fails the whole group; every append in it is reverted (victims back
    to ready, slots freed), none is left half done, and the next write goes through."""
    keys = LogKeys("revert-all")

    async def scenario() -> tuple[list[object], list[int], list[int], LogRecord]:
        client = aioredis.Redis.from_url(redis_url)
        md = MetadataStore(client, keys, CacheState())
        applied: list[int] = []
        reverted: list[int] = []

        async def broken(batch: object) -> None:
            raise RuntimeError("writer bug")

        write = md._write
        md._write = broken  # type: ignore[method-assign]
        outcomes = await asyncio.gather(
            *(md.append(_append(md, seq, applied, reverted)) for seq in (1, 2, 3)),
            return_exceptions=True,
        )
        md._write = write  # type: ignore[method-assign]
        record = await md.append(_append(md, 1, applied, reverted))
        await client.aclose()
        return list(outcomes), applied, sorted(reverted), record

    outcomes, applied, reverted, record = asyncio.run(scenario())
    assert all(isinstance(o, RuntimeError) for o in outcomes)
    assert reverted == [1, 2, 3]
    assert applied == [1] and record.offset == 1
