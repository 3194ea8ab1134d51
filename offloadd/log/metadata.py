"""Redis: the single writer of the log and the projection, and the reads recovery needs.

Every change goes through :meth:`MetadataStore.append`: under one lock it WATCHes the head
offset, checks it is still ours, then in one MULTI/EXEC appends the record (entry ID
``{offset}-0``), sets the head, the source's fencing position and the projection. Memory changes
only after EXEC succeeded (``apply``). When a write fails the outcome is in doubt (EXEC may have
reached Redis); the next write, or the sweeper, resolves it by reading the entry back: present
-> ``apply``, absent -> ``revert``. So memory and Redis never disagree for long, and never
silently. Appends that share a MULTI/EXEC are isolated: one whose record cannot be encoded or
whose projection raises fails alone (and is reverted), the rest are written; a write that fails
as a whole reverts every append in it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from events.logkeys import LogKeys
from events.records import RECORD_FIELD, decode_record, encode_record, entry_id
from events.schema import Event, LogRecord, SchemaError
from events.state import CacheState
from offloadd.errors import OffloaddError
from offloadd.log import projection
from offloadd.log.projection import EngineRecord, LayoutRecord, Pipe, ProjectedBlock

log = logging.getLogger(__name__)

_record_decoder = msgspec.msgpack.Decoder(LogRecord)  # events.records' format, unvalidated


class RedisUnavailable(OffloaddError):
    """Redis could not be reached or refused the write; nothing was applied in memory."""


class LogConflict(OffloaddError):
    """The log moved under us (another writer, or a write we gave up on landed late)."""


@dataclass
class Append:
    """One record to append, with its projection updates and its in-memory effect."""

    source: str
    incarnation: int
    seq: int | Callable[[], int]  # a callable is evaluated under the writer lock
    events: tuple[Event, ...]
    project: Callable[[Pipe], None]
    apply: Callable[[LogRecord], None]
    revert: Callable[[], None] = lambda: None
    ts: float = field(default_factory=time.time)


@dataclass
class Persisted:
    """Everything recovery reads from Redis except the log itself."""

    head: int
    daemon: dict[str, str]
    sources: dict[str, tuple[int, int]]
    layouts: list[LayoutRecord]
    engines: list[EngineRecord]
    blocks: dict[int, dict[bytes, ProjectedBlock]]


class RecordRefused(OffloaddError):
    """One record of a write group could not be written (its projection raised): nothing of it
    was applied and its ``revert`` ran; the rest of the group was written without it."""


_Pending = tuple[Append, "asyncio.Future[LogRecord]"]  # an append and its caller's answer
_Batch = list[tuple[LogRecord, bytes, Append]]  # records of one MULTI/EXEC, encoded
_GROUP_MAX = 64


class _ProjectFailed(Exception):
    """``item``'s project callback raised while its MULTI/EXEC was being built."""

    def __init__(self, item: Append) -> None:
        super().__init__(f"project callback of a {item.source} record raised")
        self.item = item


def _revert(item: Append) -> None:
    try:
        item.revert()
    except Exception:  # a bug in a revert callback must not stop the others'
        log.exception("revert failed")


def _fail(
    group: list[_Pending], exc: Exception, cause: BaseException | None = None,
    revert: bool = True,
) -> None:
    """Answer every unanswered append of ``group`` with ``exc``; with ``revert``, nothing of
    them is in the log, so each one's ``revert`` undoes what its caller did ahead of the write
    (reserved victims, a commit's flag). A write in doubt is reverted when resolved instead."""
    exc.__cause__ = cause
    for item, future in group:
        if future.done():
            continue
        future.set_exception(exc)
        if revert:
            _revert(item)


class MetadataStore:
    def __init__(self, client: aioredis.Redis, keys: LogKeys, state: CacheState) -> None:
        self.client: Any = client  # redis-py's stubs type replies as unions; we read bytes
        self.state = state
        self.keys = keys
        self.head = 0
        self._lock = asyncio.Lock()
        self._queue: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None
        self._in_doubt: _Batch | None = None
        self._appended = asyncio.Event()

    @property
    def is_in_doubt(self) -> bool:
        return self._in_doubt is not None

    # -- writing --------------------------------------------------------------------------

    async def append(self, item: Append) -> LogRecord:
        """Append one non-empty record durably, then apply it in memory; or raise.

        Appends that arrive while a write is in flight are grouped into the next MULTI/EXEC
        (each still its own record and offset, applied in order), so concurrent engines and
        commits share Redis round trips instead of queueing for one each.
        """
        assert item.events, "never append an empty record"
        future: asyncio.Future[LogRecord] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        return await asyncio.shield(future)  # a cancelled caller must not cancel the write

    async def _drain(self) -> None:
        while self._queue:
            group, self._queue = self._queue[:_GROUP_MAX], self._queue[_GROUP_MAX:]
            async with self._lock:
                try:
                    await self._write_group(group)
                except Exception as exc:  # a bug in the writer: never hang callers, undo theirs
                    log.exception("append failed")
                    _fail(group, exc, revert=self._in_doubt is None)

    async def _write_group(self, group: list[_Pending]) -> None:
        """Write ``group`` in one MULTI/EXEC. An append that cannot be written (its record does
        not encode, its projection raises) fails alone and is reverted; the others are written."""
        try:
            await self._resolve_locked()
        except (RedisUnavailable, LogConflict) as exc:
            _fail(group, exc)
            return
        while True:
            group = [p for p in group if not p[1].done()]
            batch = self._records(group)
            group = [p for p in group if not p[1].done()]  # _records refuses what cannot encode
            if not batch:
                return
            try:
                await self._write(batch)
            except _ProjectFailed as exc:
                log.error("%s; writing the rest of its group without it", exc, exc_info=exc.__cause__)
                _fail([p for p in group if p[0] is exc.item],
                      RecordRefused(f"record not written: {exc.__cause__!r}"), exc.__cause__)
                continue
            except WatchError as exc:
                _fail(group, LogConflict(f"log head moved past {self.head} under the daemon"), exc)
                return
            except (RedisError, OSError) as exc:
                self._in_doubt = batch
                _fail(group, RedisUnavailable(f"Redis unreachable, record not applied: {exc}"), exc,
                      revert=False)
                return
            break
        outcomes = self._commit_locked(batch)
        for (record, _, _), (_, future), error in zip(batch, group, outcomes, strict=True):
            if future.done():
                continue
            if error is None:
                future.set_result(record)
            else:
                future.set_exception(error)

    def _records(self, group: list[_Pending]) -> _Batch:
        """Number and encode ``group``'s records; one that cannot be encoded (a value msgpack
        cannot hold) is refused alone with a SchemaError and reverted, the others close up."""
        batch: _Batch = []
        last_seq: dict[str, int] = {}  # callable seqs: the 2nd record of a source in a group is +1
        for item, future in group:
            if callable(item.seq):
                prev = last_seq.get(item.source)
                seq = item.seq() if prev is None else prev + 1
            else:
                seq = item.seq
            record = LogRecord(self.head + 1 + len(batch), item.source, item.incarnation, seq,
                               item.ts, item.events)
            try:
                data = encode_record(record)
            except Exception as exc:  # msgspec: TypeError, OverflowError, EncodeError...
                log.error("record of %s seq %d cannot be logged: %r", item.source, seq, exc)
                _fail([(item, future)], SchemaError(
                    f"record of {item.source} (seq {seq}) cannot be logged: {exc}"), exc)
                continue
            last_seq[item.source] = seq
            batch.append((record, data, item))
        return batch

    async def _write(self, batch: _Batch) -> None:
        keys = self.keys
        async with self.client.pipeline(transaction=True) as pipe:
            await pipe.watch(keys.head)
            current = int(await pipe.get(keys.head) or 0)
            if current != self.head:
                raise WatchError(f"head is {current}, expected {self.head}")
            pipe.multi()
            for record, data, item in batch:
                pipe.xadd(keys.log, {RECORD_FIELD: data}, id=entry_id(record.offset))
                pipe.hset(keys.sources, record.source,
                          projection.encode((record.incarnation, record.source_seq)))
                try:
                    item.project(pipe)
                except Exception as exc:  # leaving the block discards every queued command
                    raise _ProjectFailed(item) from exc
            pipe.set(keys.head, batch[-1][0].offset)
            await pipe.execute()

    def _commit_locked(self, batch: _Batch) -> list[Exception | None]:
        """Apply records the log now holds, in order; per record, what its apply raised."""
        outcomes: list[Exception | None] = []
        for record, _, item in batch:
            self.head = record.offset
            self.state.apply(record)  # the one reducer, over exactly what the log holds
            try:
                item.apply(record)
            except Exception as exc:  # logged already: not reverted, the others still applied
                log.exception("apply of logged record %d failed", record.offset)
                outcomes.append(exc)
            else:
                outcomes.append(None)
        self._appended.set()
        self._appended = asyncio.Event()
        return outcomes

    async def resolve(self) -> None:
        """Settle a write whose outcome is in doubt (called by the sweeper too)."""
        if self._in_doubt is None:
            return
        async with self._lock:
            await self._resolve_locked()

    async def _resolve_locked(self) -> None:
        """One MULTI/EXEC landed entirely or not at all: read its records back to know which."""
        if self._in_doubt is None:
            return
        batch = self._in_doubt
        first, last = batch[0][0].offset, batch[-1][0].offset
        try:
            found = await self.client.xrange(self.keys.log, entry_id(first), entry_id(last))
            head = int(await self.client.get(self.keys.head) or 0)
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable: {exc}") from exc
        self._in_doubt = None
        ours = [data for _, data, _ in batch]
        if [fields.get(RECORD_FIELD) for _, fields in found] == ours and head == last:
            log.warning("write in doubt had landed; applying offsets %d..%d", first, last)
            self._commit_locked(batch)
        elif not found and head == self.head:
            for _, _, item in reversed(batch):
                item.revert()
        else:
            raise LogConflict(f"log at offsets {first}..{last} is not what the daemon wrote "
                              f"(head {head})")

    async def write_registration(self, layouts: list[LayoutRecord], engine: EngineRecord | None) -> None:
        """Persist layouts (ids, chunk counts) and an engine registration; not a log record."""
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                for rec in layouts:
                    pipe.hset(self.keys.layouts, rec.identity, projection.encode(rec))
                if engine is not None:
                    pipe.hset(self.keys.engines, engine.engine_id, projection.encode(engine))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable, registration not saved: {exc}") from exc

    def next_append(self) -> asyncio.Event:
        """An event set at the next append: take it before reading, wait on it after."""
        return self._appended

    # -- reading --------------------------------------------------------------------------

    async def read_range(self, start: int, count: int, validate: bool = True) -> list[LogRecord]:
        """Records from offset ``start`` on. ``validate=False`` is for replays into the reducer,
        which validates every event itself (and records, rather than raises, what is wrong)."""
        try:
            entries = await self.client.xrange(self.keys.log, entry_id(max(1, start)), "+", count=count)
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable: {exc}") from exc
        if validate:
            return [decode_record(fields[RECORD_FIELD]) for _, fields in entries]
        try:
            return [_record_decoder.decode(fields[RECORD_FIELD]) for _, fields in entries]
        except msgspec.DecodeError as exc:
            raise SchemaError(f"log record: {exc}") from exc

    async def iter_log(self, page: int = 2000) -> AsyncIterator[list[LogRecord]]:
        """The whole log, page by page; the next page is fetched while the caller works."""
        nxt = asyncio.ensure_future(self.read_range(1, page, validate=False))
        while True:
            records = await nxt
            if not records:
                return
            nxt = asyncio.ensure_future(
                self.read_range(records[-1].offset + 1, page, validate=False)
            )
            try:
                yield records
            except BaseException:
                nxt.cancel()
                raise

    async def engine_gpu_set(self, engine_id: str) -> set[str]:
        try:
            members = await self.client.smembers(self.keys.engine_blocks(engine_id))
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable: {exc}") from exc
        return {m.decode() for m in members}

    async def load(self) -> Persisted:
        k = self.keys
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.get(k.head)
                pipe.hgetall(k.daemon)
                pipe.hgetall(k.sources)
                pipe.hgetall(k.layouts)
                pipe.hgetall(k.engines)
                head, daemon, sources, layouts, engines = await pipe.execute()
            layout_recs = [projection.decode_layout(v) for v in layouts.values()]
            engine_recs = [projection.decode_engine(v) for v in engines.values()]
            blocks: dict[int, dict[bytes, ProjectedBlock]] = {}
            for rec in layout_recs:
                rows: dict[bytes, ProjectedBlock] = {}
                cursor = 0
                while True:  # paged, so no single reply is large enough to hit the timeout
                    cursor, page = await self.client.hscan(k.blocks(rec.layout_id), cursor, count=20_000)
                    rows.update((d, projection.decode_block(v)) for d, v in page.items())
                    if cursor == 0:
                        break
                blocks[rec.layout_id] = rows
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable during recovery: {exc}") from exc
        return Persisted(
            head=int(head or 0),
            daemon={f.decode(): v.decode() for f, v in daemon.items()},
            sources={s.decode(): projection.decode_position(v) for s, v in sources.items()},
            layouts=layout_recs,
            engines=engine_recs,
            blocks=blocks,
        )

    async def set_daemon_fields(self, fields: dict[str, str]) -> None:
        try:
            await self.client.hset(self.keys.daemon, mapping=fields)
        except (RedisError, OSError) as exc:
            raise RedisUnavailable(f"Redis unreachable: {exc}") from exc
